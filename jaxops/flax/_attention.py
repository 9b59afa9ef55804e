"""Attention shared by the linen and nnx wrappers: the ``attention_fn`` of each
flavour (Flax's signature, Flax's own function where the attention weights
must exist), the kernel over any number of batch axes, RoPE, the kv_cache step,
and what Flax's functions need to run jaxops' extras (grouped-query heads,
``is_causal`` at an offset).

``precision`` means what it means in Flax, where a module hands it to every
dot it computes (projections and both attention products): given, it sets the
float32 precision of the fused kernel's products as of the projections
(``jaxops.attention``'s ``precision``: TF32 tensor cores on a GPU at the
default and "high" precisions, full float32 at "highest"); None follows
``jax.default_matmul_precision``, as Flax's dots do (docs/precision.md)."""

from __future__ import annotations

import functools
import math
import warnings

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

import jaxops
from jaxops._src import validation
from jaxops.flax import _arguments
from jaxops.flax._dtypes import is_kernel_dtype
from jaxops.flax._serving_caches import SERVING_CACHES


# jaxops.attention's arguments for current models that Flax's attention
# functions do not have: the wrappers pass them through to the kernel.
FEATURES = ("logits_soft_cap", "query_segment_ids", "key_value_segment_ids", "sinks")


def attend(query, key, value, bias=None, mask=None, *, is_causal=False, query_offset=0,
           precision=None, implementation=None, logits_soft_cap=None, query_segment_ids=None,
           key_value_segment_ids=None, sinks=None, context_parallel=None):
  """``jaxops.attention`` over any number of batch axes.

  query [batch..., T, N, H], key/value [batch..., S, K, H or Hv]; bias and mask
  broadcastable to [batch..., N, T, S]; segment ids [batch..., T] and
  [batch..., S]. As in Flax, a mask of any dtype attends where it is nonzero.

  ``context_parallel`` (``jaxops.ring_attention``'s ``axis_name``, ``layout``
  and ``strategy``, as a dict): inside ``jax.shard_map``, the inputs are this
  device's blocks of a sequence split over that mesh axis, and
  ``jaxops.ring_attention`` runs instead (T, S local; bias and mask [...,
  T, S_global], as it takes them).
  """
  mask = None if mask is None else jnp.asarray(mask).astype(bool)
  batch_shape = query.shape[:-3]
  n = len(batch_shape)

  def flat(x):
    return x.reshape((math.prod(batch_shape),) + x.shape[n:])

  def flat_broadcastable(x):
    if x is None:
      return None
    x = x.reshape((1,) * (n + 3 - x.ndim) + x.shape)
    if all(d == 1 for d in x.shape[:n]):
      return x.reshape((1,) + x.shape[n:])
    return flat(jnp.broadcast_to(x, batch_shape + x.shape[n:]))

  def flat_ids(ids):
    if ids is None:
      return None
    ids = jnp.asarray(ids)
    return jnp.broadcast_to(ids, batch_shape + ids.shape[-1:]).reshape(-1, ids.shape[-1])

  function = jaxops.attention
  if context_parallel is not None:
    function = functools.partial(jaxops.ring_attention, **context_parallel)
  out = function(flat(query), flat(key), flat(value), flat_broadcastable(bias),
                 flat_broadcastable(mask), is_causal=is_causal, query_offset=query_offset,
                 precision=precision, implementation=implementation,
                 logits_soft_cap=logits_soft_cap, query_segment_ids=flat_ids(query_segment_ids),
                 key_value_segment_ids=flat_ids(key_value_segment_ids), sinks=sinks)
  return out.reshape(batch_shape + out.shape[1:])


def rotate(rope, query, key, query_offset, key_offset=0, context_parallel=None):
  """``rope(x, positions)`` (if given) on the query at positions
  query_offset + t and on the key at key_offset + j; with ``context_parallel``
  (inside ``jax.shard_map``), t and j are the global positions of this
  device's rows under the layout (``context_positions``)."""
  if rope is None:
    return query, key
  if context_parallel is not None:
    at = lambda x, offset: context_positions(x.shape[-3], context_parallel["axis_name"],
                                             context_parallel["layout"], offset)
    return rope(query, at(query, query_offset)), rope(key, at(key, key_offset))
  positions = lambda x, offset: jnp.arange(x.shape[-3]) + jnp.asarray(offset, jnp.int32)
  return rope(query, positions(query, query_offset)), rope(key, positions(key, key_offset))


