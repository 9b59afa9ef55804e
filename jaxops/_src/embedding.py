"""embedding: primitives and public function.

The forward gathers rows (ids clamped to the table); the backward is a
deterministic, race-free scatter-add (cpu/embedding.h) that writes the
gradient of the whole table once. ids are int32 of any shape.

The lookup is linear in the table: the forward primitive is its own tangent
primitive (forward mode gathers the tangent's rows) and the scatter-add is its
transpose; the scatter-add, linear in its cotangent, transposes back to the
gather, so every order of derivative stays on the two kernels.

Batching: a vmapped table [V, vocab, dim] becomes one table [V * vocab, dim]
with each example's ids offset into its own slice, so the kernels still run
once; the backward's per-example gradients come out as [V, vocab, dim] the
same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front
from jaxops._src.sharding import Factors


def _offset_ids(ids, size, vocab):
  """ids [size, ...] clamped to [0, vocab) and moved to example i's slice of a
  table of size * vocab rows."""
  offsets = (jnp.arange(size, dtype=jnp.int32) * vocab).reshape((size,) + (1,) * (ids.ndim - 1))
  return jnp.clip(ids, 0, vocab - 1) + offsets


def _embedding_fwd_batch_rule(prim, args, dims):
  table, ids = args
  table_dim, ids_dim = dims
  if table_dim is NOT_MAPPED:
    # Looking up more ids: the vmapped axis of ids becomes that axis of the output.
    return prim(table, ids), (ids_dim,)
  (table, ids), size = batch_to_front(args, dims, (0, 1))
  vocab, dim = table.shape[1:]
  out = prim(table.reshape(size * vocab, dim), _offset_ids(ids, size, vocab))[0]
  return (out,), (0,)


def _embedding_bwd_batch_rule(prim, args, dims, *, vocab):
  (dout, ids), size = batch_to_front(args, dims, (0, 1))
  dtable = prim(dout, _offset_ids(ids, size, vocab), vocab=size * vocab)[0]
  return (dtable.reshape(size, vocab, dtable.shape[-1]),), (0,)


def _ids_axes(ids):
  return tuple(f"ids{i}" for i in range(ids.ndim))


def _fwd_sharding(avals_in, avals_out):
  """The ids shard (each shard looks up its own tokens) and so does the
  embedding axis (a column-sharded table looks up its own columns); the
  vocabulary stays whole."""
  table, ids = avals_in
  return Factors([(None, "dim"), _ids_axes(ids)], [(*_ids_axes(ids), "dim")])


def _bwd_sharding(avals_in, avals_out, *, vocab):
  """As the forward; each shard scatters its tokens' gradients into a whole
  table gradient, and the shards' tables are summed."""
  dout, ids = avals_in
  return Factors([(*_ids_axes(ids), "dim"), _ids_axes(ids)], [(None, "dim")])


embedding_fwd_p = FfiPrimitive(
    name="jaxops_embedding_fwd", target="jaxops_embedding_fwd",
    abstract_eval=lambda table, ids: (
        jax.core.ShapedArray(ids.shape + table.shape[1:], table.dtype),),
    reference=lambda table, ids: (reference.embedding(table, ids),),
    batch_rule=_embedding_fwd_batch_rule,
    sharding=_fwd_sharding)

embedding_bwd_p = FfiPrimitive(
    name="jaxops_embedding_bwd", target="jaxops_embedding_bwd",
    abstract_eval=lambda dout, ids, *, vocab: (
        jax.core.ShapedArray((vocab, dout.shape[-1]), dout.dtype),),
    reference=lambda dout, ids, *, vocab: (reference.embedding_grad(dout, ids, vocab),),
    batch_rule=_embedding_bwd_batch_rule,
    sharding=_bwd_sharding)


def _gather_transpose(cotangents, saved, wanted):
  (dout,), (ids,) = cotangents, saved
  return embedding_bwd_p(dout, ids, vocab=wanted[0].shape[0])


def _scatter_transpose(cotangents, saved, wanted, *, vocab):
  (dtable,), (ids,) = cotangents, saved
  return embedding_fwd_p(dtable, ids)


Differentiable(forward=embedding_fwd_p, transpose=_gather_transpose, tangent_inputs=(0,),
               checkpoint_name="jaxops.embedding")
Differentiable(forward=embedding_bwd_p, transpose=_scatter_transpose, tangent_inputs=(0,),
               checkpoint_name="jaxops.embedding")


def embedding(table, ids, *, implementation=None):
  """Embedding lookup: the rows ``table[ids]``, shape ``ids.shape + (dim,)``.

  The values of ``flax.linen.Embed`` (its ``embedding`` is ``table``) for ids
  in ``[0, vocab)``. Out-of-range ids differ: Flax returns NaN rows (and wraps
  ids in ``[-vocab, 0)``); here every id is clamped to ``[0, vocab - 1]``, as
  ``jnp.take(table, ids, axis=0, mode="clip")`` does: no lookup reads outside
  the table, and the gradient of a clamped id goes to the row it read.

  The gradient w.r.t. ``table`` is a deterministic scatter-add, accumulated in
  float32 even for a bfloat16/float16 table; ids get no gradient.

  Args:
    table: [vocab, dim], vocab >= 1: float32, bfloat16 or float16 (the
      kernel), or float64 or complex (the jnp reference).
    ids: integer array of any shape (values beyond int32 are clamped first).
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  Returns:
    ``table[clip(ids)]``: shape ``ids.shape + (dim,)``, ``table``'s dtype.

  Raises:
    TypeError: ``table`` is not a floating-point array or ``ids`` not an
      integer array.
    ValueError: ``table`` is not ``[vocab, dim]`` with ``vocab >= 1``.

  Examples:
    >>> table = jnp.arange(6.0).reshape(3, 2)
    >>> jaxops.embedding(table, jnp.array([2, 0, 7]))   # 7 is clamped to 2
    Array([[4., 5.],
           [0., 1.],
           [4., 5.]], dtype=float32)
  """
  op = "jaxops.embedding"
  table = validation.float_array(op, "table", table, complex=True)
  validation.rank(op, "table", table, low=2, high=2, labels="[vocab, dim]")
  validation.non_empty_axis(op, "table", table, 0)
  ids = validation.integer_array(op, "ids", ids)
  vocab = table.shape[0]
  if ids.dtype != jnp.int32:
    ids = jnp.clip(ids, 0, vocab - 1).astype(jnp.int32)
  if not primitive.use_kernel(op, implementation, {"table": table.dtype}):
    return reference.embedding(table, ids)
  return embedding_fwd_p(table, ids)[0]
