"""Fused AdamW: a drop-in for ``optax.adamw`` whose update is one kernel per
parameter leaf.

Every hyper-parameter (learning rate, b1, b2, eps, eps_root, weight decay)
reaches the kernel in a small float32 operand together with the per-step bias
corrections, so Python floats, schedules and traced scalars
(``optax.inject_hyperparams``) all run the same compiled kernel; only the
options that change the arithmetic (apply the update, Nesterov, decay this
leaf or not) are static attributes. The moments are aliased to their outputs,
so a donated optimizer state is updated in place; the update is written over
gradients computed in the same jit; :meth:`AdamW.step` also writes the new
parameters over the old ones instead of returning updates (donate them too
and a step allocates nothing). float64 and complex parameters, and moments of
other dtypes, run the jnp reference (``jaxops.reference.adamw_leaf``).

optax is not a separate runtime dependency of jaxops: flax, which is one,
depends on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32
_OP = "jaxops.optim.adamw"
# First-moment dtypes the kernels store: float32, and bfloat16/float16 (the
# parameters' own, optax's default for them, or mu_dtype=jnp.bfloat16 to save memory).
_KERNEL_MOMENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

Scalar = Union[float, jax.Array]
ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]


def _abstract_eval(grads, params, m, v, scalars, **params_):
  return (jax.core.ShapedArray(params.shape, params.dtype),
          jax.core.ShapedArray(params.shape, m.dtype), jax.core.ShapedArray(params.shape, _F32))


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
# The update is written over the gradients when those are temporaries of the
# traced function (jax.grad in the same jit, the standard train step): no
# fresh full-size buffer to fault in (update + apply_updates measured 1.2x and
# 1.7x faster over a 25M-parameter train step, docs/benchmarks-log.md). When they are
# its arguments, XLA would copy them into a
# fresh buffer first, which costs more than the fresh output the kernel fills
# (with huge pages): the update goes to a fresh output then.
adamw_update_p = _make("jaxops_adamw_update", {2: 1, 3: 2})
adamw_update_in_grads_p = _make("jaxops_adamw_update_in_grads", {0: 0, 2: 1, 3: 2})
adamw_step_p = _make("jaxops_adamw_step", {1: 0, 2: 1, 3: 2})


def _is_temporary(x) -> bool:
  """Whether ``x`` is computed inside the jaxpr being traced (not one of its
  inputs or constants): its buffer is free for the kernel to write over. An
  input, a constant, a value under another transformation (vmap, jvp) or a
  JAX whose tracers do not tell (an internal attribute) answer False, which
  costs a fresh output, never correctness."""
  return (type(x).__name__ == "DynamicJaxprTracer"
          and getattr(x, "parent", None) is not None)


class AdamWState(NamedTuple):
  """count: int32 scalar, the steps taken; mu, nu: the moments shaped like the
  parameters (mu in ``mu_dtype``, by default the parameters' dtype, as optax's;
  nu float32 for float32, bfloat16 and float16 parameters, the real dtype of
  float64 and complex ones)."""
  count: jax.Array
  mu: Any
  nu: Any


def _moment_dtypes(param_dtype, mu_dtype):
  """(mu, nu) dtypes for a parameter dtype: mu in ``mu_dtype``, else the
  parameters' own (optax's rule); nu at least float32 (a bfloat16 nu stalls,
  see :func:`adamw`) and real (|g|^2)."""
  nu = jnp.finfo(jnp.promote_types(param_dtype, _F32)).dtype
  return (param_dtype if mu_dtype is None else mu_dtype), nu


# eq=False: hashed by identity (jax.jit(tx.update) needs a hash; a mask dict has none).
@dataclasses.dataclass(frozen=True, eq=False)
class _AdamWUpdate:
  """The update function of :func:`adamw`; also carries :meth:`step`."""

  learning_rate: ScalarOrSchedule
  b1: Scalar
  b2: Scalar
  eps: Scalar
  eps_root: Scalar
  mu_dtype: Any
  weight_decay: ScalarOrSchedule
  mask: Any
  nesterov: bool
  implementation: str | None

  def init(self, params) -> AdamWState:
    def moments(path, p):
      _check_leaf(path, p)
      mu, nu = _moment_dtypes(jnp.result_type(p), self.mu_dtype)
      return jnp.zeros(jnp.shape(p), mu), jnp.zeros(jnp.shape(p), nu)

    mu, nu = _unzip(params, jax.tree_util.tree_map_with_path(moments, params), 2)
    return AdamWState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def __call__(self, updates, state: AdamWState, params=None, **extra_args):
    """optax's update: (gradients, state, params) -> (updates, new state).
    Extra keyword arguments (``optax.GradientTransformationExtraArgs``) are
    accepted and ignored, as optax.adamw ignores them."""
    del extra_args
    return self._run(updates, state, params, apply_updates=False)

  def step(self, grads, state: AdamWState, params, **extra_args):
    """(gradients, state, params) -> (new params, new state) in one kernel per
    leaf: ``update`` followed by ``optax.apply_updates``, with the parameters
    rounded once. Donate ``params`` and ``state`` to update them in place."""
    del extra_args
    return self._run(grads, state, params, apply_updates=True)

  def _scalars(self, count):
    """The kernel's scalars operand (layout: params/adamw.h) as a function of
    the real dtype the step computes in, with optax's arithmetic: 1 - b1 in
    Python double precision for a Python float, bias corrections from the
    incremented count, schedules at the count before it."""
    count_inc = _safe_increment(count)
    lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
    wd = self.weight_decay(count) if callable(self.weight_decay) else self.weight_decay
    b1, b2 = self.b1, self.b2
    values = (-1 * lr, b1, 1 - b1, b2, 1 - b2, self.eps, self.eps_root, wd,
              1 - b1 ** count_inc, 1 - b2 ** count_inc, 1 - b1 ** _safe_increment(count_inc))
    cache = {}

    def scalars(dtype, moment_dtype):
      """The operand for a step computing in ``dtype`` on a first moment of
      ``moment_dtype``."""
      key = (jnp.dtype(dtype), jnp.dtype(moment_dtype))
      if key not in cache:
        # optax multiplies the stored first moment by a Python float b1 in the
        # moment's dtype (b1 = 0.9 is 0.8984375 for a bfloat16 one).
        b1_moment = (jnp.asarray(b1, jnp.finfo(moment_dtype).dtype) if isinstance(b1, float)
                     else b1)
        cache[key] = jnp.stack([jnp.asarray(x).astype(dtype) for x in (*values, b1_moment)])
      return cache[key]

    return scalars

  def _decay_flags(self, grads):
    """A tree shaped like grads: whether each leaf gets the weight decay. optax
    skips it for a constant 0 (not for a traced or scheduled one) and for the
    leaves ``mask`` (a prefix tree of bools, or a callable of the updates)
    marks False."""
    wd = self.weight_decay
    decays = callable(wd) or not isinstance(wd, float) or wd != 0.0
    if self.mask is None:
      return jax.tree.map(lambda _: decays, grads)
    mask_tree = self.mask(grads) if callable(self.mask) else self.mask
    return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: decays and _mask_flag(flag), sub),
                        mask_tree, grads)

  def _run(self, grads, state, params, *, apply_updates):
    if params is None:
      raise validation.value_error(
          _OP, "params", "be given to update (for the weight decay, as optax.adamw needs them)",
          "None")
    if not isinstance(state, AdamWState):
      raise validation.type_error(_OP, "state", "be the AdamWState made by init",
                                  validation.describe(state))
    scalars = self._scalars(state.count)
    options = dict(apply_updates=apply_updates, nesterov=self.nesterov)

    def leaf(path, g, p, m, v, decay):
      _check_leaf(path, p)
      where = jax.tree_util.keystr(path)
      validation.shape(_OP, f"grads{where}", g, jnp.shape(p), of=f"params{where}.shape")
      g, p = jnp.asarray(g), jnp.asarray(p)
      if self._kernel_runs(where, g, p, m, v):
        prim = (adamw_step_p if apply_updates else
                adamw_update_in_grads_p if _is_temporary(g) else adamw_update_p)
        return prim(g, p, m, v, scalars(_F32, m.dtype), decay=decay, **options)
      real = jnp.finfo(jnp.promote_types(p.dtype, _F32)).dtype
      return reference.adamw_leaf(g, p, m, v, scalars(real, m.dtype), decay=decay, **options)

    results = jax.tree_util.tree_map_with_path(leaf, grads, params, state.mu, state.nu,
                                               self._decay_flags(grads))
    out, mu, nu = _unzip(grads, results, 3)
    return out, AdamWState(count=_safe_increment(state.count), mu=mu, nu=nu)

  def _kernel_runs(self, where, g, p, m, v) -> bool:
    """The kernel takes float32, bfloat16 and float16 parameters (gradients of
    the same dtype) with a float32, bfloat16 or float16 first moment;
    everything else (float64, complex, a float64 moment) runs the jnp
    reference, or is a clear error with implementation="ffi"."""
    if self.implementation == "ffi" and jnp.dtype(m.dtype) not in _KERNEL_MOMENT_DTYPES:
      primitive.use_kernel(_OP, self.implementation, {f"params{where}": p.dtype})  # names a parameter dtype first
      raise validation.type_error(
          _OP, f"state.mu{where}",
          "be float32, bfloat16 or float16 for implementation='ffi' (mu_dtype)", str(m.dtype))
    return (g.dtype == p.dtype and jnp.dtype(m.dtype) in _KERNEL_MOMENT_DTYPES
            and jnp.dtype(v.dtype) == _F32
            and primitive.use_kernel(_OP, self.implementation, {f"params{where}": p.dtype}))


def _unzip(like, results, count):
  """A tree like ``like`` whose leaves are tuples of ``count`` -> ``count`` trees."""
  treedef = jax.tree.structure(like)
  columns = list(zip(*treedef.flatten_up_to(results))) or [()] * count
  return tuple(jax.tree.unflatten(treedef, list(column)) for column in columns)


def _safe_increment(count):
  """count + 1, saturating at the dtype's maximum (as optax counts steps)."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(count < top, count + jnp.ones((), count.dtype), top)


