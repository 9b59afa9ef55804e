"""Fused AdamW: a drop-in for ``optax.adamw`` whose update is one kernel call
for all the parameter leaves.

Every hyper-parameter (learning rate, b1, b2, eps, eps_root, weight decay)
reaches the kernel in a small float32 operand together with the per-step bias
corrections, so Python floats, schedules and traced scalars
(``optax.inject_hyperparams``) all run the same compiled kernel; only the
options that change the arithmetic (apply the update, Nesterov, how many
leaves decay) are static attributes. One call takes every leaf (each with its
own shape and dtypes: the kernels read a table of the leaves' buffers), so a
step is one OpenMP region on the CPU and one launch on a GPU (per 384
leaves). The moments are aliased to their outputs, so a donated optimizer
state is updated in place; the kernel's update (implementation="ffi") is
written over gradients computed in the same jit; :meth:`AdamW.step` also
writes the new parameters over the old ones instead of returning updates
(donate them too and a step allocates nothing). float64 and complex parameters, and moments of other dtypes, run
the jnp reference (``jaxops.reference.adamw_leaf``), and so does ``update``
under implementation=None, where XLA fuses it with ``optax.apply_updates``
(see :meth:`_AdamWUpdate._kernel_runs`).

optax is not a separate runtime dependency of jaxops: flax, which is one,
depends on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.interpreters import mlir

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive
from jaxops._src.sharding import (
    devices_known, leading_axes, register_for_sharding, shard_locally, typed_results)

_F32 = jnp.float32
_OP = "jaxops.optim.adamw"
# First-moment dtypes the kernels store: float32, and bfloat16/float16 (the
# parameters' own, optax's default for them, or mu_dtype=jnp.bfloat16 to save memory).
# In params/adamw.h's order (AdamWFloat), which indexes b1 for each in the scalars.
_KERNEL_MOMENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_KERNEL_PARAM_DTYPES = _KERNEL_MOMENT_DTYPES
# Index of the first of those three b1 values (kAdamWB1Moment).
_B1_MOMENT = 11

Scalar = Union[float, jax.Array]
ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]


# -- the primitives: one call updates every leaf -----------------------------
#
# Operands: scalars (params/adamw.h), then per leaf grads, params, m, v;
# results per leaf: out (the update, or with apply_updates the new params),
# m, v. The first `decayed_leaves` leaves get the weight decay (the caller
# orders them so). Leaves may differ in shape and dtype.
_OPERANDS_PER_LEAF = 4
_RESULTS_PER_LEAF = 3


def _per_leaf(flat, size):
  """Consecutive groups of ``size``: a call's operands after the scalars, or
  its results, leaf by leaf."""
  return [tuple(flat[k:k + size]) for k in range(0, len(flat), size)]


def _result_avals(scalars, *leaf_avals, **params_):
  out = []
  for _, p, m, _ in _per_leaf(leaf_avals, _OPERANDS_PER_LEAF):
    out += [jax.core.ShapedArray(p.shape, p.dtype), jax.core.ShapedArray(p.shape, m.dtype),
            jax.core.ShapedArray(p.shape, _F32)]
  return tuple(out)


def _leaf_scalars(scalars, moment_dtype):
  """A leaf's scalars in the per-leaf layout of reference.adamw_leaf: the
  first kAdamWB1Moment entries and b1 for its first moment's dtype."""
  moment = _KERNEL_MOMENT_DTYPES.index(jnp.dtype(moment_dtype))
  return jnp.concatenate([scalars[:_B1_MOMENT], scalars[_B1_MOMENT + moment:][:1]])


def _reference(scalars, *leaf_operands, apply_updates, nesterov, decayed_leaves):
  out = []
  for i, (g, p, m, v) in enumerate(_per_leaf(leaf_operands, _OPERANDS_PER_LEAF)):
    out += reference.adamw_leaf(g, p, m, v, _leaf_scalars(scalars, m.dtype),
                                apply_updates=apply_updates, nesterov=nesterov,
                                decay=i < decayed_leaves)
  return tuple(out)


