"""softmax, log_softmax and causal_softmax: primitives and public functions.

The kernels reduce over the last axis of a row-major array. A softmax over
another axis moves that axis last first (XLA transposes x, and the result
back): the kernels then read every row contiguously, which is what makes them
fast, and transformers take softmax over the last axis, where the move is free.

``where`` and ``bias`` reach the kernel unbroadcast, only reshaped to x's rank
(axes of size 1 broadcast): an attention mask of shape [S, S] is read once per
row of a [B, H, S, S] input instead of being materialised at x's size. Under
vmap an unbatched mask or bias gets a leading axis of size 1 for the same
reason. Absent ones are passed as zero-size arrays.

Forward primitives return the output only: the backward of softmax needs
y (``dx = y * (dy - sum(y * dy))``) and that of log_softmax needs log y, both
already the forward's result, so no residual is added.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import reference
from jaxops._src import primitive
from jaxops._src.checks import check_array, check_float_array, check_static_int
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32


def _absent(dtype):
  return jnp.zeros((0,), dtype)


def _is_absent(operand):
  return operand.shape == (0,)


def _present_or_none(operand):
  return None if _is_absent(operand) else operand


def _same_as_x(x, *rest, **params):
  return (jax.core.ShapedArray(x.shape, x.dtype),)


# -- batching --------------------------------------------------------------------------


def _masked_batch_rule(prim, args, dims, **params):
  """x gains a leading batch axis; a present mask or bias gains one too, of size 1
  when it is not batched, so that the kernel broadcasts it instead of XLA."""
  (x, *_), _ = batch_to_front(args, dims, (0,))
  operands = []
  for operand, dim in ((args[1], dims[1]), (args[2], dims[2])):
    if dim is NOT_MAPPED:
      operand = operand if _is_absent(operand) else operand[None]
    else:
      operand = jnp.moveaxis(operand, dim, 0)
    operands.append(operand)
  return prim(x, *operands, **params), (0,)


def _row_batch_rule(prim, args, dims, **params):
  args, _ = batch_to_front(args, dims, range(len(args)))
  return prim(*args, **params), (0,)


# -- primitives ------------------------------------------------------------------------


def _softmax_fwd_reference(x, where, bias):
  return (reference.softmax(x, where=_present_or_none(where), bias=_present_or_none(bias)),)


def _log_softmax_fwd_reference(x, where, bias):
  return (reference.log_softmax(x, where=_present_or_none(where), bias=_present_or_none(bias)),)


def _causal_softmax_fwd_reference(x, *, query_offset):
  return (reference.causal_softmax(x, query_offset=query_offset),)


def _softmax_bwd_reference(dy, y):
  p, g = y.astype(_F32), dy.astype(_F32)
  dx = p * (g - jnp.sum(p * g, axis=-1, keepdims=True))
  return (dx.astype(y.dtype),)


def _log_softmax_bwd_reference(dy, y):
  logp, g = y.astype(_F32), dy.astype(_F32)
  visible = logp != -jnp.inf
  total = jnp.sum(jnp.where(visible, g, 0.0), axis=-1, keepdims=True)
  dx = jnp.where(visible, g - jnp.exp(jnp.where(visible, logp, 0.0)) * total, 0.0)
  return (dx.astype(y.dtype),)


def _make(name, reference_fn, batch_rule, roles, attributes=None, whole_trailing=1):
  # Rows shard; the softmax axis (both of causal_softmax's axes) stays whole.
  return FfiPrimitive(name=name, target=name, abstract_eval=_same_as_x,
                      reference=reference_fn, attributes=attributes or {},
                      batch_rule=batch_rule,
                      sharding=leading_axes(roles, whole_trailing=whole_trailing))


softmax_fwd_p = _make("jaxops_softmax_fwd", _softmax_fwd_reference, _masked_batch_rule,
                      "xxx -> x")
log_softmax_fwd_p = _make("jaxops_log_softmax_fwd", _log_softmax_fwd_reference,
                          _masked_batch_rule, "xxx -> x")
causal_softmax_fwd_p = _make("jaxops_causal_softmax_fwd", _causal_softmax_fwd_reference,
                             _row_batch_rule, "x -> x", attributes={"query_offset": np.int64},
                             whole_trailing=2)
softmax_bwd_p = _make("jaxops_softmax_bwd", _softmax_bwd_reference, _row_batch_rule, "xx -> x")
log_softmax_bwd_p = _make("jaxops_log_softmax_bwd", _log_softmax_bwd_reference, _row_batch_rule,
                          "xx -> x")


# -- custom VJPs -----------------------------------------------------------------------


def _bias_grad(dx, bias):
  """Sum of dx over the axes the bias broadcasts along (bias has x's rank)."""
  if _is_absent(bias):
    return jnp.zeros_like(bias)
  axes = tuple(i for i, (b, n) in enumerate(zip(bias.shape, dx.shape)) if b == 1 and n != 1)
  if not axes:
    return dx.astype(bias.dtype)
  return dx.astype(_F32).sum(axis=axes, keepdims=True).astype(bias.dtype)


def _masked_kernel(fwd_p, bwd_p):
  @jax.custom_vjp
  def kernel(x, where, bias):
    return fwd_p(x, where, bias)[0]

  def kernel_fwd(x, where, bias):
    y = fwd_p(x, where, bias)[0]
    return y, (y, bias)

  def kernel_bwd(residuals, dy):
    y, bias = residuals
    dx = bwd_p(dy, y)[0]
    return dx, None, _bias_grad(dx, bias)

  kernel.defvjp(kernel_fwd, kernel_bwd)
  return kernel


_softmax_kernel = _masked_kernel(softmax_fwd_p, softmax_bwd_p)
_log_softmax_kernel = _masked_kernel(log_softmax_fwd_p, log_softmax_bwd_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _causal_softmax_kernel(x, query_offset):
  return causal_softmax_fwd_p(x, query_offset=query_offset)[0]


def _causal_softmax_kernel_fwd(x, query_offset):
  y = causal_softmax_fwd_p(x, query_offset=query_offset)[0]
  return y, y


def _causal_softmax_kernel_bwd(query_offset, y, dy):
  return (softmax_bwd_p(dy, y)[0],)


_causal_softmax_kernel.defvjp(_causal_softmax_kernel_fwd, _causal_softmax_kernel_bwd)


# -- public functions ------------------------------------------------------------------


def _check_broadcastable(op, name, value, x):
  try:
    shape = np.broadcast_shapes(value.shape, x.shape)
  except ValueError:
    shape = None
  if shape != x.shape:
    raise ValueError(f"{op}: {name} of shape {value.shape} does not broadcast to the shape of "
                     f"x {x.shape}")


def _check_axis(op, axis, x):
  if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
    raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"{op}: axis {axis} is out of range for x of rank {x.ndim}")
  return operator.index(axis) % x.ndim


def _masked_softmax(op, kernel, ref, x, axis, where, bias, implementation):
  x = check_float_array(op, "x", x, min_rank=1, non_empty_last_axis=False)
  axis = _check_axis(op, axis, x)
  if where is not None:
    where = check_array(op, "where", where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"{op}: where must be a boolean array, got dtype {where.dtype}")
    _check_broadcastable(op, "where", where, x)
  if bias is not None:
    bias = check_float_array(op, "bias", bias, non_empty_last_axis=False)
    _check_broadcastable(op, "bias", bias, x)
    bias = bias.astype(x.dtype)
  if x.size == 0 or not primitive.use_kernel(op, implementation, [x.dtype]):
    return ref(x, axis, where=where, bias=bias)

  def to_kernel_layout(value):
    value = value.reshape((1,) * (x.ndim - value.ndim) + value.shape)
    return jnp.moveaxis(value, axis, -1)

  where = _absent(jnp.bool_) if where is None else to_kernel_layout(where)
  bias = _absent(x.dtype) if bias is None else to_kernel_layout(bias)
  y = kernel(jnp.moveaxis(x, axis, -1), where, bias)
  return jnp.moveaxis(y, -1, axis)


def softmax(x, axis: int = -1, *, where=None, bias=None, implementation=None):
  """Softmax of ``x + bias`` along ``axis``, over the columns ``where`` allows.

  Computed in float32 and returned in ``x.dtype``. Columns that are masked out,
  or where ``x + bias`` is -inf, get probability 0 and no gradient; a row with
  no visible column is all zeros (never NaN).

  Args:
    x: float32, bfloat16 or float16 array.
    axis: the axis to normalise; any axis (a non-last one is moved last around
      the kernel, which costs a transpose each way).
    where: optional boolean array broadcastable to ``x``: True = visible.
    bias: optional float array broadcastable to ``x``, added to x (in x's
      dtype) before the softmax; it receives the gradient summed over the axes
      it broadcasts along.
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).
  """
  return _masked_softmax("jaxops.softmax", _softmax_kernel, reference.softmax, x, axis, where,
                         bias, implementation)


def log_softmax(x, axis: int = -1, *, where=None, bias=None, implementation=None):
  """Log-softmax of ``x + bias`` along ``axis``, over the columns ``where`` allows.

  Arguments as in :func:`softmax`. Invisible columns (masked out, or where
  ``x + bias`` is -inf) are -inf and receive no gradient; a row with no
  visible column is all -inf with a zero gradient, never NaN. This is
  ``log(softmax(...))`` exactly. ``jax.nn.log_softmax`` agrees with the masked
  columns' values but differs on rows of -inf logits without ``where`` (it
  returns NaN) and passes a gradient to -inf logits; here they are constants.
  """
  return _masked_softmax("jaxops.log_softmax", _log_softmax_kernel, reference.log_softmax, x,
                         axis, where, bias, implementation)


def causal_softmax(x, *, query_offset: int = 0, implementation=None):
  """Softmax over the last axis with a causal mask over the last two axes.

  Query ``i`` (axis -2) sees keys ``j <= i + query_offset`` (axis -1); the
  kernel skips the masked columns instead of reading a mask. ``query_offset``
  is a static Python int (e.g. the number of cached keys before the first
  query); a row that sees no key (negative offsets) is all zeros.
  """
  op = "jaxops.causal_softmax"
  x = check_float_array(op, "x", x, min_rank=2, non_empty_last_axis=False)
  query_offset = check_static_int(op, "query_offset", query_offset)
  if x.size == 0 or not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.causal_softmax(x, query_offset=query_offset)
  return _causal_softmax_kernel(x, query_offset)
