"""Fused AdamW: an optax.GradientTransformation whose update is one kernel per
parameter leaf.

The per-step scalars (learning rate, bias corrections) depend on the step
count, which is traced, so they reach the kernel as a small float32 operand;
b1, b2, eps and the weight decay are static attributes. The moments m and v
(float32) are aliased to their outputs, so a donated optimizer state is
updated in place; :meth:`AdamW.step` also writes the new parameters over the
old ones instead of returning updates (donate them too and a step allocates
nothing).

optax is not a separate runtime dependency of jaxops: flax, which is one,
depends on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32
_OP = "jaxops.optim.adamw"


def _abstract_eval(grads, params, m, v, scalars, **params_):
  return (jax.core.ShapedArray(params.shape, params.dtype),
          jax.core.ShapedArray(params.shape, _F32), jax.core.ShapedArray(params.shape, _F32))


def _batch_rule(prim, args, dims, **params):
  """Elementwise in the four tensors; a batched scalars operand (e.g. vmap over
  learning rates) takes the reference."""
  if dims[4] is not NOT_MAPPED:
    return None
  args, _ = batch_to_front(args, dims, (0, 1, 2, 3))
  outs = prim(*args, **params)
  return outs, (0,) * len(outs)


def _make(name, aliases):
  return FfiPrimitive(
      name=name, target="jaxops_adamw", abstract_eval=_abstract_eval,
      reference=reference.adamw_leaf, batch_rule=_batch_rule,
      input_output_aliases=aliases,
      # A parameter sharded over a mesh (FSDP, tensor parallel) updates in place
      # on each shard: the update is elementwise; the scalars stay whole.
      sharding=leading_axes("xxxxp -> xxx", whole_trailing=0))


# Operands (grads, params, m, v, scalars) -> (updates or new params, m, v).
# The updates are not written over the gradients: when those are arguments of
# the jitted step (not temporaries of its backward pass), XLA would copy them
# into a fresh buffer first, which costs more than the fresh output the kernel
# fills (with huge pages) instead.
adamw_update_p = _make("jaxops_adamw_update", {2: 1, 3: 2})
adamw_step_p = _make("jaxops_adamw_step", {1: 0, 2: 1, 3: 2})


class AdamWState(NamedTuple):
  """count: int32 scalar, the steps taken; mu, nu: float32 moments shaped like
  the parameters."""
  count: jax.Array
  mu: Any
  nu: Any


def _safe_increment(count):
  """count + 1, saturating at the dtype's maximum (as optax counts steps)."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(count < top, count + jnp.ones((), count.dtype), top)


@dataclasses.dataclass(frozen=True)
class _AdamWUpdate:
  """The update function of :func:`adamw`; also carries :meth:`step`."""

  learning_rate: Union[float, Callable[[jax.Array], jax.Array]]
  b1: float
  b2: float
  eps: float
  weight_decay: float
  implementation: str | None

  def init(self, params) -> AdamWState:
    def zeros(path, p):
      _check_leaf(path, p)
      return jnp.zeros(jnp.shape(p), _F32)

    zeros_tree = jax.tree_util.tree_map_with_path(zeros, params)
    return AdamWState(count=jnp.zeros([], jnp.int32), mu=zeros_tree,
                      nu=jax.tree.map(jnp.zeros_like, zeros_tree))

  def __call__(self, updates, state: AdamWState, params=None):
    """optax's update: (gradients, state, params) -> (updates, new state)."""
    return self._run(updates, state, params, apply_updates=False)

  def step(self, grads, state: AdamWState, params):
    """(gradients, state, params) -> (new params, new state) in one kernel per
    leaf: ``update`` followed by ``optax.apply_updates``, with the parameters
    rounded once. Donate ``params`` and ``state`` to update them in place."""
    return self._run(grads, state, params, apply_updates=True)

  def _run(self, grads, state, params, *, apply_updates):
    if params is None:
      raise validation.value_error(
          _OP, "params", "be given to update (for the weight decay, as optax.adamw needs them)",
          "None")
    if not isinstance(state, AdamWState):
      raise validation.type_error(_OP, "state", "be the AdamWState made by init",
                                  validation.describe(state))
    count_inc = _safe_increment(state.count)
    lr = self.learning_rate(state.count) if callable(self.learning_rate) else self.learning_rate
    scalars = jnp.stack([jnp.asarray(lr, _F32),
                         (1 - self.b1 ** count_inc).astype(_F32),
                         (1 - self.b2 ** count_inc).astype(_F32)])
    attributes = dict(b1=self.b1, one_minus_b1=1.0 - self.b1, b2=self.b2,
                      one_minus_b2=1.0 - self.b2, eps=self.eps,
                      weight_decay=self.weight_decay, apply_updates=apply_updates)
    prim = adamw_step_p if apply_updates else adamw_update_p

    def leaf(path, g, p, m, v):
      _check_leaf(path, p)
      where = jax.tree_util.keystr(path)
      validation.shape(_OP, f"grads{where}", g, jnp.shape(p), of=f"params{where}.shape")
      g, p = jnp.asarray(g), jnp.asarray(p)
      if g.dtype == p.dtype and primitive.use_kernel(_OP, self.implementation, [p.dtype]):
        return prim(g, p, m, v, scalars, **attributes)
      return reference.adamw_leaf(g, p, m, v, scalars, **attributes)

    results = jax.tree_util.tree_map_with_path(leaf, grads, params, state.mu, state.nu)
    treedef = jax.tree.structure(grads)
    out, mu, nu = (jax.tree.unflatten(treedef, list(parts))
                   for parts in zip(*treedef.flatten_up_to(results)))
    return out, AdamWState(count=count_inc, mu=mu, nu=nu)


