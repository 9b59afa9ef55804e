"""2:4 structured-sparse linear layer: the packed weight, its primitives and functions.

A weight ``w [out, in]`` is *2:4 sparse* along ``in`` when every group of 4
consecutive inputs (columns ``4g .. 4g + 3`` of a row) holds at most 2
nonzeros. ``compress`` packs it into a :class:`SparseWeight`:

* ``values``   ``[out, in / 2]`` in the weight's dtype: the 2 kept values of
  every group, in index order;
* ``metadata`` ``[out, ceil(in / 8)]`` uint8: byte ``j`` holds the 2-bit
  in-group positions of values ``4j .. 4j + 3`` (those of groups ``2j`` and
  ``2j + 1``), low bits first; value ``k`` of a row is the weight at column
  ``4 * (k // 2) + position(k)``. When ``in / 4`` is odd the high nibble of
  each row's last byte is unused (zero).

``in`` must be a multiple of 4 (not of 8: the metadata's last byte may be half
used); another ``in`` is an error, never padded silently. A group with fewer
than 2 nonzeros keeps zeros at its lowest free positions (the ``prune_2_4``
rule: the 2 largest ``|w|``, ties to the lower index). A position is 2 bits, so
no metadata can make a kernel read outside its group; two equal positions in
one group (metadata not made by ``compress``) add their values, in the kernels
and in ``decompress`` alike.

``linear(x, w, bias)`` is ``x @ decompress(w).T + bias``. x and the weight (and
bias) are promoted to their common dtype, which is the output's (x's when they
match); products accumulate in float32.

Differentiation: the forward primitive F is bilinear in (x, values); its
tangent primitive T runs F twice (``F(dx, values) + F(x, dvalues)``) plus the
bias tangent, and T's transpose runs two kernels: ``dx = dy @ W`` through the
packed weight and ``dvalues = (dy^T x)`` at the kept positions only (a sampled
product: the dense ``[out, in]`` gradient is never formed), so training keeps
the sparsity pattern. The metadata is integer data: its cotangent is float0
(``jax.grad(..., allow_int=True)`` when differentiating a whole SparseWeight).

Batching: x's vmapped axis joins its rows (one kernel call); a vmapped
(stacked) weight, and the per-example value gradients of ``vmap(grad)``, run
the kernel once per example (``lax.map``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import reference
from jaxops._src import matmul_precision, primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, batch_to_front, is_absent
from jaxops._src.sharding import Factors

_GROUP = 4


def metadata_cols(in_features: int) -> int:
  """Bytes of metadata per row of a packed weight: ``ceil(in_features / 8)``.

  Args:
    in_features: the weight's ``in``, a multiple of 4.

  Returns:
    An int.

  Examples:
    >>> jaxops.sparse.metadata_cols(64)
    8
  """
  return (in_features // _GROUP + 1) // 2


@jax.tree_util.register_pytree_node_class
class SparseWeight:
  """A 2:4 sparse weight ``[out, in]`` in packed form (layout: module docstring).

  A pytree: ``values`` and ``metadata`` are its leaves and ``in_features`` its
  static data, so it passes through ``jit``, ``grad``, ``vmap`` and optax
  (whose updates to the uint8 metadata leaf must be masked out, e.g. with
  ``optax.masked``). Under ``vmap`` the leaves carry extra leading axes.
  """

  def __init__(self, values, metadata, in_features: int):
    self.values = values
    self.metadata = metadata
    self.in_features = in_features

  def tree_flatten(self):
    return (self.values, self.metadata), self.in_features

  @classmethod
  def tree_unflatten(cls, in_features, leaves):
    return cls(*leaves, in_features)

  @property
  def shape(self):
    """The dense weight's shape ``(..., out, in)``."""
    return tuple(self.values.shape[:-1]) + (self.in_features,)

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def nbytes(self) -> int:
    """Bytes of the packed form (values and metadata)."""
    return self.values.nbytes + self.metadata.nbytes

  def __repr__(self):
    return (f"SparseWeight(shape={self.shape}, dtype={self.dtype}, "
            f"values={self.values.dtype}{list(self.values.shape)}, "
            f"metadata={self.metadata.dtype}{list(self.metadata.shape)})")


# -- pruning and packing (plain jnp: traceable, differentiable in the values) --------


