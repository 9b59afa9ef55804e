"""paged_attention and paged_kv_update: attention over a paged KV cache (issue 14).

The cache of every sequence lives in fixed-size pages [P, page_size, K, H]
shared by all sequences; block_tables [B, M] says which page holds tokens
[i * page_size, (i + 1) * page_size) of sequence b. Layouts, masking and the
clamping of traced data (lengths, page ids) are written once, in
params/paged_attention.h, which the CPU and CUDA kernels and the jnp
reference (jaxops.reference.paged_attention) all follow.

Primitives:

* ``paged_attention_fwd_p``: (query [B, T, N, H], key_pages, value_pages | [0],
  block_tables, kv_lens, query_lens | [0], key_scales | [0], value_scales | [0])
  -> (out [B, T, N, Hv], logsumexp [B, N, T] float32); static ``scale``,
  ``logits_soft_cap`` (0: none), ``window_left`` (-1: none) and
  ``value_head_dim`` (Hv: value_pages' last dim, or, with value_pages [0],
  how many of each key row's first features are its value: absorbed MLA). Its lowering
  adds the target's hidden workspace, the CUDA kernel's split-K partials
  (sized from the shapes in xla_ffi/paged_attention_common.h; [0] on the CPU).
* ``paged_kv_update_p``: (key_pages, value_pages, key [n, K, H], value,
  slot_mapping [n], key_scales | [0], value_scales | [0]) -> (key_pages,
  value_pages, key_scales, value_scales), the pages and scales written in place
  (input/output aliasing: with donated pages under jit, no copy of the cache);
  value_pages and value [0]: a cache whose values are its keys', keys only.

paged_attention is an inference op: it has no derivative rules, and
differentiating through it is an error (a KV cache is state read by a decode
step, not a parameter; train with jaxops.attention).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from jaxops import reference
from jaxops._src import ffi_targets, matmul_precision, primitive, validation
from jaxops._src.attention import check_sinks, merge_sinks
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, is_absent
from jaxops._src.sharding import Factors

_F32 = jnp.float32
_I32 = jnp.int32
_INT8 = jnp.dtype(jnp.int8)
# The CUDA kernels hold a tile's key and value rows in shared memory.
_CUDA_MAX_HEAD_DIM = ffi_targets.limit("cuda_paged_attention_max_head_dim")
_CUDA_MAX_VALUE_HEAD_DIM = ffi_targets.limit("cuda_paged_attention_max_value_head_dim")


def _optional(x):
  return None if is_absent(x) else x


# -- primitives -----------------------------------------------------------------------


def _fwd_abstract_eval(query, key_pages, value_pages, block_tables, kv_lens, query_lens,
                       key_scales, value_scales, *, value_head_dim, **params):
  B, T, N, _ = query.shape
  return (jax.core.ShapedArray((B, T, N, value_head_dim), query.dtype),
          jax.core.ShapedArray((B, N, T), _F32))


def _fwd_reference(query, key_pages, value_pages, block_tables, kv_lens, query_lens, key_scales,
                   value_scales, *, scale, logits_soft_cap, window_left, value_head_dim,
                   allow_tf32):
  del allow_tf32  # the kernels and the reference are full float32 at every precision
  return reference.paged_attention_with_logsumexp(
      query, key_pages, _optional(value_pages), block_tables, kv_lens, _optional(query_lens),
      scale=scale, logits_soft_cap=logits_soft_cap or None,
      local_window_size=None if window_left < 0 else window_left,
      key_scales=_optional(key_scales), value_scales=_optional(value_scales),
      value_head_dim=value_head_dim)


def _update_abstract_eval(key_pages, value_pages, key, value, slot_mapping, key_scales,
                          value_scales):
  return tuple(jax.core.ShapedArray(a.shape, a.dtype)
               for a in (key_pages, value_pages, key_scales, value_scales))


def _update_reference(key_pages, value_pages, key, value, slot_mapping, key_scales,
                      value_scales):
  out = reference.paged_kv_update(key_pages, _optional(value_pages), key, _optional(value),
                                  slot_mapping, _optional(key_scales), _optional(value_scales))
  if len(out) == 2:
    out = (*out, key_scales, value_scales)
  # (No value pages: their results stay the [0] placeholders.)
  return tuple(given if o is None else o
               for o, given in zip(out, (key_pages, value_pages, key_scales, value_scales)))


# -- batching: a vmapped axis folds into the batch (and page) axes ---------------------


def _to_front(x, d, size):
  """x with the vmapped axis first (broadcast when unbatched); absent stays absent."""
  if is_absent(x):
    return x
  if d is NOT_MAPPED:
    return jnp.broadcast_to(x[None], (size, *x.shape))
  return jnp.moveaxis(x, d, 0)


def _fold_pages(pages, size):
  """[size, P, ...] -> [size * P, ...]: each example's pages after the last."""
  return pages if is_absent(pages) else pages.reshape(size * pages.shape[1], *pages.shape[2:])