def _mask_flag(flag) -> bool:
  # optax tests the mask's leaves with Python's `if`: they must be known now.
  if isinstance(flag, (bool, np.bool_)) or (
      isinstance(flag, (np.ndarray, jax.Array)) and not isinstance(flag, jax.core.Tracer)
      and jnp.shape(flag) == () and jnp.dtype(flag.dtype) == jnp.bool_):
    return bool(flag)
  raise validation.type_error(_OP, "mask", "have Python bools as leaves (True: decay the leaf)",
                              validation.describe(flag))


def _check_leaf(path, p):
  # AdamW updates floating-point or complex parameters only (a step counter in
  # the tree is an error).
  dtype = jnp.result_type(p)
  if not jnp.issubdtype(dtype, jnp.complexfloating):
    validation.floating_dtype(_OP, f"params{jax.tree_util.keystr(path)}", dtype)


def _hyperparameter(name, value, *, schedule=False, **bounds):
  """A Python number (range-checked, as a float), a scalar array (traced ones
  cannot be range-checked: optax.inject_hyperparams passes them) or, where
  ``schedule``, a callable of the step count."""
  if schedule and callable(value):
    return value
  if isinstance(value, (jax.Array, np.ndarray)):
    dtype = jnp.dtype(value.dtype)
    if jnp.shape(value) == () and (jnp.issubdtype(dtype, jnp.floating)
                                   or jnp.issubdtype(dtype, jnp.integer)):
      return value
  elif isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)):
    return validation.static_float(_OP, name, value, **bounds)
  expected = "a Python float, a real scalar array" + (" or a schedule" if schedule else "")
  raise validation.type_error(_OP, name, "be " + expected, validation.describe(value))