def _batch_rule(prim, args, dims, **params):
  """Elementwise in every leaf's tensors; a batched scalars operand (e.g. vmap
  over learning rates) takes the reference."""
  if dims[0] is not NOT_MAPPED:
    return None
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
  args = [args[0]] + [jnp.broadcast_to(a, (size, *a.shape)) if d is NOT_MAPPED
                      else jnp.moveaxis(a, d, 0) for a, d in zip(args[1:], dims[1:])]
  outs = prim(*args, **params)
  return outs, (0,) * len(outs)


# One leaf's sharding (scalars, grads, params, m, v -> out, m, v): a parameter
# sharded over a mesh (FSDP, tensor parallel) updates in place on each shard:
# the update is elementwise; the scalars stay whole.
_ONE_LEAF_SHARDING = leading_axes("pxxxx -> xxx", whole_trailing=0)


@dataclasses.dataclass(frozen=True)
class _LeafTablePrimitive(FfiPrimitive):
  """The mechanism's FfiPrimitive for a call over any number of leaves: its
  input-output aliases are per leaf (``leaf_aliases``: {operand: result} of
  one leaf), and on a mesh every leaf is partitioned on its own.

  Shardy gives each mesh axis to one factor of an op, while every leaf of a
  model is sharded over the same axes: so on a mesh of several devices the
  lowering runs one call per leaf, each under its own sharding rule (the
  one-leaf rule the per-leaf kernel had), and on one device one call for all.
  """

  leaf_aliases: Mapping[int, int] = dataclasses.field(default_factory=dict)

  def _aliases(self, operand_count):
    leaves = (operand_count - 1) // _OPERANDS_PER_LEAF
    return {1 + _OPERANDS_PER_LEAF * i + operand: _RESULTS_PER_LEAF * i + result
            for i in range(leaves) for operand, result in self.leaf_aliases.items()}

  def ffi_lowering(self, platform, target=None):
    target = self.target if target is None else target

    def lowering(ctx, *operands, **params):
      rule = jax.ffi.ffi_lowering(target, operand_output_aliases=self._aliases(len(operands)))
      return rule(ctx, *operands, **self._kernel_attributes(params))

    return lowering

  def kernel_lowering(self, platform):
    direct = self.ffi_lowering(platform)
    if not register_for_sharding(self.primitive):
      return direct

    def lowering(ctx, *operands, **params):
      several = getattr(ctx.module_context.axis_context, "num_devices", 1) > 1
      if not (several and devices_known(ctx)):
        return direct(ctx, *operands, **params)

      def per_leaf(scalars, *leaf_operands):
        outs = []
        leaf_avals = _per_leaf(ctx.avals_in[1:], _OPERANDS_PER_LEAF)
        for i, leaf in enumerate(_per_leaf(leaf_operands, _OPERANDS_PER_LEAF)):
          one = dict(params, decayed_leaves=int(i < params["decayed_leaves"]))
          avals = (ctx.avals_in[0], *leaf_avals[i])
          outs += shard_locally(lambda *a, one=one: self.local_primitive.bind(*a, **one),
                                _ONE_LEAF_SHARDING(avals, _result_avals(*avals)),
                                (scalars, *leaf), _RESULTS_PER_LEAF)
        return tuple(outs)

      return mlir.lower_fun(per_leaf, multiple_results=True)(ctx, *operands)

    return lowering

  def _abstract_eval(self, *avals, **params):
    """Per leaf, the results typed with the leaf's sharding under a mesh of
    Explicit axes (typed_results of the one-leaf rule)."""
    out = self.abstract_eval(*avals, **params)
    typed = []
    for leaf, leaf_out in zip(_per_leaf(avals[1:], _OPERANDS_PER_LEAF),
                              _per_leaf(out, _RESULTS_PER_LEAF)):
      leaf_in = (avals[0], *leaf)
      typed += typed_results(self.name, _ONE_LEAF_SHARDING(leaf_in, leaf_out), leaf_in, leaf_out)
    return tuple(typed)