def _fwd_batch_rule(prim, args, dims, **params):
  """The vmapped axis folds into B; when the cache itself is vmapped (each
  example its own pages) the pages fold into P too and every example's page
  ids are clamped, then offset into its own slice, so the kernel runs once."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
  query, key_pages, value_pages, tables, kv_lens, query_lens, key_scales, value_scales = (
      _to_front(a, d, size) if i in (0, 3, 4, 5) else a
      for i, (a, d) in enumerate(zip(args, dims)))
  B = query.shape[1]
  if any(dims[i] is not NOT_MAPPED for i in (1, 2, 6, 7)):
    key_pages, value_pages, key_scales, value_scales = (
        _fold_pages(_to_front(args[i], dims[i], size), size) for i in (1, 2, 6, 7))
    P = key_pages.shape[0] // size
    offsets = (jnp.arange(size, dtype=_I32) * P)[:, None, None]
    tables = jnp.clip(tables, 0, P - 1) + offsets
  flat = lambda x: x if is_absent(x) else x.reshape(size * B, *x.shape[2:])
  out, lse = prim(flat(query), key_pages, value_pages, flat(tables), flat(kv_lens),
                  flat(query_lens), key_scales, value_scales, **params)
  return (out.reshape(size, B, *out.shape[1:]), lse.reshape(size, B, *lse.shape[1:])), (0, 0)


def _update_batch_rule(prim, args, dims):
  """Every example writes its own copy of the cache: the copies fold into one
  cache of size * P pages, each example's valid slots offset into its slice
  (invalid ones stay invalid), and the kernel runs once."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
  key_pages, value_pages, key, value, slots, key_scales, value_scales = (
      _to_front(a, d, size) for a, d in zip(args, dims))
  P, page_size = key_pages.shape[1:3]
  n = key.shape[1]
  total = P * page_size
  valid = (slots >= 0) & (slots < total)
  slots = jnp.where(valid, slots + (jnp.arange(size, dtype=_I32) * total)[:, None], -1)
  rows = lambda x: x if is_absent(x) else x.reshape(size * n, *x.shape[2:])
  outs = prim(_fold_pages(key_pages, size), _fold_pages(value_pages, size), rows(key), rows(value),
              slots.reshape(size * n), _fold_pages(key_scales, size),
              _fold_pages(value_scales, size))
  outs = [o if is_absent(o) else o.reshape(size, P, *o.shape[1:]) for o in outs]
  return outs, tuple(NOT_MAPPED if is_absent(o) else 0 for o in outs)


# -- sharding: batch and heads shard, pages shard with their kv heads ---------------------