def context_positions(length, axis_name, layout, offset=0):
  """The global positions of this device's ``length`` rows of a sequence split
  over ``axis_name`` (inside ``jax.shard_map``), plus ``offset``:
  ``"contiguous"``: device d holds [d * length, (d+1) * length); ``"zigzag"``:
  chunks d and 2P-1-d of ``length / 2`` rows (``jaxops.zigzag_permute``)."""
  device = lax.axis_index(axis_name)
  offset = jnp.asarray(offset, jnp.int32)
  if layout == "contiguous":
    return offset + device * length + jnp.arange(length, dtype=jnp.int32)
  if length % 2:
    raise ValueError(f"context_parallel_layout='zigzag' needs an even local sequence length "
                     f"(two chunks per device), got {length}")
  half = length // 2
  size = lax.axis_size(axis_name)
  rows = jnp.arange(half, dtype=jnp.int32)
  return offset + jnp.concatenate([device * half + rows, (2 * size - 1 - device) * half + rows])


def context_parallel_arguments(context_parallel):
  """A module's context-parallel options as the attention functions' keywords."""
  if context_parallel is None:
    return {}
  return dict(context_parallel_axis=context_parallel["axis_name"],
              context_parallel_layout=context_parallel["layout"],
              context_parallel_strategy=context_parallel["strategy"])


