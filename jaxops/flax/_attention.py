"""Attention shared by the linen and nnx wrappers: an ``attention_fn`` for Flax's
multi-head attention modules, and the attention step of jaxops' own modules."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxops
from jaxops._src import validation


def attend(query, key, value, bias=None, mask=None, *, is_causal=False, query_offset=0,
           rope=None, implementation=None):
  """``jaxops.attention`` over any number of batch axes, with an optional RoPE hook.

  query [batch..., T, N, H], key/value [batch..., S, K, H]; bias and mask
  broadcastable to [batch..., N, T, S]. As in Flax, a mask of any dtype attends
  where it is nonzero. ``rope(x, positions)`` (if given) is applied to the
  query at positions query_offset + t and to the key at j.
  """
  mask = None if mask is None else jnp.asarray(mask).astype(bool)
  if rope is not None:
    query = rope(query, jnp.arange(query.shape[-3]) + jnp.asarray(query_offset, jnp.int32))
    key = rope(key, jnp.arange(key.shape[-3]))
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

  out = jaxops.attention(flat(query), flat(key), flat(value), flat_broadcastable(bias),
                         flat_broadcastable(mask), is_causal=is_causal,
                         query_offset=query_offset, implementation=implementation)
  return out.reshape(batch_shape + out.shape[1:])


def attend_cached(query, key, value, kv_cache, *, query_offset, is_causal=False, rope=None,
                  implementation=None):
  """Attention of T new query rows against a fixed-length key/value cache.

  query [B, T, N, H]; key/value [B, T, K, H] are the new rows' projections,
  written into ``kv_cache`` = (keys, values) [B, S_max, K, H] at rows
  ``query_offset`` .. ``query_offset + T - 1`` (``query_offset`` may be traced,
  so a decode loop compiles once). Cache rows past the written ones are masked
  through ``key_value_seq_lengths``; ``is_causal`` masks as for the full
  sequence. ``rope`` sees absolute positions for both query and new keys.
  Returns (output [B, T, N, H], updated cache).
  """
  validation.rank("attend_cached", "query", query, low=4, high=4, labels="[B, T, N, H]")
  offset = jnp.asarray(query_offset, jnp.int32)
  if rope is not None:
    positions = jnp.arange(query.shape[1], dtype=jnp.int32) + offset
    query, key = rope(query, positions), rope(key, positions)
  cached_key, cached_value = kv_cache
  zero = jnp.zeros((), jnp.int32)
  start = (zero, offset, zero, zero)
  cached_key = lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), start)
  cached_value = lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), start)
  lengths = jnp.full((query.shape[0],), offset + query.shape[1], jnp.int32)
  out = jaxops.attention(query, cached_key.astype(query.dtype), cached_value.astype(query.dtype),
                         is_causal=is_causal, query_offset=offset,
                         key_value_seq_lengths=lengths, implementation=implementation)
  return out, (cached_key, cached_value)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, is_causal=False, implementation=None,
                          **unused):
  """``flax.linen``/``flax.nnx`` ``dot_product_attention``'s signature on ``jaxops.attention``.

  Pass it as ``attention_fn`` to ``flax.linen.MultiHeadDotProductAttention`` or
  ``flax.nnx.MultiHeadAttention``. query [batch..., T, N, H], key/value
  [batch..., S, K, H] (any number of batch axes, N % K == 0); mask and bias
  broadcastable to [batch..., N, T, S]; as in Flax, a mask of any dtype
  attends where it is nonzero (``flax.linen.make_causal_mask`` gives float32).
  Computed in ``dtype`` (else the promotion of the inputs' dtypes).

  The fused kernel has no dropout on the attention weights and never
  materialises them: when such dropout is active (``dropout_rate > 0`` and not
  ``deterministic``) or the weights are to be sown (``module``), this falls
  back to Flax's own ``dot_product_attention``. A row whose keys are all
  masked gives 0 (Flax averages V there). ``precision`` is not used: the
  kernel accumulates in float32.
  """
  del precision, unused
  if module is not None or (dropout_rate > 0.0 and not deterministic):
    return nnx.dot_product_attention(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
        dtype=dtype, module=module, is_causal=is_causal)
  dtype = jnp.result_type(query, key, value) if dtype is None else dtype
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  return attend(query, key, value, bias, mask, is_causal=is_causal,
                implementation=implementation)