def _make(name, leaf_aliases):
  return _LeafTablePrimitive(
      name=name, target="jaxops_adamw", abstract_eval=_result_avals, reference=_reference,
      batch_rule=_batch_rule, leaf_aliases=leaf_aliases)


# Per leaf, (grads, params, m, v) -> (update or new params, m, v), m and v in
# place. The update is written over the gradients when those are temporaries
# of the traced function (jax.grad in the same jit, the standard train step):
# no fresh full-size buffer to fault in (update + apply_updates measured 1.2x
# and 1.7x faster over a 25M-parameter train step, docs/benchmarks-log.md).
# When they are its arguments, XLA would copy them into a fresh buffer first,
# which costs more than the fresh output the kernel fills (with huge pages):
# the update goes to a fresh output then.
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
  """The state of :func:`adamw`.

  Attributes:
    count: int32 scalar, the steps taken.
    mu: the first moments, shaped like the parameters, in ``mu_dtype`` (by
      default the parameters' dtype, as optax's).
    nu: the second moments, shaped like the parameters: float32 for float32,
      bfloat16 and float16 parameters, the real dtype of float64 and complex ones.
  """
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

    treedef = jax.tree.structure(params)
    mu, nu = _unzip(treedef, treedef.flatten_up_to(
        jax.tree_util.tree_map_with_path(moments, params)), 2)
    return AdamWState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def __call__(self, updates, state: AdamWState, params=None, **extra_args):
    """optax's update: (gradients, state, params) -> (updates, new state).
    Extra keyword arguments (``optax.GradientTransformationExtraArgs``) are
    accepted and ignored, as optax.adamw ignores them."""
    del extra_args
    return self._run(updates, state, params, apply_updates=False)

  def step(self, grads, state: AdamWState, params, **extra_args):
    """(gradients, state, params) -> (new params, new state) in one kernel call
    for all leaves: ``update`` followed by ``optax.apply_updates``, with the
    parameters rounded once. Donate ``params`` and ``state`` to update them in place."""
    del extra_args
    return self._run(grads, state, params, apply_updates=True)

  def _scalars(self, count):
    """The scalars operands (layout: params/adamw.h) as a function of the real
    dtype the step computes in, with optax's arithmetic: 1 - b1 in Python
    double precision for a Python float, bias corrections from the incremented
    count, schedules at the count before it."""
    count_inc = _safe_increment(count)
    lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
    wd = self.weight_decay(count) if callable(self.weight_decay) else self.weight_decay
    b1, b2 = self.b1, self.b2
    values = (-1 * lr, b1, 1 - b1, b2, 1 - b2, self.eps, self.eps_root, wd,
              1 - b1 ** count_inc, 1 - b2 ** count_inc, 1 - b1 ** _safe_increment(count_inc))
    cache = {}

    def scalars(dtype, moment_dtype=None):
      """The operand for a step computing in ``dtype``: for one leaf with a first
      moment of ``moment_dtype`` (reference.adamw_leaf's), or with None the
      kernel's, which holds b1 for each of its first-moment dtypes."""
      moments = _KERNEL_MOMENT_DTYPES if moment_dtype is None else (jnp.dtype(moment_dtype),)
      key = (jnp.dtype(dtype), moments)
      if key not in cache:
        # optax multiplies the stored first moment by a Python float b1 in the
        # moment's dtype (b1 = 0.9 is 0.8984375 for a bfloat16 one).
        b1_moment = [jnp.asarray(b1, jnp.finfo(m).dtype) if isinstance(b1, float) else b1
                     for m in moments]
        cache[key] = jnp.stack([jnp.asarray(x).astype(dtype) for x in (*values, *b1_moment)])
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
    _check_structure("grads", grads, params)
    _check_structure("state.mu", state.mu, params)
    _check_structure("state.nu", state.nu, params)
    scalars = self._scalars(state.count)
    options = dict(apply_updates=apply_updates, nesterov=self.nesterov)
    kernel_leaves = []

    def leaf(path, g, p, m, v, decay):
      _check_leaf(path, p)
      where = jax.tree_util.keystr(path)
      validation.shape(_OP, f"grads{where}", g, jnp.shape(p), of=f"params{where}.shape")
      g, p = jnp.asarray(g), jnp.asarray(p)
      g = self._kernel_gradient(where, g, p)
      if self._kernel_runs(where, g, p, m, v, apply_updates):
        kernel_leaves.append(_KernelLeaf(g, p, m, v, decay))
        return len(kernel_leaves) - 1  # where the kernel's results go
      real = jnp.finfo(jnp.promote_types(p.dtype, _F32)).dtype
      return reference.adamw_leaf(g, p, m, v, scalars(real, m.dtype), decay=decay, **options)

    placed = jax.tree_util.tree_map_with_path(leaf, grads, params, state.mu, state.nu,
                                              self._decay_flags(grads))
    treedef = jax.tree.structure(grads)
    kernel_results = _run_kernel(kernel_leaves, scalars, options)
    results = [kernel_results[r] if isinstance(r, int) else r
               for r in treedef.flatten_up_to(placed)]
    out, mu, nu = _unzip(treedef, results, 3)
    return out, AdamWState(count=_safe_increment(state.count), mu=mu, nu=nu)

  def _kernel_gradient(self, where, g, p):
    """A gradient whose dtype converts exactly to a kernel parameter's (float16
    or bfloat16 for float32) is converted, and the leaf runs on the kernel with
    the result the jnp path would give (it promotes g the same way). Under
    implementation="ffi" any other dtype than the parameter's is a TypeError:
    the kernel reads gradients of the parameter's dtype, and rounding a wider
    gradient would change the step."""
    if g.dtype == p.dtype or self.implementation == "xla":
      return g
    exact = (jnp.issubdtype(g.dtype, jnp.floating) and jnp.dtype(p.dtype) in _KERNEL_PARAM_DTYPES
             and jnp.promote_types(g.dtype, p.dtype) == p.dtype)
    if exact:
      return g.astype(p.dtype)
    if self.implementation == "ffi" and jnp.dtype(p.dtype) in _KERNEL_PARAM_DTYPES:
      raise validation.type_error(
          _OP, f"grads{where}",
          f"have params{where}'s dtype {p.dtype} (or one that converts to it exactly) for "
          "implementation='ffi'", str(g.dtype))
    return g

  def _kernel_runs(self, where, g, p, m, v, apply_updates) -> bool:
    """The kernel takes float32, bfloat16 and float16 parameters (gradients of
    the same dtype) with a float32, bfloat16 or float16 first moment;
    everything else (float64, complex, a float64 moment) runs the jnp
    reference, or is a clear error with implementation="ffi".

    ``update`` runs the jnp form under implementation=None, on every
    backend: XLA fuses it with what follows (``optax.apply_updates``: 7 array
    passes in all), where a kernel must write the update for XLA to read
    back (10 passes), which measured 0.64-0.99x optax on the CPU
    (BENCHMARKS.md) and cannot beat it on a GPU. ``step`` is the kernel's 7
    passes in place; implementation="ffi" runs ``update`` on the kernel too."""
    if self.implementation == "ffi" and jnp.dtype(m.dtype) not in _KERNEL_MOMENT_DTYPES:
      primitive.use_kernel(_OP, self.implementation, {f"params{where}": p.dtype})  # names a parameter dtype first
      raise validation.type_error(
          _OP, f"state.mu{where}",
          "be float32, bfloat16 or float16 for implementation='ffi' (mu_dtype)", str(m.dtype))
    if not apply_updates and self.implementation is None:
      return False
    return (g.dtype == p.dtype and jnp.dtype(m.dtype) in _KERNEL_MOMENT_DTYPES
            and jnp.dtype(v.dtype) == _F32
            and primitive.use_kernel(_OP, self.implementation, {f"params{where}": p.dtype}))