def self_attention_inputs(inputs_q, inputs_k, inputs_v, inputs_kv=None):
  """Flax's defaults for the key and value inputs: ``inputs_k`` defaults to
  ``inputs_q`` and ``inputs_v`` to ``inputs_k``; linen's deprecated
  ``inputs_kv`` sets both."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError("If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be "
                       "None. If `inputs_kv` is not None, both `inputs_k` and `inputs_v` "
                       "must be None.")
    warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v "
                  "instead.", DeprecationWarning, stacklevel=3)
    return inputs_kv, inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None.")
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v


def attend_cached(query, key, value, kv_cache, *, query_offset, is_causal=False, rope=None,
                  precision=None, implementation=None, logits_soft_cap=None, sinks=None,
                  query_segment_ids=None, key_value_segment_ids=None):
  """Attention of T new query rows against a fixed-length key/value cache.

  query [B, T, N, H]; key/value [B, T, K, H] are the new rows' projections,
  written into ``kv_cache`` = (keys, values) [B, S_max, K, H] at rows
  ``query_offset`` .. ``query_offset + T - 1`` (``query_offset`` may be traced,
  so a decode loop compiles once). Cache rows past the written ones are masked
  through ``key_value_seq_lengths``; ``is_causal`` masks as for the full
  sequence. ``rope`` sees absolute positions for both query and new keys.
  Returns (output [B, T, N, H], updated cache). The soft cap and sinks apply
  as in ``jaxops.attention``; segment ids do not go with a cache (a cache
  holds one sequence per row).

  ``kv_cache`` may also be a serving cache (jaxops/flax/_serving_caches.py:
  paged, or one row per sequence), whose sequences each have their own
  position; ``query_offset`` is then unused.
  """
  if query_segment_ids is not None or key_value_segment_ids is not None:
    raise ValueError("attend_cached: segment ids do not go with kv_cache (one sequence per "
                     "cache row)")
  if isinstance(kv_cache, SERVING_CACHES):
    if logits_soft_cap is not None or sinks is not None:
      raise ValueError("attend_cached: logits_soft_cap and sinks do not go with a serving "
                       "cache yet")
    return kv_cache.attend(query, key, value, rope=rope, precision=precision,
                           implementation=implementation)
  validation.rank("attend_cached", "query", query, low=4, high=4, labels="[B, T, N, H]")
  offset = jnp.asarray(query_offset, jnp.int32)
  query, key = rotate(rope, query, key, offset, offset)
  cached_key, cached_value = kv_cache
  zero = jnp.zeros((), jnp.int32)
  start = (zero, offset, zero, zero)
  cached_key = lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), start)
  cached_value = lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), start)
  lengths = jnp.full((query.shape[0],), offset + query.shape[1], jnp.int32)
  out = jaxops.attention(query, cached_key.astype(query.dtype), cached_value.astype(query.dtype),
                         is_causal=is_causal, query_offset=offset,
                         key_value_seq_lengths=lengths, precision=precision,
                         implementation=implementation, logits_soft_cap=logits_soft_cap,
                         sinks=sinks)
  return out, (cached_key, cached_value)


def model_features(op, logits_soft_cap, sinks, query_segment_ids, key_value_segment_ids,
                   dtype):
  """A module's soft cap and sink parameter and its call's segment ids, as
  ``jaxops.attention`` keyword arguments (the key's ids default to the
  query's: self-attention over packed rows). The sinks go in the query's dtype
  when it is a kernel dtype, else float32."""
  if key_value_segment_ids is None:
    key_value_segment_ids = query_segment_ids
  elif query_segment_ids is None:
    raise ValueError(f"{op}: key_value_segment_ids needs query_segment_ids")
  if sinks is not None:
    sinks = jnp.asarray(sinks).astype(dtype if is_kernel_dtype(dtype) else jnp.float32)
  return dict(logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
              key_value_segment_ids=key_value_segment_ids, sinks=sinks)


def only_on_jaxops(op, features):
  """Another ``attention_fn`` than jaxops' cannot take these features."""
  given = [name for name, value in features.items() if value is not None]
  if given:
    raise ValueError(f"{op}: {', '.join(given)} need jaxops' attention_fn (the default)")


def fold_features(op, mask, features):
  """For Flax's own attention functions (the weights must exist): segment ids
  become part of ``mask``; a soft cap or sinks, which Flax's functions cannot
  compute, are an error naming them."""
  for name in ("logits_soft_cap", "sinks"):
    if features.get(name) is not None:
      raise ValueError(f"{op}: {name} runs on jaxops.attention only, not on Flax's "
                       "dot_product_attention (taken for sow_weights, dropout on the "
                       "weights, custom einsums or float64/complex inputs)")
  q_ids, kv_ids = features.get("query_segment_ids"), features.get("key_value_segment_ids")
  if q_ids is None and kv_ids is None:
    return mask
  if q_ids is None or kv_ids is None:
    raise ValueError(f"{op}: give query_segment_ids and key_value_segment_ids together")
  same = jnp.asarray(q_ids)[..., None, :, None] == jnp.asarray(kv_ids)[..., None, None, :]
  return _and(mask, same)


def _causal_mask(query, key, query_offset):
  """[T, S] boolean: query row t (at position query_offset + t) sees keys j <= its position."""
  rows = jnp.arange(query.shape[-3]) + jnp.asarray(query_offset, jnp.int32)
  return rows[:, None] >= jnp.arange(key.shape[-3])[None, :]


def flax_inputs(query, key, value, mask, *, is_causal=False, query_offset=0):
  """The inputs of Flax's linen ``dot_product_attention``, which knows neither
  grouped-query attention nor ``is_causal``: key/value heads repeated to the
  query's, and the causal mask folded into ``mask``."""
  repeats = query.shape[-2] // key.shape[-2]
  if repeats > 1:
    key, value = (jnp.repeat(x, repeats, axis=-2) for x in (key, value))
  if is_causal:
    mask = _and(mask, _causal_mask(query, key, query_offset))
  return key, value, mask


def linen_dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                                dropout_rng=None, dropout_rate=0.0, deterministic=False,
                                dtype=None, precision=None, module=None,
                                force_fp32_for_softmax=False, einsum_dot_general=None,
                                qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                                *, is_causal=False, query_offset=0, implementation=None,
                                logits_soft_cap=None, query_segment_ids=None,
                                key_value_segment_ids=None, sinks=None,
                                context_parallel_axis=None,
                                context_parallel_layout="contiguous",
                                context_parallel_strategy="ring"):
  """``flax.linen.dot_product_attention`` on ``jaxops.attention``: the same
  signature (so ``flax.linen.MultiHeadDotProductAttention`` passes it every
  argument), and Flax's own function wherever the kernel cannot give Flax's result.

  Runs Flax's ``flax.linen.dot_product_attention`` when the attention weights
  must exist: ``module`` is given (``sow_weights=True``: Flax sows them into the
  ``intermediates`` collection), dropout on the weights is active
  (``dropout_rate > 0`` and not ``deterministic``), or a custom einsum /
  ``einsum_dot_general`` is given; and for dtypes the kernel lacks (float64,
  complex). Otherwise the fused kernel, in ``dtype`` (else the promotion of the
  inputs' dtypes), with softmax statistics in float32 whatever the dtype; with
  ``force_fp32_for_softmax`` the output is float32, as Flax's is.

  Beyond Flax: grouped-query key/value (fewer heads dividing the query's),
  ``is_causal`` (at ``query_offset``) and ``jaxops.attention``'s
  ``logits_soft_cap``, segment ids (Flax's path folds them into the mask) and
  ``sinks`` (the kernel path only). Differences on the kernel path:
  ``precision`` sets the kernel's float32 products as it sets Flax's einsums
  (module docstring), and a query row whose keys are all masked gives 0 where
  Flax averages the values.

  ``context_parallel_axis`` (with ``context_parallel_layout`` and
  ``context_parallel_strategy``): called inside ``jax.shard_map`` on this
  device's blocks of a sequence split over that mesh axis, the attention is
  ``jaxops.ring_attention`` (see :func:`jaxops.ring_attention`); Flax's paths
  (the weights, dropout on them, custom einsums) are then an error.
  """
  op = "jaxops.flax.linen.dot_product_attention"
  features = dict(logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
                  key_value_segment_ids=key_value_segment_ids, sinks=sinks)
  context_parallel = _arguments.context_parallel(
      op, axis=context_parallel_axis, layout=context_parallel_layout,
      strategy=context_parallel_strategy)
  query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
  weights = (module is not None or (dropout_rate > 0.0 and not deterministic)
             or einsum_dot_general is not None or qk_attn_weights_einsum is not None
             or attn_weights_value_einsum is not None)
  _arguments.no_context_parallel_with(
      op, context_parallel, "sow_weights, dropout on the weights or custom einsums", weights)
  if weights or (context_parallel is None and not is_kernel_dtype(query.dtype)):
    mask = fold_features("jaxops.flax.linen.dot_product_attention", mask, features)
    key, value, mask = flax_inputs(query, key, value, mask, is_causal=is_causal,
                                   query_offset=query_offset)
    return nn.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, force_fp32_for_softmax, einsum_dot_general,
        qk_attn_weights_einsum, attn_weights_value_einsum)
  out = attend(query, key, value, bias, mask, is_causal=is_causal, query_offset=query_offset,
               precision=precision, implementation=implementation,
               context_parallel=context_parallel, **features)
  # Flax's fp32 softmax leaves float32 weights, whose product with V is float32.
  return out.astype(jnp.float32) if force_fp32_for_softmax else out


