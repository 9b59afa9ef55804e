"""layer_norm, rms_norm and add_rms_norm: primitives and public functions.

Forward primitives return the output and the float32 row statistics the
tangent and backward kernels need (mean, rstd). Tangent primitives (forward
mode) produce dy from the tangents of x, weight and bias in one pass over each
row; backward primitives (their transposes) produce dx and the weight/bias
gradients in one pass over dy and x. An absent weight or bias, or a zero
tangent, is passed to the kernels as a zero-size array, so one handler
signature serves every case.

The statistics are residuals (zero tangent): the references of the tangent and
backward primitives recompute them from x, which is what makes second and
higher derivatives exact.

Weight gradients are reduced per *group* of rows: the public call uses one
group; vmap over x with a shared weight multiplies the groups by the batch
size, which gives the per-example weight gradients vmap(grad) asks for while
the kernel still runs once over all rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import (
    NOT_MAPPED, FfiPrimitive, absent, batch_to_front, is_absent, is_batched)
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32

def _rows(shape) -> int:
  return math.prod(shape[:-1])


def _stat_aval(x):
  return jax.core.ShapedArray(x.shape[:-1], _F32)


def _grad_aval(param, groups, cols):
  return jax.core.ShapedArray((groups, cols if param.shape[0] else 0), param.dtype)


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
    groups = params.get("groups", 1)
    if grad_outputs:
      params = dict(params, groups=groups * size)
    outs = list(prim(*args, **params))
    for i in grad_outputs:
      outs[i] = outs[i].reshape(size, groups, outs[i].shape[-1])
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


def _make(name, *, abstract_eval, reference_fn, batch_rule, roles, reference_params=(),
          input_output_aliases=None, composite=None):
  return FfiPrimitive(
      name=name, target=None if composite else name, abstract_eval=abstract_eval,
      reference=reference_fn, composite=composite, reference_params=reference_params,
      batch_rule=batch_rule,
      input_output_aliases=input_output_aliases or {},
      # Rows shard; the feature axis and weight/bias (and their gradients) stay whole.
      sharding=None if composite else leading_axes(roles, grouped_axes=_grouped_axes),
      local_params=_local_groups)


def _like(x):
  return jax.core.ShapedArray(x.shape, x.dtype)


def _tangent_or_zero(tangent, primal):
  return jnp.zeros_like(primal) if is_absent(tangent) else tangent


def upcast_all(*arrays):
  return [a.astype(_F32) for a in arrays]


def _jvp_of(fn, primals, tangents):
  """The tangent of ``fn`` at ``primals`` (absent tangents are zero)."""
  return jax.jvp(fn, tuple(primals),
                 tuple(_tangent_or_zero(t, p) for t, p in zip(tangents, primals)))[1]


# -- layer norm ---------------------------------------------------------------------


def _layer_norm_fwd_reference(x, weight, bias, *, epsilon):
  return reference.layer_norm_with_stats(
      x, _param_or_none(weight), _param_or_none(bias), epsilon=epsilon)


def _layer_norm_bwd_reference(dy, x, weight, bias, mean, rstd, *, groups, epsilon):
  del mean, rstd  # recomputed, so that the reference differentiates exactly
  xf = x.astype(_F32)
  mean = xf.mean(-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + epsilon)
  xhat = (xf - mean) * rstd
  dyf = dy.astype(_F32)
  g = dyf * (weight.astype(_F32) if weight.shape[0] else 1.0)
  dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) * rstd
  dweight = _grouped_column_sum(dyf * xhat, groups) if weight.shape[0] else jnp.zeros((groups, 0))
  dbias = _grouped_column_sum(dyf, groups) if bias.shape[0] else jnp.zeros((groups, 0))
  return dx.astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(bias.dtype)


def _layer_norm_jvp_reference(x, weight, mean, rstd, dx, dweight, dbias, *, epsilon):
  del mean, rstd
  norm = lambda x, w: reference.layer_norm(x, _param_or_none(w), epsilon=epsilon)
  dy = _jvp_of(norm, upcast_all(x, weight), upcast_all(dx, dweight))
  if not is_absent(dbias):
    dy = dy + dbias.astype(_F32)
  return (dy.astype(x.dtype),)


layer_norm_fwd_p = _make(
    "jaxops_layer_norm_fwd",
    abstract_eval=lambda x, w, b, *, epsilon: (_like(x), _stat_aval(x), _stat_aval(x)),
    reference_fn=_layer_norm_fwd_reference,
    batch_rule=_row_batch_rule(row_operands=(0,), column_operands=(1, 2)),
    roles="xpp -> xss")

layer_norm_jvp_p = _make(
    "jaxops_layer_norm_jvp",
    abstract_eval=lambda x, w, mean, rstd, dx, dw, db, *, epsilon: (_like(x),),
    reference_fn=_layer_norm_jvp_reference,
    reference_params=("epsilon",),
    batch_rule=_row_batch_rule(row_operands=(0, 2, 3, 4), column_operands=(1, 5, 6)),
    roles="xpssxpp -> x")

layer_norm_bwd_p = _make(
    "jaxops_layer_norm_bwd",
    abstract_eval=lambda dy, x, w, b, mean, rstd, *, groups, epsilon: (
        _like(x), _grad_aval(w, groups, x.shape[-1]), _grad_aval(b, groups, x.shape[-1])),
    reference_fn=_layer_norm_bwd_reference,
    reference_params=("epsilon",),
    batch_rule=_row_batch_rule(row_operands=(0, 1, 4, 5), column_operands=(2, 3),
                               grad_outputs=(1, 2)),
    roles="xxppss -> xgg")


def _layer_norm_transpose(cotangents, saved, wanted, *, epsilon):
  (dy,) = cotangents
  x, weight, mean, rstd = saved
  # The kernel needs the bias operand only to know whether dbias is wanted.
  bias = absent(x.dtype) if wanted[2] is None else jnp.zeros(wanted[2].shape, x.dtype)
  dx, dweight, dbias = layer_norm_bwd_p(dy, x, weight, bias, mean, rstd, groups=1,
                                        epsilon=epsilon)
  return dx, dweight.reshape(weight.shape), dbias.reshape(bias.shape)


Differentiable(
    forward=layer_norm_fwd_p, tangent=layer_norm_jvp_p, transpose=_layer_norm_transpose,
    tangent_inputs=(0, 1, 2), outputs=1, saved_inputs=(0, 1), saved_outputs=(1, 2),
    checkpoint_name="jaxops.layer_norm")


def layer_norm(x, weight=None, bias=None, *, epsilon: float = 1e-5, implementation=None):
  """Layer normalization over the last axis of ``x``.

  ``(x - mean) / sqrt(var + epsilon) * weight + bias`` with the biased variance,
  computed in float32 and returned in ``x.dtype``: the values of
  ``flax.linen.LayerNorm(use_fast_variance=False)``, whose ``scale`` is ``weight``.
  Note the default ``epsilon``: 1e-5 (PyTorch's), where Flax's is 1e-6. One fused
  kernel computes the forward, one the backward (dx, dweight and dbias together;
  ``vmap(grad(...))`` gives per-example weight gradients from one call), one the
  forward-mode tangent.

  Args:
    x: array ``[..., features]`` of rank >= 1. float32, bfloat16 and float16 run
      the kernel; float64 and complex (variance of ``|x - mean|``, as Flax) the
      jnp reference.
    weight: optional ``[features]`` scale, cast to ``x.dtype`` (as Flax does for
      a low-precision ``dtype``).
    bias: optional ``[features]`` offset, cast to ``x.dtype``.
    epsilon: a Python float >= 0 added to the variance.
    implementation: ``None`` (the fused kernel where one exists for the platform
      and dtype, else the jnp reference), ``"ffi"`` (the kernel, or an error) or
      ``"xla"`` (the reference, ``jaxops.reference.layer_norm``).

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: ``x``, ``weight`` or ``bias`` is not a floating-point array,
      ``epsilon`` is not a real number, or ``implementation="ffi"`` has no
      kernel for ``x.dtype``.
    ValueError: ``x`` has rank 0 or an empty last axis, ``weight`` or ``bias``
      is not of shape ``(features,)``, ``epsilon`` is negative, or
      ``implementation`` is not one of the three values.

  Examples:
    >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    >>> jaxops.layer_norm(x)
    Array([[-1.341..., -0.447..., 0.447..., 1.341...]], dtype=float32)
    >>> jaxops.layer_norm(x, jnp.full(4, 2.0), jnp.ones(4))
    Array([[-1.683..., 0.105..., 1.894..., 3.683...]], dtype=float32)
  """
  op = "jaxops.layer_norm"
  x = _input(op, x)
  weight = _param_vector(op, "weight", weight, x)
  bias = _param_vector(op, "bias", bias, x)
  epsilon = _epsilon(op, epsilon)
  if not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.layer_norm(x, weight, bias, epsilon=epsilon)
  return layer_norm_fwd_p(x, _present_or_absent(weight, x), _present_or_absent(bias, x),
                          epsilon=epsilon)[0]


# -- rms norm -----------------------------------------------------------------------


def _rms_norm_fwd_reference(x, weight, *, epsilon):
  return reference.rms_norm_with_stats(x, _param_or_none(weight), epsilon=epsilon)


def _rms_norm_bwd_reference(dy, x, weight, rstd, dresidual, *, groups, epsilon):
  del rstd  # recomputed, so that the reference differentiates exactly
  xf = x.astype(_F32)
  rstd = jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + epsilon)
  xhat = xf * rstd
  dyf = dy.astype(_F32)
  g = dyf * (weight.astype(_F32) if weight.shape[0] else 1.0)
  dx = (g - xhat * (g * xhat).mean(-1, keepdims=True)) * rstd
  if dresidual.shape == x.shape:
    dx = dx + dresidual.astype(_F32)
  dweight = _grouped_column_sum(dyf * xhat, groups) if weight.shape[0] else jnp.zeros((groups, 0))
  return dx.astype(x.dtype), dweight.astype(weight.dtype)


def _rms_norm_jvp_reference(x, weight, rstd, dx, dweight, *, epsilon):
  del rstd
  norm = lambda x, w: reference.rms_norm(x, _param_or_none(w), epsilon=epsilon)
  dy = _jvp_of(norm, upcast_all(x, weight), upcast_all(dx, dweight))
  return (dy.astype(x.dtype),)


def _add_rms_norm_fwd_reference(x, residual, weight, *, epsilon):
  h = x + residual
  y, rstd = reference.rms_norm_with_stats(h, _param_or_none(weight), epsilon=epsilon)
  return y, h, rstd


rms_norm_fwd_p = _make(
    "jaxops_rms_norm_fwd",
    abstract_eval=lambda x, w, *, epsilon: (_like(x), _stat_aval(x)),
    reference_fn=_rms_norm_fwd_reference,
    batch_rule=_row_batch_rule(row_operands=(0,), column_operands=(1,)),
    roles="xp -> xs")

rms_norm_jvp_p = _make(
    "jaxops_rms_norm_jvp",
    abstract_eval=lambda x, w, rstd, dx, dw, *, epsilon: (_like(x),),
    reference_fn=_rms_norm_jvp_reference,
    reference_params=("epsilon",),
    batch_rule=_row_batch_rule(row_operands=(0, 2, 3), column_operands=(1, 4)),
    roles="xpsxp -> x")


def _rms_norm_bwd_batch_rule(prim, args, dims, **params):
  # dresidual is a row operand when present, a zero-size placeholder otherwise.
  present = dims[4] is not NOT_MAPPED or args[4].size > 0
  rows = (0, 1, 3, 4) if present else (0, 1, 3)
  return _row_batch_rule(rows, (2,), grad_outputs=(1,))(prim, args, dims, **params)


rms_norm_bwd_p = _make(
    "jaxops_rms_norm_bwd",
    abstract_eval=lambda dy, x, w, rstd, dres, *, groups, epsilon: (
        _like(x), _grad_aval(w, groups, x.shape[-1])),
    reference_fn=_rms_norm_bwd_reference,
    reference_params=("epsilon",),
    batch_rule=_rms_norm_bwd_batch_rule,
    roles="xxpsx -> xg")

add_rms_norm_fwd_p = _make(
    "jaxops_add_rms_norm_fwd",
    abstract_eval=lambda x, r, w, *, epsilon: (_like(x), _like(x), _stat_aval(x)),
    reference_fn=_add_rms_norm_fwd_reference,
    batch_rule=_row_batch_rule(row_operands=(0, 1), column_operands=(2,)),
    roles="xxp -> xxs",
    # h is written over the residual's buffer when the caller donates it.
    input_output_aliases={1: 1})


def _add_rms_norm_tangent(weight, h, rstd, dx, dresidual, dweight, *, epsilon):
  """dh = dx + dresidual; dy = rms_norm's tangent at h along dh (and dweight)."""
  if is_absent(dx) and is_absent(dresidual):
    dh = jnp.zeros_like(h)
  elif is_absent(dx) or is_absent(dresidual):
    dh = dresidual if is_absent(dx) else dx
  else:
    dh = dx + dresidual
  (dy,) = rms_norm_jvp_p(h, weight, rstd, dh, dweight, epsilon=epsilon)
  return dy, dh


def _add_rms_norm_jvp_reference(weight, h, rstd, dx, dresidual, dweight, *, epsilon):
  dh = _tangent_or_zero(dx, h) + _tangent_or_zero(dresidual, h)
  (dy,) = _rms_norm_jvp_reference(h, weight, rstd, dh, dweight, epsilon=epsilon)
  return dy, dh


add_rms_norm_jvp_p = _make(
    "jaxops_add_rms_norm_jvp",
    abstract_eval=lambda w, h, rstd, dx, dr, dw, *, epsilon: (_like(h), _like(h)),
    reference_fn=_add_rms_norm_jvp_reference, composite=_add_rms_norm_tangent,
    batch_rule=_row_batch_rule(row_operands=(1, 2, 3, 4), column_operands=(0, 5)),
    roles="pxsxxp -> xx")


def _rms_norm_transpose(cotangents, saved, wanted, *, epsilon):
  (dy,) = cotangents
  x, weight, rstd = saved
  dx, dweight = rms_norm_bwd_p(dy, x, weight, rstd, absent(x.dtype), groups=1, epsilon=epsilon)
  return dx, dweight.reshape(weight.shape)


def _add_rms_norm_transpose(cotangents, saved, wanted, *, epsilon):
  dy, dh = cotangents
  weight, h, rstd = saved
  # h = x + residual, so both receive the same gradient: the norm's, plus h's own.
  dy = jnp.zeros_like(h) if dy is None else dy
  dsum, dweight = rms_norm_bwd_p(dy, h, weight, rstd, absent(h.dtype) if dh is None else dh,
                                 groups=1, epsilon=epsilon)
  return dsum, dsum, dweight.reshape(weight.shape)


Differentiable(
    forward=rms_norm_fwd_p, tangent=rms_norm_jvp_p, transpose=_rms_norm_transpose,
    tangent_inputs=(0, 1), outputs=1, saved_inputs=(0, 1), saved_outputs=(1,),
    checkpoint_name="jaxops.rms_norm")

Differentiable(
    forward=add_rms_norm_fwd_p, tangent=add_rms_norm_jvp_p, transpose=_add_rms_norm_transpose,
    tangent_inputs=(0, 1, 2), outputs=2, saved_inputs=(2,), saved_outputs=(1, 2),
    checkpoint_name="jaxops.add_rms_norm")


def rms_norm(x, weight=None, *, epsilon: float = 1e-6, implementation=None):
  """RMS normalization over the last axis: ``x / sqrt(mean(x**2) + epsilon) * weight``.

  Computed in float32 and returned in ``x.dtype``: the values of
  ``flax.linen.RMSNorm`` (whose ``scale`` is ``weight``). Fused forward,
  backward and forward-mode kernels, as :func:`layer_norm`'s.

  Args:
    x: array ``[..., features]`` of rank >= 1; dtypes as in :func:`layer_norm`
      (complex: ``mean(|x|**2)``, as Flax).
    weight: optional ``[features]`` scale, cast to ``x.dtype``.
    epsilon: a Python float >= 0 added to the mean square.
    implementation: ``None``, ``"ffi"`` or ``"xla"``, as in :func:`layer_norm`.

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: as :func:`layer_norm`.
    ValueError: as :func:`layer_norm`.

  Examples:
    >>> jaxops.rms_norm(jnp.array([[3.0, 4.0]]))
    Array([[0.848..., 1.131...]], dtype=float32)
  """
  op = "jaxops.rms_norm"
  x = _input(op, x)
  weight = _param_vector(op, "weight", weight, x)
  epsilon = _epsilon(op, epsilon)
  if not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.rms_norm(x, weight, epsilon=epsilon)
  return rms_norm_fwd_p(x, _present_or_absent(weight, x), epsilon=epsilon)[0]


def add_rms_norm(x, residual, weight=None, *, epsilon: float = 1e-6, implementation=None):
  """``(rms_norm(x + residual) * weight, x + residual)`` in one pass.

  The pre-norm transformer's residual step: the sum is returned for the next
  residual connection and normalised in the same pass. When the caller donates
  ``residual`` (``jax.jit(..., donate_argnums=...)``), the sum is written over
  it.

  Args:
    x: array ``[..., features]``; dtypes as in :func:`layer_norm`.
    residual: array of ``x``'s shape. ``x`` and ``residual`` of different dtypes
      are promoted to their common dtype first, as ``x + residual`` is.
    weight: optional ``[features]`` scale, cast to the common dtype.
    epsilon: a Python float >= 0 added to the mean square.
    implementation: ``None``, ``"ffi"`` or ``"xla"``, as in :func:`layer_norm`.

  Returns:
    ``(y, h)``: the normalised sum ``y`` and the sum ``h = x + residual``, both
    shaped like ``x`` in the common dtype.

  Raises:
    TypeError: as :func:`layer_norm`, or ``residual`` is not a floating-point array.
    ValueError: as :func:`layer_norm`, or ``residual``'s shape is not ``x``'s.

  Examples:
    >>> y, h = jaxops.add_rms_norm(jnp.array([[1.0, 2.0]]), jnp.array([[2.0, 2.0]]))
    >>> h
    Array([[3., 4.]], dtype=float32)
    >>> y
    Array([[0.848..., 1.131...]], dtype=float32)
  """
  op = "jaxops.add_rms_norm"
  x = _input(op, x)
  residual = validation.float_array(op, "residual", residual, complex=True)
  common = jnp.promote_types(x.dtype, residual.dtype)
  x, residual = x.astype(common), residual.astype(common)
  validation.same_as(op, "residual", residual, "x", x)
  weight = _param_vector(op, "weight", weight, x)
  epsilon = _epsilon(op, epsilon)
  if not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.add_rms_norm(x, residual, weight, epsilon=epsilon)
  y, h, _ = add_rms_norm_fwd_p(x, residual, _present_or_absent(weight, x), epsilon=epsilon)
  return y, h


# -- argument handling ---------------------------------------------------------------


def _present_or_absent(param, x):
  return absent(x.dtype) if param is None else param


def _input(op, x):
  x = validation.float_array(op, "x", x, complex=True)
  validation.rank(op, "x", x, low=1)
  validation.non_empty_axis(op, "x", x)
  return x


def _param_vector(op, name, value, x):
  """An optional per-feature parameter of x's last axis, cast to x's dtype (as
  Flax does for a low-precision ``dtype``); complex only for complex x."""
  if value is None:
    return None
  value = validation.float_array(op, name, value, complex=jnp.iscomplexobj(x))
  validation.shape(op, name, value, (x.shape[-1],), of="x.shape[-1:]")
  return value.astype(x.dtype)


def _epsilon(op, epsilon):
  return validation.static_float(op, "epsilon", epsilon, low=0.0)
