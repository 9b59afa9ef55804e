"""layer_norm, rms_norm and add_rms_norm: primitives and public functions.

Forward primitives return the output and the float32 row statistics the
backward needs (mean, rstd). Backward primitives produce dx and the weight/bias
gradients in one pass over dy and x. An absent weight or bias is passed to the
kernels as a zero-size array, so one handler signature serves every case.

Weight gradients are reduced per *group* of rows: the public call uses one
group; vmap over x with a shared weight multiplies the groups by the batch
size, which gives the per-example weight gradients vmap(grad) asks for while
the kernel still runs once over all rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import reference
from jaxops._src import primitive
from jaxops._src.checks import check_float_array, check_matching, check_param_vector
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front, is_batched
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32

# Row pieces the backward reduces in parallel before summing them in a fixed
# order (see cpu/norms.h). Enough for every thread of a CPU, and for the SMs of a
# GPU; the sums are deterministic for any value.
_WEIGHT_GRAD_TASKS = {"cpu": 32, "cuda": 256}


def _absent(dtype):
  return jnp.zeros((0,), dtype)


def _rows(shape) -> int:
  return math.prod(shape[:-1])


def _stat_aval(x):
  return jax.core.ShapedArray(x.shape[:-1], _F32)


def _grad_aval(param, groups, cols):
  return jax.core.ShapedArray((groups, cols if param.shape[0] else 0), param.dtype)


def _workspace(sums):
  def workspace(avals_in, params, platform):
    x = avals_in[1]
    rows_per_group = _rows(x.shape) // params["groups"]
    parts = max(1, min(rows_per_group, _WEIGHT_GRAD_TASKS[platform] // params["groups"]))
    return jax.core.ShapedArray((params["groups"] * parts, sums, x.shape[-1]), _F32)

  return workspace


def _param_or_none(param):
  return param if param.shape[0] else None


def _grouped_column_sum(values, groups):
  rows = _rows(values.shape)
  return values.reshape(groups, rows // groups, values.shape[-1]).sum(axis=1)


# -- batching: rows batch natively; a batched weight falls back to the reference --


def _row_batch_rule(row_operands, column_operands, grad_outputs=()):
  """Batching for ops whose kernel treats all leading axes as rows.

  The vmapped axis of the row operands becomes one more leading axis; weight
  gradients (``grad_outputs``) come back as [batch * groups, cols] and are split.
  A batched weight or bias (``column_operands``) has no kernel: reference.
  """

  def rule(prim, args, dims, **params):
    if is_batched(dims, column_operands):
      return None
    args, size = batch_to_front(args, dims, row_operands)
    if grad_outputs:
      params = dict(params, groups=params["groups"] * size)
    outs = list(prim(*args, **params))
    for i in grad_outputs:
      outs[i] = outs[i].reshape(size, -1, outs[i].shape[-1])
    return outs, (0,) * len(outs)

  return rule


# -- sharding: rows shard, the normalised axis stays whole -------------------------


def _grouped_axes(x, params):
  """How many leading axes of x index the weight-gradient groups (vmap of
  grad): the groups are the first axes' product, in order."""
  groups = params.get("groups", 1)
  return next(k for k in range(x.ndim) if math.prod(x.shape[:k]) == groups)


def _local_groups(params, avals_in, local_avals_in):
  """On a shard of rows, the groups are the shard's own (the first grouped
  axis shards with them)."""
  if params.get("groups", 1) == 1:
    return params
  x, local_x = avals_in[1], local_avals_in[1]
  return dict(params, groups=params["groups"] * local_x.shape[0] // x.shape[0])


def _make(name, *, abstract_eval, reference_fn, attributes, batch_rule, roles,
          workspace=None, input_output_aliases=None):
  return FfiPrimitive(
      name=name, target=name, abstract_eval=abstract_eval, reference=reference_fn,
      attributes=attributes, batch_rule=batch_rule, workspace=workspace,
      input_output_aliases=input_output_aliases or {},
      # Rows shard; the feature axis and weight/bias (and their gradients) stay whole.
      sharding=leading_axes(roles, grouped_axes=_grouped_axes), local_params=_local_groups)


# -- layer norm ---------------------------------------------------------------------


def _layer_norm_fwd_reference(x, weight, bias, *, epsilon):
  return reference.layer_norm_with_stats(
      x, _param_or_none(weight), _param_or_none(bias), epsilon=epsilon)


def _layer_norm_bwd_reference(dy, x, weight, bias, mean, rstd, *, groups):
  xhat = (x.astype(_F32) - mean[..., None]) * rstd[..., None]
  dyf = dy.astype(_F32)
  g = dyf * (weight.astype(_F32) if weight.shape[0] else 1.0)
  dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) * rstd[..., None]
  dweight = _grouped_column_sum(dyf * xhat, groups) if weight.shape[0] else jnp.zeros((groups, 0))
  dbias = _grouped_column_sum(dyf, groups) if bias.shape[0] else jnp.zeros((groups, 0))
  return dx.astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(bias.dtype)