def _mu_dtype(value):
  if value is None:
    return None
  try:
    dtype = jax.dtypes.canonicalize_dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
    raise validation.type_error(_OP, "mu_dtype", "be None or a floating or complex dtype",
                                validation.describe(value))
  return dtype


class AdamW(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``), the
  class ``optax.adamw`` returns, with one more method, :meth:`step`, that also
  applies the update."""

  def step(self, grads, state: AdamWState, params, **extra_args):
    """``update`` then ``optax.apply_updates`` in one kernel per leaf; returns
    (new params, new state).

    Donate params and state to update them in place. ``jax.jit`` pairs donated
    buffers with results of the same shape and dtype in order, so pass them in
    the order they are returned, e.g. ``jit(f, donate_argnums=(1, 2))`` with
    ``f(grads, params, state) -> (params, state)`` (or keep both in one
    train-state pytree); in another order each buffer is paired with another
    leaf's result and XLA copies around the in-place kernel.
    """
    return self.update.step(grads, state, params, **extra_args)


def adamw(learning_rate: ScalarOrSchedule, b1: Scalar = 0.9, b2: Scalar = 0.999,
          eps: Scalar = 1e-8, eps_root: Scalar = 0.0, mu_dtype: Any = None,
          weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *, nesterov: bool = False,
          implementation: str | None = None) -> AdamW:
  """AdamW (decoupled weight decay): ``optax.adamw``'s signature, defaults and
  math, one fused kernel per parameter leaf.

  Per leaf, at step t = 1, 2, ...: ``m = b1 m + (1 - b1) g``, ``v = b2 v +
  (1 - b2) |g|^2``, ``m^ = m / (1 - b1^t)`` (Nesterov: ``b1 m / (1 - b1^(t+1))
  + (1 - b1) g / (1 - b1^t)``), and the update is ``-lr * (m^ / (sqrt(v / (1 -
  b2^t) + eps_root) + eps) + weight_decay * params)``, the decay term only on
  the leaves ``mask`` selects; ``lr`` and a scheduled weight decay are taken at
  t - 1 (as optax counts). Each leaf is one fused kernel: gradients, params, m
  and v read once; the update, m and v written once (m and v in place when the
  state is donated).

  A drop-in for ``optax.adamw``: the same arguments and defaults (including
  ``weight_decay=1e-4``), the same update to float32 rounding, the same state
  dtypes for the first moment (``mu_dtype``, by default the parameters'
  dtype: bfloat16 for bfloat16 parameters, read and written by the kernel),
  and it composes as optax transformations do (``optax.chain``,
  ``optax.MultiSteps``, ``optax.inject_hyperparams``, extra keyword arguments
  to ``update``). What differs, deliberately:

  * the second moment is float32 for bfloat16 and float16 parameters (real
    for complex ones), where optax keeps it in the parameters' dtype: with the
    default b2 = 0.999 (which rounds to 1.0 in bfloat16) each step changes v
    by ~0.1%, below bfloat16's resolution (0.8%), so a bfloat16 v stops
    tracking the gradients.
  * low-precision parameters and moments are updated in float32 and rounded
    once, where optax computes in their dtype (b1 as it multiplies the stored
    first moment is rounded to the moment's dtype, as in optax); the kernel
    stores a low-precision first moment rounded and computes the update from
    the unrounded value, as optax does for ``mu_dtype=jnp.bfloat16`` with
    float32 parameters.
  * the state is one :class:`AdamWState` (count, mu, nu), not optax's chain
    of states (``optax.tree_utils.tree_get(state, "mu")`` finds mu in both).

  Args:
    learning_rate: a Python float, a scalar array (e.g. traced by
      ``optax.inject_hyperparams``) or an optax schedule (count -> scalar).
    b1, b2: decay rates of the first and second moments; Python floats must
      be in [0, 1), scalar arrays are not range-checked (traced values cannot be).
    eps: added to the denominator outside the square root (Python: >= 0).
    eps_root: added inside the square root (Python: >= 0).
    mu_dtype: the first moment's dtype, or None for the parameters' own. The
      kernel stores float32, bfloat16 and float16; another dtype (float64)
      runs the jnp reference.
    weight_decay: decoupled weight decay (multiplied by the learning rate): a
      Python float, a scalar array or a schedule.
    mask: None, a pytree of bools with the structure of the parameters (or a
      prefix of it), or a callable returning one given the updates (as in
      optax): the weight decay applies where True.
    nesterov: NAdamW's Nesterov momentum (``optax.nadamw``).
    implementation: ``None`` (the kernel for float32, bfloat16 and float16
      parameters, the jnp reference for float64 and complex ones), ``"ffi"``
      (the kernel, a clear error for a dtype it lacks) or ``"xla"`` (the
      reference), as for the other ops.

  Returns:
    An :class:`AdamW`: an ``optax.GradientTransformationExtraArgs`` (use it
    with ``optax.apply_updates``, ``optax.chain``...) whose :meth:`AdamW.step`
    fuses the update and its application.
  """
  learning_rate = _hyperparameter("learning_rate", learning_rate, schedule=True)
  b1 = _hyperparameter("b1", b1, low=0.0, high=1.0, high_open=True)
  b2 = _hyperparameter("b2", b2, low=0.0, high=1.0, high_open=True)
  eps = _hyperparameter("eps", eps, low=0.0)
  eps_root = _hyperparameter("eps_root", eps_root, low=0.0)
  weight_decay = _hyperparameter("weight_decay", weight_decay, schedule=True)
  mu_dtype = _mu_dtype(mu_dtype)
  nesterov = validation.static_bool(_OP, "nesterov", nesterov)
  validation.choice(_OP, "implementation", implementation, primitive.IMPLEMENTATIONS)
  update = _AdamWUpdate(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                        nesterov, implementation)
  return AdamW(update.init, update)