class _KernelLeaf(NamedTuple):
  grads: jax.Array
  params: jax.Array
  m: jax.Array
  v: jax.Array
  decay: bool


def _run_kernel(leaves, scalars, options) -> list:
  """(out, m, v) of every kernel leaf, in one call for all (``step``; for
  ``update``, one for the gradients it may write over and one for the others);
  ``scalars``: _AdamWUpdate._scalars' function."""
  if not leaves:
    return []
  if options["apply_updates"]:
    calls = [(adamw_step_p, list(range(len(leaves))))]
  else:
    temporary = [_is_temporary(leaf.grads) for leaf in leaves]
    calls = [(adamw_update_in_grads_p, [i for i, t in enumerate(temporary) if t]),
             (adamw_update_p, [i for i, t in enumerate(temporary) if not t])]
  results = [None] * len(leaves)
  for prim, chosen in calls:
    if not chosen:
      continue
    # The decayed leaves first: the call names how many there are.
    order = sorted(chosen, key=lambda i: not leaves[i].decay)
    operands = [x for i in order for x in leaves[i][:_OPERANDS_PER_LEAF]]
    outs = prim(scalars(_F32), *operands, decayed_leaves=sum(leaves[i].decay for i in order),
                **options)
    for i, leaf_outs in zip(order, _per_leaf(outs, _RESULTS_PER_LEAF)):
      results[i] = leaf_outs
  return results