layer_norm_fwd_p = _make(
    "jaxops_layer_norm_fwd",
    abstract_eval=lambda x, w, b, *, epsilon: (
        jax.core.ShapedArray(x.shape, x.dtype), _stat_aval(x), _stat_aval(x)),
    reference_fn=_layer_norm_fwd_reference,
    attributes={"epsilon": np.float32},
    batch_rule=_row_batch_rule(row_operands=(0,), column_operands=(1, 2)),
    roles="xpp -> xss")

layer_norm_bwd_p = _make(
    "jaxops_layer_norm_bwd",
    abstract_eval=lambda dy, x, w, b, mean, rstd, *, groups: (
        jax.core.ShapedArray(x.shape, x.dtype),
        _grad_aval(w, groups, x.shape[-1]), _grad_aval(b, groups, x.shape[-1])),
    reference_fn=_layer_norm_bwd_reference,
    attributes={"groups": np.int64},
    workspace=_workspace(sums=2),
    batch_rule=_row_batch_rule(row_operands=(0, 1, 4, 5), column_operands=(2, 3),
                               grad_outputs=(1, 2)),
    roles="xxppss -> xgg")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_kernel(x, weight, bias, epsilon):
  return layer_norm_fwd_p(x, weight, bias, epsilon=epsilon)[0]


def _layer_norm_kernel_fwd(x, weight, bias, epsilon):
  y, mean, rstd = layer_norm_fwd_p(x, weight, bias, epsilon=epsilon)
  return y, (x, weight, bias, mean, rstd)


def _layer_norm_kernel_bwd(epsilon, residuals, dy):
  x, weight, bias, mean, rstd = residuals
  dx, dweight, dbias = layer_norm_bwd_p(dy, x, weight, bias, mean, rstd, groups=1)
  return dx, dweight.reshape(weight.shape), dbias.reshape(bias.shape)


_layer_norm_kernel.defvjp(_layer_norm_kernel_fwd, _layer_norm_kernel_bwd)


def layer_norm(x, weight=None, bias=None, *, epsilon: float = 1e-5, implementation=None):
  """Layer normalization over the last axis of ``x``.

  ``(x - mean) / sqrt(var + epsilon) * weight + bias`` with the biased variance,
  computed in float32 and returned in ``x.dtype``. ``weight`` and ``bias`` are
  optional vectors of the last axis' size; they are cast to ``x.dtype`` (as
  Flax does for a low-precision ``dtype``).

  Args:
    x: float32, bfloat16 or float16 array of rank >= 1.
    weight, bias: optional arrays of shape ``(x.shape[-1],)``.
    epsilon: added to the variance.
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).
  """
  op = "jaxops.layer_norm"
  x = check_float_array(op, "x", x, min_rank=1)
  weight = check_param_vector(op, "weight", weight, x)
  bias = check_param_vector(op, "bias", bias, x)
  epsilon = _check_epsilon(op, epsilon)
  if not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.layer_norm(x, weight, bias, epsilon=epsilon)
  return _layer_norm_kernel(x, _present_or_absent(weight, x), _present_or_absent(bias, x), epsilon)


# -- rms norm -----------------------------------------------------------------------


def _rms_norm_fwd_reference(x, weight, *, epsilon):
  return reference.rms_norm_with_stats(x, _param_or_none(weight), epsilon=epsilon)


def _rms_norm_bwd_reference(dy, x, weight, rstd, dresidual, *, groups):
  xhat = x.astype(_F32) * rstd[..., None]
  dyf = dy.astype(_F32)
  g = dyf * (weight.astype(_F32) if weight.shape[0] else 1.0)
  dx = (g - xhat * (g * xhat).mean(-1, keepdims=True)) * rstd[..., None]
  if dresidual.shape == x.shape:
    dx = dx + dresidual.astype(_F32)
  dweight = _grouped_column_sum(dyf * xhat, groups) if weight.shape[0] else jnp.zeros((groups, 0))
  return dx.astype(x.dtype), dweight.astype(weight.dtype)


def _add_rms_norm_fwd_reference(x, residual, weight, *, epsilon):
  h = x + residual
  y, rstd = reference.rms_norm_with_stats(h, _param_or_none(weight), epsilon=epsilon)
  return y, h, rstd


rms_norm_fwd_p = _make(
    "jaxops_rms_norm_fwd",
    abstract_eval=lambda x, w, *, epsilon: (jax.core.ShapedArray(x.shape, x.dtype), _stat_aval(x)),
    reference_fn=_rms_norm_fwd_reference,
    attributes={"epsilon": np.float32},
    batch_rule=_row_batch_rule(row_operands=(0,), column_operands=(1,)),
    roles="xp -> xs")


def _rms_norm_bwd_batch_rule(prim, args, dims, **params):
  # dresidual is a row operand when present, a zero-size placeholder otherwise.
  present = dims[4] is not NOT_MAPPED or args[4].size > 0
  rows = (0, 1, 3, 4) if present else (0, 1, 3)
  return _row_batch_rule(rows, (2,), grad_outputs=(1,))(prim, args, dims, **params)