def _dense_weight(op, w):
  w = validation.float_array(op, "w", w)
  validation.rank(op, "w", w, low=2, high=2, labels="[out, in]")
  in_features = w.shape[-1]
  if in_features == 0 or in_features % _GROUP:
    raise validation.value_error(
        op, "w", "have a last axis (in) that is a positive multiple of 4 (2:4 groups of 4 "
        "inputs; pad w with zero columns and x with zeros to use another size)",
        f"shape {w.shape}")
  return w


def _keep_mask(w):
  """True at the 2 largest |w| of every group of 4 (ties: the lower index; NaN
  counts as the largest)."""
  magnitude = jnp.abs(w).reshape(w.shape[:-1] + (w.shape[-1] // _GROUP, _GROUP))
  magnitude = jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude)
  mine, other = magnitude[..., :, None], magnitude[..., None, :]
  index = jnp.arange(_GROUP)
  lower = index[None, :] < index[:, None]  # [i, j]: j is a lower index than i
  beaten_by = (other > mine) | ((other == mine) & lower)
  return (beaten_by.sum(-1) < 2).reshape(w.shape)


def prune_2_4(w):
  """Keeps the 2 largest ``|w|`` of every group of 4 inputs of ``w``.

  Args:
    w: float array ``[out, in]`` with ``in`` a multiple of 4.

  Returns:
    ``(w_pruned, mask)``: ``w`` with the other two of each group zeroed (ties go
    to the lower index), and the boolean keep-mask of ``w``'s shape.

  Raises:
    TypeError: ``w`` is not a floating-point array.
    ValueError: ``w`` is not of rank 2, or ``in`` is not a multiple of 4.

  Examples:
    >>> w_pruned, mask = jaxops.sparse.prune_2_4(jnp.array([[0.1, -3.0, 2.0, 0.5]]))
    >>> w_pruned
    Array([[ 0., -3.,  2.,  0.]], dtype=float32)
  """
  w = _dense_weight("jaxops.sparse.prune_2_4", w)
  mask = _keep_mask(w)
  return jnp.where(mask, w, jnp.zeros((), w.dtype)), mask


def _first_dense_group(w) -> tuple[int, int, int] | None:
  """(row, group, nonzeros) of the first group with more than 2 nonzeros."""
  w = np.asarray(w)
  counts = (w.reshape(w.shape[0], w.shape[1] // _GROUP, _GROUP) != 0).sum(-1)
  bad = np.argwhere(counts > 2)
  if not len(bad):
    return None
  row, group = (int(i) for i in bad[0])
  return row, group, int(counts[row, group])


def compress(w) -> SparseWeight:
  """Packs a 2:4 sparse ``w [out, in]`` into a :class:`SparseWeight`.

  With concrete values, a group of more than 2 nonzeros is a ``ValueError``
  naming the first such (row, group); prune first with :func:`prune_2_4`.
  Under tracing (inside ``jit``, ``grad``, ``vmap``) the values are unknown and
  cannot be checked: the packing keeps the 2 largest ``|w|`` of every group
  (what ``prune_2_4`` keeps), so on a 2:4 input it is exact. Differentiable in
  w (the cotangent of w is the values' cotangent at the kept positions).

  Args:
    w: float array ``[out, in]``, ``in`` a multiple of 4; at most 2 nonzeros
      in every group of 4 inputs.

  Returns:
    A :class:`SparseWeight`: ``values [out, in/2]`` in ``w``'s dtype and
    ``metadata [out, ceil(in/8)]`` uint8.

  Raises:
    TypeError: ``w`` is not a floating-point array.
    ValueError: ``w`` is not of rank 2, ``in`` is not a multiple of 4, or
      (concrete values) a group has more than 2 nonzeros.

  Examples:
    >>> w = jnp.array([[0.0, -3.0, 2.0, 0.0, 1.0, 0.0, 0.0, 4.0]])
    >>> sparse_w = jaxops.sparse.compress(w)
    >>> sparse_w.values
    Array([[-3.,  2.,  1.,  4.]], dtype=float32)
    >>> bool((jaxops.sparse.decompress(sparse_w) == w).all())
    True
  """
  op = "jaxops.sparse.compress"
  w = _dense_weight(op, w)
  if not isinstance(w, jax.core.Tracer):
    found = _first_dense_group(w)
    if found is not None:
      row, group, count = found
      raise ValueError(
          f"{op}: w is not 2:4 sparse: row {row}, group {group} (columns {_GROUP * group}.."
          f"{_GROUP * group + _GROUP - 1}) has {count} nonzeros, at most 2 are allowed; prune "
          "w first with jaxops.sparse.prune_2_4")
  out, in_features = w.shape
  groups = in_features // _GROUP
  keep = _keep_mask(w).reshape(out, groups, _GROUP)
  # The kept positions in index order: the first and the last True of each group.
  first = jnp.argmax(keep, axis=-1)
  last = _GROUP - 1 - jnp.argmax(keep[..., ::-1], axis=-1)
  positions = jnp.stack([first, last], axis=-1)  # [out, groups, 2]
  values = jnp.take_along_axis(w.reshape(out, groups, _GROUP), positions, axis=-1)
  return SparseWeight(values.reshape(out, in_features // 2),
                      _pack(positions.reshape(out, in_features // 2)), in_features)


def _pack(positions):
  """2-bit positions [out, in / 2] -> uint8 [out, ceil(in / 8)], low bits first."""
  out, half = positions.shape
  padded = jnp.pad(positions.astype(jnp.uint8), ((0, 0), (0, -half % 4)))
  quads = padded.reshape(out, padded.shape[1] // 4, 4)
  shifts = jnp.arange(4, dtype=jnp.uint8) * 2
  return jnp.bitwise_or.reduce(quads << shifts, axis=-1).astype(jnp.uint8)


def _checked_weight(op, name, sparse_w) -> SparseWeight:
  if not isinstance(sparse_w, SparseWeight):
    raise validation.type_error(op, name, "be a jaxops.sparse.SparseWeight (from "
                                "jaxops.sparse.compress)", validation.describe(sparse_w))
  in_features = sparse_w.in_features
  values = validation.float_array(op, f"{name}.values", sparse_w.values)
  validation.rank(op, f"{name}.values", values, low=2, high=2, labels="[out, in / 2]")
  if not isinstance(in_features, int) or in_features <= 0 or in_features % _GROUP:
    raise validation.value_error(op, f"{name}.in_features", "be a positive multiple of 4",
                                 validation.describe(in_features))
  validation.shape(op, f"{name}.values", values, (values.shape[0], in_features // 2),
                   of="[out, in / 2]")
  metadata = validation.array(op, f"{name}.metadata", sparse_w.metadata, dtypes=(jnp.uint8,))
  validation.shape(op, f"{name}.metadata", metadata,
                   (values.shape[0], metadata_cols(in_features)), of="[out, ceil(in / 8)]")
  return SparseWeight(values, metadata, in_features)


def decompress(sparse_w) -> jax.Array:
  """The dense weight of a :class:`SparseWeight`.

  Args:
    sparse_w: a :class:`SparseWeight`.

  Returns:
    ``[out, in]`` in the values' dtype, zeros at the dropped positions.

  Examples:
    >>> sparse_w = jaxops.sparse.compress(jnp.array([[1.0, 0.0, 0.0, 2.0]]))
    >>> jaxops.sparse.decompress(sparse_w)
    Array([[1., 0., 0., 2.]], dtype=float32)
  """
  w = _checked_weight("jaxops.sparse.decompress", "sparse_w", sparse_w)
  return reference.sparse_2_4_decompress(w.values, w.metadata, w.in_features)


# -- primitives ------------------------------------------------------------------------


def _rows_aval(rows_like, cols, dtype):
  return jax.core.ShapedArray(tuple(rows_like.shape[:-1]) + (cols,), dtype)


def _row_axes(x):
  return tuple(f"rows{i}" for i in range(x.ndim - 1))


def _map_examples(prim, args, dims, **params):
  """The kernel once per example (``lax.map``) for operands that no kernel
  call can batch natively: a stacked weight, per-example value gradients."""
  batched = [i for i, d in enumerate(dims) if d is not NOT_MAPPED]
  moved = {i: jnp.moveaxis(args[i], dims[i], 0) for i in batched}

  def one(example):
    operands = list(args)
    for i, a in zip(batched, example):
      operands[i] = a
    return prim(*operands, **params)

  outs = jax.lax.map(one, tuple(moved[i] for i in batched))
  return outs, (0,) * len(outs)


def _rows_batch_rule(row_operand):
  """x (or dy) batched alone joins the rows; anything else runs per example."""

  def rule(prim, args, dims, **params):
    if any(d is not NOT_MAPPED for i, d in enumerate(dims) if i != row_operand):
      return _map_examples(prim, args, dims, **params)
    args, _ = batch_to_front(args, dims, (row_operand,))
    return prim(*args, **params), (0,)

  return rule


def _fwd_sharding(avals_in, avals_out, **params):
  """Tokens (x's leading axes) and out (tensor parallelism) shard; in stays whole."""
  x, values, metadata, bias = avals_in
  rows = _row_axes(x)
  return Factors([(*rows, None), ("out", None), ("out", None), ("out",) if bias.shape[0] else (None,)],
                 [(*rows, "out")])


def _dx_sharding(avals_in, avals_out, **params):
  """As the forward; an out-sharded weight gives partial dx, summed over out."""
  dy, values, metadata = avals_in
  rows = _row_axes(dy)
  return Factors([(*rows, "out"), ("out", None), ("out", None)], [(*rows, None)])


def _dvalues_sharding(avals_in, avals_out, **params):
  """As the forward; each token shard's partial dvalues are summed."""
  dy, x, metadata = avals_in
  rows = _row_axes(dy)
  return Factors([(*rows, "out"), (*rows, None), ("out", None)], [("out", None)])


# Every primitive takes allow_tf32 (**params: the float32 precision policy's
# attribute) and none reads it: the kernels and the references compute in full
# float32 at every precision.
def _fwd_reference(x, values, metadata, bias, **params):
  return (reference.sparse_linear(x, values, metadata, None if is_absent(bias) else bias),)


sparse_linear_fwd_p = FfiPrimitive(
    name="jaxops_sparse_linear_fwd", target="jaxops_sparse_linear_fwd",
    abstract_eval=lambda x, values, metadata, bias, **params: (
        _rows_aval(x, values.shape[0], x.dtype),),
    reference=_fwd_reference,
    batch_rule=_rows_batch_rule(0),
    sharding=_fwd_sharding)

sparse_linear_dx_p = FfiPrimitive(
    name="jaxops_sparse_linear_dx", target="jaxops_sparse_linear_dx",
    abstract_eval=lambda dy, values, metadata, **params: (
        _rows_aval(dy, 2 * values.shape[1], dy.dtype),),
    reference=lambda dy, values, metadata, **params: (
        reference.sparse_linear_dx(dy, values, metadata, 2 * values.shape[1]),),
    batch_rule=_rows_batch_rule(0),
    sharding=_dx_sharding)


def _dvalues_batch_rule(prim, args, dims, **params):
  return _map_examples(prim, args, dims, **params)


sparse_linear_dvalues_p = FfiPrimitive(
    name="jaxops_sparse_linear_dvalues", target="jaxops_sparse_linear_dvalues",
    abstract_eval=lambda dy, x, metadata, **params: (
        jax.core.ShapedArray((dy.shape[-1], x.shape[-1] // 2), x.dtype),),
    reference=lambda dy, x, metadata, **params: (
        reference.sparse_linear_dvalues(dy, x, metadata),),
    batch_rule=_dvalues_batch_rule,
    sharding=_dvalues_sharding)


def _tangent(x, values, metadata, dx, dvalues, dbias, **params):
  """dy = F(dx, values) + F(x, dvalues) + dbias: the forward kernel, twice."""
  terms = []
  if not is_absent(dx):
    terms.append(sparse_linear_fwd_p(dx, values, metadata, absent(x.dtype), **params)[0])
  if not is_absent(dvalues):
    terms.append(sparse_linear_fwd_p(x, dvalues, metadata, absent(x.dtype), **params)[0])
  dy = sum(terms[1:], terms[0]) if terms else jnp.zeros(x.shape[:-1] + values.shape[:1], x.dtype)
  if not is_absent(dbias) and dbias.shape[0]:
    dy = dy + dbias
  return (dy,)


def _tangent_reference(x, values, metadata, dx, dvalues, dbias, **params):
  zero_or = lambda t, p: jnp.zeros_like(p) if is_absent(t) else t
  f = lambda x, values: reference.sparse_linear(x, values, metadata)
  dy = jax.jvp(f, (x, values), (zero_or(dx, x), zero_or(dvalues, values)))[1]
  if not is_absent(dbias) and dbias.shape[0]:
    dy = dy + dbias
  return (dy,)


sparse_linear_jvp_p = FfiPrimitive(
    name="jaxops_sparse_linear_jvp", target=None, composite=_tangent,
    abstract_eval=lambda x, values, metadata, dx, dvalues, dbias, **params: (
        _rows_aval(x, values.shape[0], x.dtype),),
    reference=_tangent_reference)


def _transpose(cotangents, saved, wanted, **params):
  (dy,) = cotangents
  x, values, metadata = saved
  dx = dvalues = dbias = None
  if wanted[0] is not None:
    (dx,) = sparse_linear_dx_p(dy, values, metadata, **params)
  if wanted[1] is not None:
    (dvalues,) = sparse_linear_dvalues_p(dy, x, metadata, **params)
  if wanted[2] is not None:
    if wanted[2].shape[0]:
      rows = dy.reshape(-1, dy.shape[-1])
      dbias = rows.sum(axis=0, dtype=jnp.float32).astype(wanted[2].dtype)
    else:
      dbias = jnp.zeros(wanted[2].shape, wanted[2].dtype)
  return dx, dvalues, dbias


Differentiable(
    forward=sparse_linear_fwd_p, tangent=sparse_linear_jvp_p, transpose=_transpose,
    tangent_inputs=(0, 1, 3), outputs=1, saved_inputs=(0, 1, 2),
    checkpoint_name="jaxops.sparse.linear")


# -- the public op ------------------------------------------------------------------


def linear(x, sparse_w, bias=None, *, precision=None, implementation=None):
  """``x @ decompress(sparse_w).T + bias``: ``x [..., in] -> [..., out]``.

  Args:
    x: float array ``[..., in]``.
    sparse_w: a :class:`SparseWeight` of a ``[out, in]`` weight (``compress``).
    bias: optional ``[out]``.
    precision: as ``lax.dot``'s (None follows ``jax.default_matmul_precision``):
      the kernels carry it (``allow_tf32``) but compute in full float32 at every
      setting, on the CPU and on CUDA (docs/precision.md).
    implementation: ``None`` (the kernel for float32, bfloat16 and float16 where
      the backend has one, else the jnp reference), ``"ffi"`` (the kernel, or
      an error) or ``"xla"`` (the reference: the dense product).

  x, the values and the bias are promoted to their common dtype, the output's;
  products accumulate in float32. Differentiable in x, the values and the bias
  (the metadata's cotangent is float0).

  Returns:
    ``[..., out]`` in the common dtype.

  Raises:
    TypeError: ``x`` or ``bias`` is not a floating-point array, or
      ``sparse_w`` is not a :class:`SparseWeight`.
    ValueError: ``x``'s last axis is not ``in``, or ``bias`` is not ``[out]``.

  Examples:
    >>> w = jnp.array([[1.0, 0.0, 0.0, 2.0], [0.0, 3.0, 4.0, 0.0]])
    >>> jaxops.sparse.linear(jnp.ones((1, 4)), jaxops.sparse.compress(w), jnp.ones(2))
    Array([[4., 8.]], dtype=float32)
  """
  op = "jaxops.sparse.linear"
  x = validation.float_array(op, "x", x)
  validation.rank(op, "x", x, low=1, labels="[..., in]")
  w = _checked_weight(op, "sparse_w", sparse_w)
  if x.shape[-1] != w.in_features:
    raise validation.value_error(op, "x", f"have a last axis of sparse_w's in = {w.in_features}",
                                 f"shape {x.shape}")
  out = w.values.shape[0]
  dtypes = [x.dtype, w.values.dtype]
  if bias is not None:
    bias = validation.float_array(op, "bias", bias)
    validation.shape(op, "bias", bias, (out,), of="[out]")
    dtypes.append(bias.dtype)
  common = jnp.result_type(*dtypes)
  x, values = x.astype(common), w.values.astype(common)
  bias = None if bias is None else bias.astype(common)
  allow_tf32 = matmul_precision.allow_tf32(op, precision)
  if not primitive.use_kernel(op, implementation, {"x": common}):
    return reference.sparse_linear(x, values, w.metadata, bias)
  bias_operand = absent(common) if bias is None else bias
  return sparse_linear_fwd_p(x, values, w.metadata, bias_operand, allow_tf32=allow_tf32)[0]