def _heads(num_heads, num_kv_heads):
  """(query heads' factor, kv heads' factor, sizes): GQA's query heads are
  (kv_heads, group), so a shard holds whole groups with their kv heads; MQA's
  one kv head stays whole."""
  if num_heads == num_kv_heads:
    return "heads", "heads", {}
  if num_kv_heads == 1:
    return "heads", None, {}
  return ("kv_heads", "group"), "kv_heads", {"group": num_heads // num_kv_heads}


def _fwd_sharding(avals_in, avals_out, **params):
  query, key_pages = avals_in[0], avals_in[1]
  heads, kv_heads, sizes = _heads(query.shape[2], key_pages.shape[2])
  pages = (None, None, kv_heads, None)
  scales = lambda a: (None,) if is_absent(a) else (None, None, kv_heads)
  per_sequence = lambda a: (None,) if is_absent(a) else ("batch",)
  value_pages = (None,) if is_absent(avals_in[2]) else pages
  operands = [("batch", None, heads, None), pages, value_pages, ("batch", None),
              per_sequence(avals_in[4]), per_sequence(avals_in[5]), scales(avals_in[6]),
              scales(avals_in[7])]
  return Factors(operands, [("batch", None, heads, None), ("batch", heads, None)], sizes)


def _update_sharding(avals_in, avals_out):
  """The kv heads shard (each shard writes its heads of every token); tokens
  and pages stay whole, since any token may write any page."""
  kv_heads = "kv_heads"
  pages = (None, None, kv_heads, None)
  rows = (None, kv_heads, None)
  scales = lambda a: (None,) if is_absent(a) else (None, None, kv_heads)
  value_pages = (None,) if is_absent(avals_in[1]) else pages
  value_rows = (None,) if is_absent(avals_in[3]) else rows
  return Factors([pages, value_pages, rows, value_rows, (None,), scales(avals_in[5]),
                  scales(avals_in[6])],
                 [pages, value_pages, scales(avals_out[2]), scales(avals_out[3])])


paged_attention_fwd_p = FfiPrimitive(
    name="jaxops_paged_attention_fwd", target="jaxops_paged_attention_fwd",
    abstract_eval=_fwd_abstract_eval, reference=_fwd_reference,
    batch_rule=_fwd_batch_rule, sharding=_fwd_sharding)

# Results 0..3 are written in place over operands 0, 1, 5, 6
# (kPagedKvUpdateAliases in xla_ffi/paged_attention_common.h).
paged_kv_update_p = FfiPrimitive(
    name="jaxops_paged_kv_update", target="jaxops_paged_kv_update",
    abstract_eval=_update_abstract_eval, reference=_update_reference,
    batch_rule=_update_batch_rule, input_output_aliases={0: 0, 1: 1, 5: 2, 6: 3},
    sharding=_update_sharding)


def _no_derivative(primals, tangents, **params):
  if all(type(t) is ad.Zero for t in tangents):
    outs = paged_attention_fwd_p.primitive.bind(*primals, **params)
    return outs, [ad.Zero.from_primal_value(o) for o in outs]
  raise TypeError(
      "jaxops.paged_attention is an inference op and has no derivative: the paged KV cache "
      "is state read by a decode step, not a parameter. Differentiate jaxops.attention "
      "instead (training), or wrap the cache in jax.lax.stop_gradient.")


ad.primitive_jvps[paged_attention_fwd_p.primitive] = _no_derivative


# -- public functions ---------------------------------------------------------------


def _int32_vector(op, name, value, batch):
  value = validation.integer_array(op, name, value)
  validation.shape(op, name, value, (batch,), of="(batch,)")
  return _as_int32(value)


def _as_int32(value):
  # Values beyond int32 are clamped first; the kernels clamp the rest.
  if value.dtype == _I32:
    return value
  info = jnp.iinfo(_I32)
  return jnp.clip(value, info.min, info.max).astype(_I32)


def _pages(op, key_pages, value_pages, key_scales, value_scales):
  """The pages (float or int8) and their scales (int8 pages only), checked.
  value_pages None: a cache whose values are its keys' (no value scales)."""
  key_pages = validation.array(op, "key_pages", key_pages)
  if key_pages.dtype != _INT8 and not jnp.issubdtype(key_pages.dtype, jnp.floating):
    raise validation.type_error(op, "key_pages", "have a floating dtype or int8",
                                str(key_pages.dtype))
  validation.rank(op, "key_pages", key_pages, low=4, high=4,
                  labels="[num_pages, page_size, num_kv_heads, head_dim]")
  for axis in range(3):
    validation.non_empty_axis(op, "key_pages", key_pages, axis)
  in_keys = value_pages is None
  if not in_keys:
    value_pages = validation.array(op, "value_pages", value_pages)
    validation.rank(op, "value_pages", value_pages, low=4, high=4,
                    labels="[num_pages, page_size, num_kv_heads, value_head_dim]")
    if value_pages.shape[:3] != key_pages.shape[:3]:
      raise validation.value_error(
          op, "value_pages", f"have key_pages' first three dims {key_pages.shape[:3]}",
          f"shape {value_pages.shape}")
    if value_pages.dtype != key_pages.dtype:
      raise validation.type_error(op, "value_pages", f"have key_pages' dtype ({key_pages.dtype})",
                                  str(value_pages.dtype))
  if in_keys and value_scales is not None:
    raise validation.type_error(
        op, "value_scales", "be None without value_pages (the key scales serve the values)",
        validation.describe(value_scales))
  if key_pages.dtype == _INT8:
    if key_scales is None or (value_scales is None and not in_keys):
      raise validation.type_error(op, "key_scales", "be given (with value_scales) for int8 pages",
                                  "None")
    scales = []
    for name, s in (("key_scales", key_scales), ("value_scales", value_scales)):
      if s is None:  # no value pages
        scales.append(None)
        continue
      s = validation.array(op, name, s, dtypes=(_F32,))
      validation.shape(op, name, s, key_pages.shape[:3], of="key_pages.shape[:3]")
      scales.append(s)
    return key_pages, value_pages, *scales
  for name, s in (("key_scales", key_scales), ("value_scales", value_scales)):
    if s is not None:
      raise validation.type_error(op, name, "be None for float pages (scales are for int8 pages)",
                                  validation.describe(s))
  return key_pages, value_pages, None, None


def _use_kernel(op, implementation, dtypes, head_dim, value_head_dim):
  """primitive.use_kernel, within the CUDA kernels' head dims (beyond them None
  runs the reference and "ffi" raises)."""
  if not primitive.use_kernel(op, implementation, dtypes):
    return False
  if primitive.current_platform() == "cuda" and (head_dim > _CUDA_MAX_HEAD_DIM or
                                                 value_head_dim > _CUDA_MAX_VALUE_HEAD_DIM):
    if implementation == "ffi":
      raise ValueError(
          f"{op}: implementation='ffi': the CUDA kernels support head_dim <= "
          f"{_CUDA_MAX_HEAD_DIM} and value_head_dim <= {_CUDA_MAX_VALUE_HEAD_DIM}, got "
          f"{head_dim} and {value_head_dim}")
    return False
  return True


def paged_attention(query, key_pages, value_pages, block_tables, kv_lens, *, query_lens=None,
                    scale=None, logits_soft_cap=None, local_window_size=None,
                    return_residual=False, key_scales=None, value_scales=None,
                    sinks=None, value_head_dim=None, precision=None, implementation=None):
  """Attention of new queries over a paged KV cache (decode and chunked prefill).

  Sequence b's cached tokens are ``kv_lens[b]``; token i lives in page
  ``block_tables[b, i // page_size]`` at offset ``i % page_size``. The queries
  are the last tokens of each sequence (their keys already written, e.g. by
  :func:`paged_kv_update`): query row t of sequence b sits at position
  ``kv_lens[b] - query_lens[b] + t`` and attends the cached keys up to and
  including that position (causal against the cache), and with
  ``local_window_size=w`` only the last ``w + 1`` of them (keys ``j >=
  position - w``). Per head, ``softmax(scale * q.k)`` over those keys, with
  ``logits_soft_cap * tanh(logits / logits_soft_cap)`` applied first when given,
  and with ``sinks`` one extra logit ``sinks[n]`` of value zero in each row's
  softmax (as ``jaxops.attention``'s).
  GQA/MQA: query head n reads kv head ``n // (num_heads // num_kv_heads)``.

  MLA: the value pages may have a head dim ``Hv`` of their own (the output is
  ``[..., num_heads, Hv]``), and with ``value_pages=None`` the cache is one
  tensor whose key rows hold the values in their first ``value_head_dim``
  features (absorbed MLA decode, DeepSeek-V3: ``head_dim`` 576 = a 512-wide
  latent, which is the value, and its 64-wide rope part): each row is read once
  for both products, and no second copy of the cache exists.

  Traced data is clamped, never trusted (so no kernel reads outside the
  cache): ``kv_lens[b]`` to ``[0, max_pages_per_seq * page_size]``,
  ``query_lens[b]`` to ``[0, min(T, kv_lens[b])]``, page ids to ``[0,
  num_pages - 1]``. Query rows ``t >= query_lens[b]`` (padding), and rows that
  attend no key, give 0 and a log-sum-exp of -inf.

  Forward only: differentiating through it raises a TypeError (an inference
  op). vmap folds the vmapped axis into the batch (a vmapped cache into the
  pages); on a mesh the batch and heads shard.

  Args:
    query: [batch, num_heads, head_dim] (decode: one token per sequence) or
      [batch, T, num_heads, head_dim] (chunked prefill): float32, bfloat16 or
      float16, the dtype of float pages.
    key_pages: [num_pages, page_size, num_kv_heads, head_dim]: float (the
      query's dtype) or int8 with ``key_scales``/``value_scales``.
    value_pages: [num_pages, page_size, num_kv_heads, Hv] of key_pages'
      dtype, or None: the values are each key row's first ``value_head_dim``
      features (int8: scaled by ``key_scales``).
    block_tables: integer [batch, max_pages_per_seq].
    kv_lens: integer [batch], the cached tokens of each sequence, the queries'
      own included.
    query_lens: integer [batch], the query rows of each sequence (with a rank-4
      query; default T for every sequence).
    scale: the logits' scale (default ``1 / sqrt(head_dim)``; 1 for a head_dim
      of 0, whose logits are all 0).
    logits_soft_cap: optional cap > 0.
    local_window_size: optional int >= 0, the left window.
    return_residual: also return the log-sum-exp [batch, num_heads] (decode)
      or [batch, num_heads, T], float32.
    key_scales, value_scales: float32 [num_pages, page_size, num_kv_heads], the
      scale of each int8 row (the real value is ``pages * scales``).
    sinks: optional float [num_heads] (float32 or the query's dtype): per-head
      sink logits (gpt-oss), merged into the kernel's results by log-sum-exp;
      the log-sum-exp includes them.
    value_head_dim: with ``value_pages=None``, an int in ``[0, head_dim]``
      (required); with value pages, None or their last dim.
    precision: as ``lax.dot``'s (None follows ``jax.default_matmul_precision``):
      the kernels carry it (``allow_tf32``) but compute in full float32 at every
      setting, on the CPU and on CUDA: decoding is bandwidth-bound
      (docs/precision.md).
    implementation: ``None`` (the kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).
  """
  op = "jaxops.paged_attention"
  query = validation.float_array(op, "query", query)
  validation.rank(op, "query", query, low=3, high=4,
                  labels="[batch, num_heads, head_dim] or [batch, T, num_heads, head_dim]")
  key_pages, value_pages, key_scales, value_scales = _pages(op, key_pages, value_pages,
                                                            key_scales, value_scales)
  if key_pages.dtype != _INT8 and key_pages.dtype != query.dtype:
    raise validation.type_error(op, "key_pages", f"have the query's dtype ({query.dtype})",
                                str(key_pages.dtype))
  decode = query.ndim == 3
  if decode:
    query = query[:, None]
  B, T, N, H = query.shape
  P, page_size, K, page_h = key_pages.shape
  if page_h != H:
    raise validation.value_error(op, "key_pages", f"have the query's head_dim {H}",
                                 f"shape {key_pages.shape}")
  if value_pages is None:
    if value_head_dim is None:
      raise validation.type_error(
          op, "value_head_dim", "be given without value_pages (how many of each key row's "
          "first features are its value)", "None")
    Hv = validation.non_negative_int(op, "value_head_dim", value_head_dim)
    if Hv > H:
      raise validation.value_error(op, "value_head_dim",
                                   f"be at most head_dim={H} without value_pages", str(Hv))
  else:
    Hv = value_pages.shape[3]
    if value_head_dim is not None and value_head_dim != Hv:
      raise validation.value_error(op, "value_head_dim",
                                   f"be None or value_pages' last dim {Hv}", str(value_head_dim))
  if N % K:
    raise validation.value_error(op, "query", f"have a multiple of num_kv_heads={K} heads",
                                 f"{N} heads")
  block_tables = validation.integer_array(op, "block_tables", block_tables)
  validation.rank(op, "block_tables", block_tables, low=2, high=2,
                  labels="[batch, max_pages_per_seq]")
  validation.shape(op, "block_tables", block_tables, (B, block_tables.shape[1]), of="batch")
  validation.non_empty_axis(op, "block_tables", block_tables, 1)
  if block_tables.shape[1] * page_size >= 2**31:
    raise validation.value_error(op, "block_tables", "address fewer than 2^31 tokens",
                                 f"{block_tables.shape[1]} pages of {page_size}")
  block_tables = _as_int32(block_tables)
  kv_lens = _int32_vector(op, "kv_lens", kv_lens, B)
  if query_lens is not None:
    if decode:
      raise validation.value_error(op, "query_lens", "be None for a rank-3 (decode) query",
                                   "an array")
    query_lens = _int32_vector(op, "query_lens", query_lens, B)
  if scale is None:
    # An empty head vector's logits are 0 at any scale: 1 stands in for 1 / sqrt(0).
    scale = 1.0 / math.sqrt(H) if H > 0 else 1.0
  else:
    scale = validation.static_float(op, "scale", scale)
  if logits_soft_cap is not None:
    logits_soft_cap = validation.static_float(op, "logits_soft_cap", logits_soft_cap, low=0,
                                              low_open=True)
  if local_window_size is not None:
    local_window_size = validation.non_negative_int(op, "local_window_size", local_window_size)
  return_residual = validation.static_bool(op, "return_residual", return_residual)
  sinks = check_sinks(op, sinks, N, query.dtype)
  allow_tf32 = matmul_precision.allow_tf32(op, precision)
  dtypes = {"query": query.dtype}
  if key_pages.dtype != _INT8:
    dtypes["key_pages"] = key_pages.dtype
  if _use_kernel(op, implementation, dtypes, H, Hv):
    out, lse = paged_attention_fwd_p(
        query, key_pages, absent(key_pages.dtype) if value_pages is None else value_pages,
        block_tables, kv_lens,
        absent(_I32) if query_lens is None else query_lens,
        absent(_F32) if key_scales is None else key_scales,
        absent(_F32) if value_scales is None else value_scales,
        scale=scale, logits_soft_cap=logits_soft_cap or 0.0,
        window_left=-1 if local_window_size is None else local_window_size,
        value_head_dim=Hv, allow_tf32=allow_tf32)
    if sinks is not None:
      out, lse = merge_sinks(out, lse, sinks)
  else:
    out, lse = reference.paged_attention_with_logsumexp(
        query, key_pages, value_pages, block_tables, kv_lens, query_lens, scale=scale,
        logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
        key_scales=key_scales, value_scales=value_scales, sinks=sinks, value_head_dim=Hv)
  if decode:
    out, lse = out[:, 0], lse[..., 0]
  return (out, lse) if return_residual else out


def paged_kv_update(key_pages, value_pages, key, value, slot_mapping, *, key_scales=None,
                    value_scales=None, implementation=None):
  """Writes new tokens' key/value rows into the paged cache.

  Token i's rows ``key[i]`` ([num_tokens, num_kv_heads, head_dim]) and
  ``value[i]`` ([num_tokens, num_kv_heads, Hv]) go to slot ``slot_mapping[i] = page * page_size + offset``. A slot
  outside ``[0, num_pages * page_size)`` (padding, e.g. -1) is skipped; a slot
  named by several tokens keeps the last one's rows. Returns the updated
  ``(key_pages, value_pages)``, or for int8 pages ``(key_pages, value_pages,
  key_scales, value_scales)``: each written row is quantized symmetrically per
  token and head (scale = max|x| / 127, q = round(x / scale) in [-127, 127]).
  A cache whose values are in its keys (absorbed MLA, ``paged_attention``
  with ``value_pages=None``) passes ``value_pages=None`` and ``value=None``:
  the keys alone are written, and None stands in the value pages' (and value
  scales') places of the result.

  The pages are written in place (input/output aliasing): under ``jax.jit``
  with the pages (and scales) donated, the cache is not copied; otherwise XLA
  copies the operand first and the inputs are unchanged.

  Args:
    key_pages: [num_pages, page_size, num_kv_heads, head_dim], float or int8
      (then with key_scales/value_scales).
    value_pages: [num_pages, page_size, num_kv_heads, Hv] of key_pages'
      dtype, or None (no value pages: the values are in the keys).
    key: [num_tokens, num_kv_heads, head_dim]: the pages' dtype for float
      pages, float32/bfloat16/float16 for int8 pages.
    value: [num_tokens, num_kv_heads, Hv] of key's dtype, or None with
      ``value_pages=None``.
    slot_mapping: integer [num_tokens].
    key_scales, value_scales: float32 [num_pages, page_size, num_kv_heads].
    implementation: as for :func:`paged_attention`.
  """
  op = "jaxops.paged_kv_update"
  key_pages, value_pages, key_scales, value_scales = _pages(op, key_pages, value_pages,
                                                            key_scales, value_scales)
  P, page_size, K, H = key_pages.shape
  key = validation.float_array(op, "key", key)
  validation.rank(op, "key", key, low=3, high=3, labels="[num_tokens, num_kv_heads, head_dim]")
  validation.shape(op, "key", key, (key.shape[0], K, H), of="(num_tokens, num_kv_heads, head_dim)")
  if value_pages is None:
    if value is not None:
      raise validation.type_error(op, "value", "be None without value_pages",
                                  validation.describe(value))
  else:
    value = validation.array(op, "value", value)
    Hv = value_pages.shape[3]
    validation.shape(op, "value", value, (key.shape[0], K, Hv),
                     of="(num_tokens, num_kv_heads, value_pages' head dim)")
    if value.dtype != key.dtype:
      raise validation.type_error(op, "value", f"have key's dtype ({key.dtype})",
                                  str(value.dtype))
  if key_pages.dtype != _INT8 and key.dtype != key_pages.dtype:
    raise validation.type_error(op, "key", f"have the dtype of key_pages ({key_pages.dtype})",
                                str(key.dtype))
  if P * page_size >= 2**31:
    raise validation.value_error(op, "key_pages", "have fewer than 2^31 slots",
                                 f"shape {key_pages.shape}")
  slot_mapping = _int32_vector(op, "slot_mapping", slot_mapping, key.shape[0])
  int8 = key_pages.dtype == _INT8
  dtypes = {"key": key.dtype} if int8 else {"key_pages": key_pages.dtype}
  if not primitive.use_kernel(op, implementation, dtypes):
    return reference.paged_kv_update(key_pages, value_pages, key, value, slot_mapping,
                                     key_scales, value_scales)
  in_keys = value_pages is None
  outs = paged_kv_update_p(key_pages, absent(key_pages.dtype) if in_keys else value_pages, key,
                           absent(key.dtype) if in_keys else value, slot_mapping,
                           absent(_F32) if key_scales is None else key_scales,
                           absent(_F32) if value_scales is None else value_scales)
  if in_keys:
    outs = (outs[0], None, outs[2], None)
  return outs if int8 else outs[:2]