rms_norm_bwd_p = _make(
    "jaxops_rms_norm_bwd",
    abstract_eval=lambda dy, x, w, rstd, dres, *, groups: (
        jax.core.ShapedArray(x.shape, x.dtype), _grad_aval(w, groups, x.shape[-1])),
    reference_fn=_rms_norm_bwd_reference,
    attributes={"groups": np.int64},
    workspace=_workspace(sums=1),
    batch_rule=_rms_norm_bwd_batch_rule,
    roles="xxpsx -> xg")

add_rms_norm_fwd_p = _make(
    "jaxops_add_rms_norm_fwd",
    abstract_eval=lambda x, r, w, *, epsilon: (
        jax.core.ShapedArray(x.shape, x.dtype), jax.core.ShapedArray(x.shape, x.dtype),
        _stat_aval(x)),
    reference_fn=_add_rms_norm_fwd_reference,
    attributes={"epsilon": np.float32},
    batch_rule=_row_batch_rule(row_operands=(0, 1), column_operands=(2,)),
    roles="xxp -> xxs",
    # h is written over the residual's buffer when the caller donates it.
    input_output_aliases={1: 1})


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_kernel(x, weight, epsilon):
  return rms_norm_fwd_p(x, weight, epsilon=epsilon)[0]


def _rms_norm_kernel_fwd(x, weight, epsilon):
  y, rstd = rms_norm_fwd_p(x, weight, epsilon=epsilon)
  return y, (x, weight, rstd)


def _rms_norm_kernel_bwd(epsilon, residuals, dy):
  x, weight, rstd = residuals
  dx, dweight = rms_norm_bwd_p(dy, x, weight, rstd, _absent(x.dtype), groups=1)
  return dx, dweight.reshape(weight.shape)


_rms_norm_kernel.defvjp(_rms_norm_kernel_fwd, _rms_norm_kernel_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_rms_norm_kernel(x, residual, weight, epsilon):
  y, h, _ = add_rms_norm_fwd_p(x, residual, weight, epsilon=epsilon)
  return y, h


def _add_rms_norm_kernel_fwd(x, residual, weight, epsilon):
  y, h, rstd = add_rms_norm_fwd_p(x, residual, weight, epsilon=epsilon)
  return (y, h), (h, weight, rstd)


def _add_rms_norm_kernel_bwd(epsilon, residuals, cotangents):
  h, weight, rstd = residuals
  dy, dh = cotangents
  # h = x + residual, so both receive the same gradient: the norm's, plus h's own.
  dsum, dweight = rms_norm_bwd_p(dy, h, weight, rstd, dh, groups=1)
  return dsum, dsum, dweight.reshape(weight.shape)


_add_rms_norm_kernel.defvjp(_add_rms_norm_kernel_fwd, _add_rms_norm_kernel_bwd)


def rms_norm(x, weight=None, *, epsilon: float = 1e-6, implementation=None):
  """RMS normalization over the last axis: ``x / sqrt(mean(x**2) + epsilon) * weight``.

  Computed in float32, returned in ``x.dtype``; ``weight`` (optional, shape
  ``(x.shape[-1],)``) is cast to ``x.dtype``. ``implementation`` as in
  :func:`layer_norm`.
  """
  op = "jaxops.rms_norm"
  x = check_float_array(op, "x", x, min_rank=1)
  weight = check_param_vector(op, "weight", weight, x)
  epsilon = _check_epsilon(op, epsilon)
  if not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.rms_norm(x, weight, epsilon=epsilon)
  return _rms_norm_kernel(x, _present_or_absent(weight, x), epsilon)


def add_rms_norm(x, residual, weight=None, *, epsilon: float = 1e-6, implementation=None):
  """``(rms_norm(x + residual) * weight, x + residual)`` in one pass.

  The pre-norm transformer's residual step: the sum is returned (in ``x.dtype``)
  for the next residual connection, and normalised in the same pass. When the
  caller donates ``residual``, the sum is written over it.
  """
  op = "jaxops.add_rms_norm"
  x = check_float_array(op, "x", x, min_rank=1)
  residual = check_float_array(op, "residual", residual, min_rank=1)
  check_matching(op, "residual", residual, x)
  weight = check_param_vector(op, "weight", weight, x)
  epsilon = _check_epsilon(op, epsilon)
  if not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.add_rms_norm(x, residual, weight, epsilon=epsilon)
  return _add_rms_norm_kernel(x, residual, _present_or_absent(weight, x), epsilon)


# -- argument handling ---------------------------------------------------------------


def _present_or_absent(param, x):
  return _absent(x.dtype) if param is None else param


def _check_epsilon(op, epsilon):
  if isinstance(epsilon, jax.core.Tracer) or not np.isscalar(epsilon):
    raise TypeError(f"{op}: epsilon must be a Python float, got {type(epsilon).__name__}")
  epsilon = float(epsilon)
  if not epsilon >= 0.0:
    raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon}")
  return epsilon