def nnx_dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                              dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                              precision=None, module=None,
                              promote_dtype=nnx_dtypes.promote_dtype, is_causal=False,
                              *, query_offset=0, implementation=None, logits_soft_cap=None,
                              query_segment_ids=None, key_value_segment_ids=None, sinks=None,
                              context_parallel_axis=None, context_parallel_layout="contiguous",
                              context_parallel_strategy="ring"):
  """``flax.nnx.dot_product_attention`` on ``jaxops.attention``, with its
  signature; pass it as ``attention_fn`` to ``flax.nnx.MultiHeadAttention``.

  Runs Flax's ``flax.nnx.dot_product_attention`` when the attention weights
  must exist (``module`` given: ``sow_weights=True`` sows them as
  ``nnx.Intermediate``; dropout on the weights active) and for dtypes the
  kernel lacks (float64, complex); otherwise the fused kernel on the inputs
  promoted by ``promote_dtype`` (grouped-query key/value and ``is_causal`` at
  ``query_offset`` included, and ``jaxops.attention``'s ``logits_soft_cap``,
  segment ids and ``sinks``). ``precision`` sets the kernel's float32
  products as it sets Flax's einsums (module docstring); a query row whose
  keys are all masked gives 0. ``context_parallel_axis`` (with
  ``context_parallel_layout`` and ``context_parallel_strategy``) runs
  ``jaxops.ring_attention`` inside ``jax.shard_map``, as in
  :func:`jaxops.flax.linen.dot_product_attention`.
  """
  op = "jaxops.flax.nnx.dot_product_attention"
  features = dict(logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
                  key_value_segment_ids=key_value_segment_ids, sinks=sinks)
  context_parallel = _arguments.context_parallel(
      op, axis=context_parallel_axis, layout=context_parallel_layout,
      strategy=context_parallel_strategy)
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  weights = module is not None or (dropout_rate > 0.0 and not deterministic)
  _arguments.no_context_parallel_with(
      op, context_parallel, "sow_weights or dropout on the weights", weights)
  if weights or (context_parallel is None and not is_kernel_dtype(query.dtype)):
    mask = fold_features("jaxops.flax.nnx.dot_product_attention", mask, features)
    mask, is_causal = nnx_causality(query, key, mask, is_causal, query_offset)
    return nnx.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, promote_dtype, is_causal)
  return attend(query, key, value, bias, mask, is_causal=is_causal, query_offset=query_offset,
                precision=precision, implementation=implementation,
                context_parallel=context_parallel, **features)


def nnx_causality(query, key, mask, is_causal, query_offset):
  """(mask, is_causal) for Flax's nnx attention, whose ``is_causal`` puts query
  row 0 at position 0: another ``query_offset`` goes into the mask."""
  if not is_causal or (isinstance(query_offset, int) and query_offset == 0):
    return mask, is_causal
  return _and(mask, _causal_mask(query, key, query_offset)), False


def _and(mask, causal):
  return causal if mask is None else jnp.logical_and(jnp.asarray(mask).astype(bool), causal)
