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

Forward primitives return the output and, as a residual for the derivatives,
float32 row statistics ``stats[..., 0] = m`` (the row's maximum over its
visible columns) and ``stats[..., 1] = 1 / sum(exp(z - m))``. The tangent and
backward kernels take x (with the mask and bias) and those statistics and
recompute the float32 probabilities ``p = exp(z - m) * stats[..., 1]``, not
the output rounded to x's dtype: differentiating through a bfloat16 y cost
40x the reference's error (issue 43, item 3), and a NaN row's y is NaN at its
-inf columns too, where the gradient is 0 (item 4); z says which columns are
invisible. Softmax's tangent and backward are one map,
``p * (g - sum(p * g))``; log_softmax's are ``g - p * sum(g)`` and
``g - sum(p * g)``. The residual is 8 bytes a row, and the derivatives read x
instead of y: the same bytes. The tangent primitives take the tangents of x
and of the bias (``where`` has none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, batch_to_front, is_absent
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32


def _present_or_none(operand):
  return None if is_absent(operand) else operand


def _same_as_x(x, *rest, **params):
  return (jax.core.ShapedArray(x.shape, x.dtype),)


# -- batching --------------------------------------------------------------------------


def _broadcast_operand_to_front(operand, dim):
  """A present mask or bias that is not batched gains a leading axis of size 1, so
  that the kernel broadcasts it instead of XLA."""
  if dim is NOT_MAPPED:
    return operand if is_absent(operand) else operand[None]
  return jnp.moveaxis(operand, dim, 0)


def _masked_batch_rule(rows):
  """The operands at the indices ``rows`` (x, dy, the statistics, x's tangent)
  gain a leading batch axis; the others (mask, bias, the bias tangent) are
  broadcast operands."""

  def rule(prim, args, dims, **params):
    args_front, _ = batch_to_front(args, dims, rows)
    operands = [args_front[i] if i in rows else _broadcast_operand_to_front(args[i], dims[i])
                for i in range(len(args))]
    outs = prim(*operands, **params)
    return outs, (0,) * len(outs)

  return rule


def _row_batch_rule(prim, args, dims, **params):
  args, _ = batch_to_front(args, dims, range(len(args)))
  outs = prim(*args, **params)
  return outs, (0,) * len(outs)


# -- primitives ------------------------------------------------------------------------


def _forward_avals(x, *rest, **params):
  return (jax.core.ShapedArray(x.shape, x.dtype),
          jax.core.ShapedArray(x.shape[:-1] + (2,), _F32))


def _logits(x, where, bias):
  """(z = x + bias in float32, visible) as the kernels see them; absent terms
  are none. Visible: allowed by the mask and not -inf."""
  z = x.astype(_F32)
  if not is_absent(bias):
    z = z + bias.astype(_F32)
  visible = z != -jnp.inf
  if not is_absent(where):
    visible = visible & where
  return z, visible


def _row_stats(z, visible):
  """The residual the forward kernels save: (m, 1 / sum(exp(z - m))) over the
  visible columns, so that p = exp(z - m) * stats[1] there. m is 0 in a row
  without a visible column (whose stats no derivative reads)."""
  m = jnp.max(jnp.where(visible, z, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  total = jnp.sum(jnp.where(visible, jnp.exp(jnp.where(visible, z - m, 0.0)), 0.0), axis=-1,
                  keepdims=True)
  stats = jnp.concatenate([m, 1.0 / jnp.where(total == 0.0, 1.0, total)], axis=-1)
  return lax.stop_gradient(stats)


def _masked_fwd_reference(ref):
  def forward(x, where, bias):
    y = ref(x, where=_present_or_none(where), bias=_present_or_none(bias))
    return y, _row_stats(*_logits(x, where, bias))

  return forward


def _causal_softmax_fwd_reference(x, *, query_offset):
  visible = reference.causal_mask(x.shape[-2], x.shape[-1], query_offset)
  z, finite = _logits(x, absent(jnp.bool_), absent(x.dtype))
  return reference.causal_softmax(x, query_offset=query_offset), _row_stats(z, finite & visible)


def _probabilities(x, where, bias, stats):
  """The float32 probabilities the derivative kernels recompute, 0 exactly
  where a column is invisible (even in a NaN row), and visibility. The
  references recompute them from x (the statistics are residuals, constants
  to differentiation), so that derivatives of any order stay exact."""
  del stats
  _, visible = _logits(x, where, bias)
  p = reference.softmax(x.astype(_F32), where=_present_or_none(where),
                        bias=None if is_absent(bias) else bias.astype(_F32))
  return jnp.where(visible, p, 0.0), visible


def _softmax_linear_map(p, g):
  """The kernels' map, backward and JVP alike: p * (g - sum(p * g)) over the
  visible columns; an invisible one (p = 0: masked, -inf, causally hidden)
  takes no part and gets 0, even where g is non-finite (a -inf bias's tangent)
  or the row's sum is NaN (a NaN row)."""
  visible = p != 0
  s = jnp.sum(jnp.where(visible, p * g, 0.0), axis=-1, keepdims=True)
  return jnp.where(visible, p * (g - s), 0.0)


def _log_softmax_vjp_map(p, visible, g):
  total = jnp.sum(jnp.where(visible, g, 0.0), axis=-1, keepdims=True)
  return jnp.where(visible, g - p * total, 0.0)


def _log_softmax_jvp_map(p, visible, t):
  t = jnp.where(visible, t, 0.0)
  total = jnp.sum(p * t, axis=-1, keepdims=True)
  return jnp.where(visible, t - total, 0.0)


def _softmax_bwd_reference(dy, x, where, bias, stats):
  p, _ = _probabilities(x, where, bias, stats)
  return (_softmax_linear_map(p, dy.astype(_F32)).astype(x.dtype),)


def _log_softmax_bwd_reference(dy, x, where, bias, stats):
  p, visible = _probabilities(x, where, bias, stats)
  return (_log_softmax_vjp_map(p, visible, dy.astype(_F32)).astype(x.dtype),)


def _causal_probabilities(x, stats, query_offset):
  visible = reference.causal_mask(x.shape[-2], x.shape[-1], query_offset)
  return _probabilities(x, visible, absent(x.dtype), stats)[0]


def _causal_softmax_bwd_reference(dy, x, stats, *, query_offset):
  p = _causal_probabilities(x, stats, query_offset)
  return (_softmax_linear_map(p, dy.astype(_F32)).astype(x.dtype),)


def _tangent_sum(dx, dbias, shape):
  """t = dx + dbias in float32 (absent terms are zero; the bias broadcasts)."""
  t = jnp.zeros(shape, _F32)
  if not is_absent(dx):
    t = t + dx.astype(_F32)
  if not is_absent(dbias):
    t = t + dbias.astype(_F32)
  return t


def _softmax_jvp_reference(x, where, bias, stats, dx, dbias):
  p, _ = _probabilities(x, where, bias, stats)
  return (_softmax_linear_map(p, _tangent_sum(dx, dbias, x.shape)).astype(x.dtype),)


def _log_softmax_jvp_reference(x, where, bias, stats, dx, dbias):
  p, visible = _probabilities(x, where, bias, stats)
  return (_log_softmax_jvp_map(p, visible, _tangent_sum(dx, dbias, x.shape)).astype(x.dtype),)


def _causal_softmax_jvp_reference(x, stats, dx, *, query_offset):
  p = _causal_probabilities(x, stats, query_offset)
  return (_softmax_linear_map(p, _tangent_sum(dx, absent(x.dtype), x.shape)).astype(x.dtype),)


def _make(name, reference_fn, batch_rule, roles, whole_trailing=1, abstract_eval=_same_as_x):
  # Rows shard; the softmax axis (both of causal_softmax's axes) stays whole.
  # The statistics ([..., 2]) are an "x" role: their leading axes are x's.
  return FfiPrimitive(name=name, target=name, abstract_eval=abstract_eval,
                      reference=reference_fn, batch_rule=batch_rule,
                      sharding=leading_axes(roles, whole_trailing=whole_trailing))


softmax_fwd_p = _make("jaxops_softmax_fwd", _masked_fwd_reference(reference.softmax),
                      _masked_batch_rule((0,)), "xxx -> xx", abstract_eval=_forward_avals)
log_softmax_fwd_p = _make("jaxops_log_softmax_fwd", _masked_fwd_reference(reference.log_softmax),
                          _masked_batch_rule((0,)), "xxx -> xx", abstract_eval=_forward_avals)
causal_softmax_fwd_p = _make("jaxops_causal_softmax_fwd", _causal_softmax_fwd_reference,
                             _row_batch_rule, "x -> xx", whole_trailing=2,
                             abstract_eval=_forward_avals)
# Operands (x, where, bias, stats, dx, dbias).
softmax_jvp_p = _make("jaxops_softmax_jvp", _softmax_jvp_reference, _masked_batch_rule((0, 3, 4)),
                      "xxxxxx -> x")
log_softmax_jvp_p = _make("jaxops_log_softmax_jvp", _log_softmax_jvp_reference,
                          _masked_batch_rule((0, 3, 4)), "xxxxxx -> x")
# causal_softmax's tangent knows the causal limit: its x is not masked.
causal_softmax_jvp_p = _make("jaxops_causal_softmax_jvp", _causal_softmax_jvp_reference,
                             _row_batch_rule, "xxx -> x", whole_trailing=2)
# Operands (dy, x, where, bias, stats).
softmax_bwd_p = _make("jaxops_softmax_bwd", _softmax_bwd_reference, _masked_batch_rule((0, 1, 4)),
                      "xxxxx -> x")
log_softmax_bwd_p = _make("jaxops_log_softmax_bwd", _log_softmax_bwd_reference,
                          _masked_batch_rule((0, 1, 4)), "xxxxx -> x")
causal_softmax_bwd_p = _make("jaxops_causal_softmax_bwd", _causal_softmax_bwd_reference,
                             _row_batch_rule, "xxx -> x", whole_trailing=2)


# -- differentiation: the tangent kernels, transposed to the backward kernels -----------


def _bias_grad(dx, bias_aval):
  """Sum of dx over the axes the bias broadcasts along (bias has x's rank)."""
  axes = tuple(i for i, (b, n) in enumerate(zip(bias_aval.shape, dx.shape)) if b == 1 and n != 1)
  if not axes:
    return dx.astype(bias_aval.dtype)
  return dx.astype(_F32).sum(axis=axes, keepdims=True).astype(bias_aval.dtype)


def _masked_transpose(bwd_p):
  def transpose(cotangents, saved, wanted):
    (dy,), (x, where, bias, stats) = cotangents, saved
    dx = bwd_p(dy, x, where, bias, stats)[0]
    return dx, None if wanted[1] is None else _bias_grad(dx, wanted[1])

  return transpose


def _causal_transpose(cotangents, saved, wanted, *, query_offset):
  (dy,), (x, stats) = cotangents, saved
  return (causal_softmax_bwd_p(dy, x, stats, query_offset=query_offset)[0],)


for _fwd_p, _jvp_p, _bwd_p, _name in (
    (softmax_fwd_p, softmax_jvp_p, softmax_bwd_p, "jaxops.softmax"),
    (log_softmax_fwd_p, log_softmax_jvp_p, log_softmax_bwd_p, "jaxops.log_softmax")):
  Differentiable(forward=_fwd_p, tangent=_jvp_p, transpose=_masked_transpose(_bwd_p),
                 tangent_inputs=(0, 2), outputs=1, saved_inputs=(0, 1, 2), saved_outputs=(1,),
                 checkpoint_name=_name)

Differentiable(forward=causal_softmax_fwd_p, tangent=causal_softmax_jvp_p,
               transpose=_causal_transpose, tangent_inputs=(0,), outputs=1, saved_inputs=(0,),
               saved_outputs=(1,), checkpoint_name="jaxops.causal_softmax")


# -- public functions ------------------------------------------------------------------


def _named_output(y, op):
  """y under the op's checkpoint name, as its residuals are: the derivatives
  no longer read y, but what follows often does (attention's p @ v, a mask of
  where y is finite), and ``save_only_these_names(op)`` kept y when y was the
  residual; it still keeps it, rather than running the forward again."""
  return checkpoint_name(y, op)


def _masked_softmax(op, fwd_p, ref, x, axis, where, bias, implementation):
  x = validation.float_array(op, "x", x, complex=True)
  validation.rank(op, "x", x, low=1)
  axis = validation.axis(op, "axis", axis, x.ndim)
  if where is not None:
    where = validation.bool_array(op, "where", where)
    validation.broadcastable(op, "where", where, x.shape, of="the shape of x")
  if bias is not None:
    bias = validation.float_array(op, "bias", bias, complex=jnp.iscomplexobj(x))
    validation.broadcastable(op, "bias", bias, x.shape, of="the shape of x")
    bias = bias.astype(x.dtype)
  if x.size == 0 or not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return ref(x, axis, where=where, bias=bias)

  def to_kernel_layout(value):
    value = value.reshape((1,) * (x.ndim - value.ndim) + value.shape)
    return jnp.moveaxis(value, axis, -1)

  where = absent(jnp.bool_) if where is None else to_kernel_layout(where)
  bias = absent(x.dtype) if bias is None else to_kernel_layout(bias)
  y = _named_output(fwd_p(jnp.moveaxis(x, axis, -1), where, bias)[0], op)
  return jnp.moveaxis(y, -1, axis)


def softmax(x, axis: int = -1, *, where=None, bias=None, implementation=None):
  """Softmax of ``x + bias`` along ``axis``, over the columns ``where`` allows.

  A drop-in for ``jax.nn.softmax(x, axis, where=where)`` (same values), with
  ``bias`` added. Computed in float32 and returned in ``x.dtype``. Columns that
  are masked out, or where ``x + bias`` is -inf, get probability 0 and no
  gradient; a row with no visible column is all zeros (never NaN).

  Args:
    x: float32, bfloat16 or float16 (the kernel), or float64 or complex (the
      jnp reference; complex is ``exp(x) / sum(exp(x))``, as jax.nn's).
    axis: the axis to normalise; any axis (a non-last one is moved last around
      the kernel, which costs a transpose each way).
    where: optional boolean array broadcastable to ``x``: True = visible.
    bias: optional float array broadcastable to ``x``, added to x (in x's
      dtype) before the softmax; it receives the gradient summed over the axes
      it broadcasts along.
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: ``x`` or ``bias`` is not a floating-point array, ``where`` is not
      boolean, or ``implementation="ffi"`` has no kernel for ``x.dtype``.
    ValueError: ``axis`` is out of range, or ``where`` or ``bias`` does not
      broadcast to ``x.shape``.

  Examples:
    >>> x = jnp.array([[1.0, 2.0, 3.0]])
    >>> jaxops.softmax(x)
    Array([[0.090..., 0.244..., 0.665...]], dtype=float32)
    >>> jaxops.softmax(x, where=jnp.array([True, True, False]))
    Array([[0.268..., 0.731..., 0. ...]], dtype=float32)
  """
  return _masked_softmax("jaxops.softmax", softmax_fwd_p, reference.softmax, x, axis, where,
                         bias, implementation)


def log_softmax(x, axis: int = -1, *, where=None, bias=None, implementation=None):
  """Log-softmax of ``x + bias`` along ``axis``, over the columns ``where`` allows.

  Invisible columns (masked out, or where ``x + bias`` is -inf) are -inf and
  receive no gradient; a row with no visible column is all -inf with a zero
  gradient, never NaN. This is ``log(softmax(...))`` exactly.
  ``jax.nn.log_softmax`` agrees on the masked columns' values but differs on
  rows of -inf logits without ``where`` (it returns NaN) and passes a gradient
  to -inf logits; here they are constants.

  Args:
    x: as in :func:`softmax`.
    axis: as in :func:`softmax`.
    where: as in :func:`softmax`.
    bias: as in :func:`softmax`.
    implementation: as in :func:`softmax`.

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: as :func:`softmax`.
    ValueError: as :func:`softmax`.

  Examples:
    >>> jaxops.log_softmax(jnp.array([0.0, 0.0]))
    Array([-0.693..., -0.693...], dtype=float32)
  """
  return _masked_softmax("jaxops.log_softmax", log_softmax_fwd_p, reference.log_softmax, x,
                         axis, where, bias, implementation)


def causal_softmax(x, *, query_offset: int = 0, implementation=None):
  """Softmax over the last axis with a causal mask over the last two axes.

  Query ``i`` (axis -2) sees keys ``j <= i + query_offset`` (axis -1); the
  kernel skips the masked columns instead of reading a mask. A row that sees no
  key (negative offsets) is all zeros.

  Args:
    x: array ``[..., queries, keys]`` of rank >= 2; dtypes as in :func:`softmax`.
    query_offset: a static Python int, e.g. the number of cached keys before
      the first query.
    implementation: ``None``, ``"ffi"`` or ``"xla"``, as in :func:`softmax`.

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: ``x`` is not a floating-point array or ``query_offset`` not an int.
    ValueError: ``x`` has rank < 2.

  Examples:
    >>> jaxops.causal_softmax(jnp.zeros((3, 3)))
    Array([[1. ..., 0. ..., 0. ...],
           [0.5..., 0.5..., 0. ...],
           [0.333..., 0.333..., 0.333...]], dtype=float32)
  """
  op = "jaxops.causal_softmax"
  x = validation.float_array(op, "x", x, complex=True)
  validation.rank(op, "x", x, low=2)
  query_offset = validation.static_int(op, "query_offset", query_offset)
  if x.size == 0 or not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.causal_softmax(x, query_offset=query_offset)
  return _named_output(causal_softmax_fwd_p(x, query_offset=query_offset)[0], op)