def _unzip(treedef, results, count):
  """Leaves of ``treedef`` given as tuples of ``count`` -> ``count`` trees."""
  columns = list(zip(*results)) or [()] * count
  return tuple(jax.tree.unflatten(treedef, list(column)) for column in columns)


def _safe_increment(count):
  """count + 1, saturating at the dtype's maximum (as optax counts steps)."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(count < top, count + jnp.ones((), count.dtype), top)


def _check_structure(name, tree, params):
  """A tree that must have the parameters' structure (grads, the moments): a
  ValueError naming it and the leaves it lacks or has in excess, at trace time."""
  tree_def, params_def = jax.tree.structure(tree), jax.tree.structure(params)
  if tree_def == params_def:
    return
  paths = lambda t: [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
  theirs, ours = paths(tree), paths(params)
  missing = [k for k in ours if k not in theirs]
  extra = [k for k in theirs if k not in ours]
  parts = ([f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing
           else []) + ([f"has {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"] if extra
                       else [])
  detail = "; ".join(parts) if parts else f"{len(theirs)} leaves in {tree_def}"
  raise validation.value_error(_OP, name, "have the tree structure of params "
                               f"({len(ours)} leaves)", detail)


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
  """The optimizer :func:`adamw` returns.

  An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``), the
  class ``optax.adamw`` returns, with one more method, :meth:`step`, that also
  applies the update.
  """

  def step(self, grads, state: AdamWState, params, **extra_args):
    """``update`` then ``optax.apply_updates`` in one kernel call for all leaves.

    Donate params and state to update them in place. ``jax.jit`` pairs donated
    buffers with results of the same shape and dtype in order, so pass them in
    the order they are returned, e.g. ``jit(f, donate_argnums=(1, 2))`` with
    ``f(grads, params, state) -> (params, state)`` (or keep both in one
    train-state pytree); in another order each buffer is paired with another
    leaf's result and XLA copies around the in-place kernel.

    Args:
      grads: the gradients, a pytree of the parameters' structure; each leaf
        of its parameter's shape, in its dtype or one that converts to it
        exactly (see :func:`adamw`, "Gradient dtypes").
      state: the :class:`AdamWState`.
      params: the parameters.
      **extra_args: accepted and ignored, as ``update``'s.

    Returns:
      ``(new_params, new_state)``.

    Raises:
      ValueError: ``grads``, ``state.mu`` or ``state.nu`` does not have the
        tree structure of ``params`` (the message names the leaves that
        differ), or a gradient's shape is not its parameter's.
      TypeError: with ``implementation="ffi"``, a gradient's dtype neither is
        its parameter's nor converts to it exactly.
    """
    return self.update.step(grads, state, params, **extra_args)


def adamw(learning_rate: ScalarOrSchedule, b1: Scalar = 0.9, b2: Scalar = 0.999,
          eps: Scalar = 1e-8, eps_root: Scalar = 0.0, mu_dtype: Any = None,
          weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *, nesterov: bool = False,
          implementation: str | None = None) -> AdamW:
  """AdamW (decoupled weight decay): ``optax.adamw``'s signature, defaults and
  math, one fused kernel call for all the parameter leaves.

  Per leaf, at step t = 1, 2, ...: ``m = b1 m + (1 - b1) g``, ``v = b2 v +
  (1 - b2) |g|^2``, ``m^ = m / (1 - b1^t)`` (Nesterov: ``b1 m / (1 - b1^(t+1))
  + (1 - b1) g / (1 - b1^t)``), and the update is ``-lr * (m^ / (sqrt(v / (1 -
  b2^t) + eps_root) + eps) + weight_decay * params)``, the decay term only on
  the leaves ``mask`` selects; ``lr`` and a scheduled weight decay are taken at
  t - 1 (as optax counts). One fused kernel updates every leaf: gradients,
  params, m and v read once; the update, m and v written once (m and v in
  place when the state is donated).

  Which runs where, under ``implementation=None`` (CPU and GPU alike): the
  kernel for :meth:`AdamW.step` (7 array passes, in place), and the jnp form
  for ``update``, which XLA fuses with ``optax.apply_updates`` into the same
  7 passes, where a kernel would write the update for XLA to read back (10
  passes: measured 0.64x optax on the CPU). Either way jaxops' AdamW moves no
  more bytes than optax's; ``step`` is the fast path (1.60x optax on the CPU
  with the gradients given, BENCHMARKS.md). ``implementation="ffi"`` runs
  ``update`` on the kernel too.

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

  Gradient dtypes: a gradient in its parameter's dtype, or in one that
  converts to it exactly (float16 or bfloat16 gradients of float32
  parameters, e.g. from a mixed-precision backward), runs on the kernel; the
  latter is converted first (one more pass over that gradient), which gives
  the jnp path's result, as that promotes it the same way. Any other
  combination (a float32 gradient of a bfloat16 parameter, whose rounding
  would change the step) runs the jnp reference under ``implementation=None``
  and is a ``TypeError`` under ``implementation="ffi"``.

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
    implementation: ``None`` (``step`` on the kernel for float32, bfloat16
      and float16 parameters; ``update``, and float64 and complex
      parameters, on the jnp reference), ``"ffi"``
      (the kernel, a clear error for a dtype it lacks) or ``"xla"`` (the
      reference), as for the other ops.

  Returns:
    An :class:`AdamW`: an ``optax.GradientTransformationExtraArgs`` (use it
    with ``optax.apply_updates``, ``optax.chain``...) whose :meth:`AdamW.step`
    fuses the update and its application.

  Raises:
    TypeError: a hyper-parameter is neither a real number, a scalar array nor
      (learning rate, weight decay) a callable; ``nesterov`` is not a bool.
      When ``update`` or ``step`` is traced, with ``implementation="ffi"``: a
      gradient's dtype neither is its parameter's nor converts to it exactly.
    ValueError: a Python-number hyper-parameter is out of its range. When
      ``update`` or ``step`` is traced: the gradients (or the state's moments)
      do not have the tree structure of the parameters (the message names the
      leaves that differ), or a gradient's shape is not its parameter's.

  Examples:
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> tx = jaxops.optim.adamw(1e-2, weight_decay=0.0)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)    # optax's pattern
    >>> updates["b"]
    Array([-0.0099..., -0.0099..., -0.0099...], dtype=float32)
    >>> params, state = tx.step(grads, state, params)       # update and apply in one kernel
    >>> params["b"]
    Array([-0.0099..., -0.0099..., -0.0099...], dtype=float32)
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