def _check_leaf(path, p):
  # AdamW updates floating-point parameters only (a step counter in the tree is an error).
  validation.floating_dtype(_OP, f"params{jax.tree_util.keystr(path)}", jnp.result_type(p))


class AdamW(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` (``init``, ``update``) with one more
  method, :meth:`step`, that also applies the update."""

  def step(self, grads, state: AdamWState, params):
    """``update`` then ``optax.apply_updates`` in one kernel per leaf; returns
    (new params, new state).

    Donate params and state to update them in place. ``jax.jit`` pairs donated
    buffers with results of the same shape and dtype in order, so pass them in
    the order they are returned, e.g. ``jit(f, donate_argnums=(1, 2))`` with
    ``f(grads, params, state) -> (params, state)`` (or keep both in one
    train-state pytree); in another order each buffer is paired with another
    leaf's result and XLA copies around the in-place kernel.
    """
    return self.update.step(grads, state, params)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0, *, implementation=None) -> AdamW:
  """AdamW (decoupled weight decay), with the math and defaults of
  ``optax.adamw`` except ``weight_decay`` (0 here, 1e-4 there) and the moments,
  which are float32 for every parameter dtype.

  Per leaf, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, and the
  update is ``-lr * ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) +
  weight_decay * params)`` at step t = 1, 2, ...; ``lr`` is ``learning_rate``
  or, for a schedule, ``learning_rate(t - 1)`` (as optax counts). Each leaf is
  one fused kernel: gradients, params, m and v read once; the update, m and v
  written once (m and v in place when the state is donated).

  Args:
    learning_rate: a Python float or an optax schedule (step count -> scalar).
    b1, b2: decay rates of the first and second moments, Python floats in [0, 1).
    eps: added to the denominator, a Python float >= 0.
    weight_decay: decoupled weight decay (multiplied by the learning rate).
    implementation: ``None`` (the kernel where available, else jnp), ``"ffi"``
      or ``"xla"``, as for the other ops.

  Returns:
    An :class:`AdamW`: an ``optax.GradientTransformation`` (use it with
    ``optax.apply_updates``, ``optax.chain``...) whose :meth:`AdamW.step` fuses
    the update and its application.
  """
  # The hyper-parameters are static (kernel attributes); a schedule is the way to
  # vary the learning rate.
  if not callable(learning_rate):
    learning_rate = validation.static_float(_OP, "learning_rate", learning_rate)
  b1 = validation.static_float(_OP, "b1", b1, low=0.0, high=1.0, high_open=True)
  b2 = validation.static_float(_OP, "b2", b2, low=0.0, high=1.0, high_open=True)
  eps = validation.static_float(_OP, "eps", eps, low=0.0)
  weight_decay = validation.static_float(_OP, "weight_decay", weight_decay)
  validation.choice(_OP, "implementation", implementation, primitive.IMPLEMENTATIONS)
  update = _AdamWUpdate(learning_rate, b1, b2, eps, weight_decay, implementation)
  return AdamW(update.init, update)
