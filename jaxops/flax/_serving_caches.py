"""KV caches for serving many sequences at once, each at its own position: the
``kv_cache`` argument of the attention modules also takes these (one per layer).

- :class:`PagedKVCache`: the cache is a pool of fixed-size pages shared by all
  sequences; a sequence's tokens live in the pages its row of ``block_tables``
  names (``jaxops.paged_kv_update`` writes them, ``jaxops.paged_attention``
  reads them). Memory follows the tokens actually cached.
- :class:`BatchedKVCache`: one contiguous [batch, max_len] cache row per
  sequence, written and read with plain jnp (the reference a paged cache is
  measured against).

Both carry the step's geometry: ``positions`` [B, T] (the absolute position of
each new token) and ``query_lens`` [B] (how many of the T rows of sequence b are
real; rows past it are padding, neither cached nor attended from). The module's
``query_offset`` is not used with them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import jaxops


def _rotate(rope, query, key, positions):
  if rope is None:
    return query, key
  return rope(query, positions), rope(key, positions)


class PagedKVCache(NamedTuple):
  """One layer's pages [num_pages, page_size, K, H] and the step's geometry.

  ``block_tables`` [B, max_pages_per_seq] and ``kv_lens`` [B] (tokens cached
  after this step's writes) are as ``jaxops.paged_attention`` takes them;
  ``slot_mapping`` [B * T] is where each new token goes (-1: a padding row).
  """

  key_pages: jax.Array
  value_pages: jax.Array
  block_tables: jax.Array
  kv_lens: jax.Array
  query_lens: jax.Array
  positions: jax.Array
  slot_mapping: jax.Array

  def attend(self, query, key, value, *, rope=None, precision=None, implementation=None):
    """query [B, T, N, H], key/value [B, T, K, H]: the new rows. Returns
    (output [B, T, N, H], the cache with the new rows written). ``precision``:
    the attention's (the module's, as its projections')."""
    query, key = _rotate(rope, query, key, self.positions)
    batch, steps, kv_heads, head_dim = key.shape
    flat = lambda x: x.reshape(batch * steps, kv_heads, head_dim).astype(self.key_pages.dtype)
    key_pages, value_pages = jaxops.paged_kv_update(
        self.key_pages, self.value_pages, flat(key), flat(value), self.slot_mapping)
    # The pages keep their dtype (a cast would copy the whole pool every step).
    out = jaxops.paged_attention(query.astype(key_pages.dtype), key_pages, value_pages,
                                 self.block_tables, self.kv_lens, query_lens=self.query_lens,
                                 precision=precision,
                                 implementation=implementation).astype(query.dtype)
    return out, self._replace(key_pages=key_pages, value_pages=value_pages)


class BatchedKVCache(NamedTuple):
  """One layer's keys/values [B, max_len, K, H], a contiguous row per sequence."""

  keys: jax.Array
  values: jax.Array
  query_lens: jax.Array
  positions: jax.Array

  def attend(self, query, key, value, *, rope=None, precision=None, implementation=None):
    """As :meth:`PagedKVCache.attend`, over the contiguous rows."""
    query, key = _rotate(rope, query, key, self.positions)
    batch, steps = self.positions.shape
    max_len = self.keys.shape[1]
    real = jnp.arange(steps)[None, :] < self.query_lens[:, None]
    # Padding rows are written out of range, where mode="drop" discards them.
    rows = jnp.where(real, self.positions, max_len)
    sequences = jnp.broadcast_to(jnp.arange(batch)[:, None], rows.shape)
    write = lambda cache, x: cache.at[sequences, rows].set(x.astype(cache.dtype), mode="drop")
    keys, values = write(self.keys, key), write(self.values, value)
    # Row t of sequence b attends its cached keys up to its own position.
    mask = jnp.arange(max_len)[None, None, :] <= self.positions[:, :, None]
    out = jaxops.attention(query, keys.astype(query.dtype), values.astype(query.dtype),
                           mask=mask[:, None], precision=precision,
                           implementation=implementation)
    return out, self._replace(keys=keys, values=values)


SERVING_CACHES = (PagedKVCache, BatchedKVCache)
