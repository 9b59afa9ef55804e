"""The math the linen and nnx decoders share: a model is the same function of its
layers whichever Flax API made them, so the two flavours cannot drift apart."""

from __future__ import annotations

import jax.numpy as jnp

import jaxops


def decoder_layer(x, *, attn_norm, attn, mlp_norm, mlp, query_offset=0, kv_cache=None):
  """Pre-norm residual layer: x + attn(norm(x)), then + mlp(norm(.)).

  With ``kv_cache`` the attention writes the new keys/values at
  ``query_offset`` and the layer returns ``(x, kv_cache)``.
  """
  h = attn_norm(x)
  if kv_cache is None:
    x = x + attn(h, query_offset=query_offset)
  else:
    h, kv_cache = attn(h, query_offset=query_offset, kv_cache=kv_cache)
    x = x + h
  x = x + mlp(mlp_norm(x))
  return x if kv_cache is None else (x, kv_cache)


def decoder_logits(tokens, *, embed, layers, final_norm, query_offset=0, kv_caches=None):
  """Token ids [B, T] -> logits [B, T, vocab] through the tied embedding.

  ``kv_caches`` (one per layer) switches every layer to cached decoding; the
  result is then ``(logits, kv_caches)``.
  """
  x = embed(tokens)
  new_caches = []
  for i, layer in enumerate(layers):
    if kv_caches is None:
      x = layer(x, query_offset=query_offset)
    else:
      x, cache = layer(x, query_offset=query_offset, kv_cache=kv_caches[i])
      new_caches.append(cache)
  logits = embed.attend(final_norm(x))
  return logits if kv_caches is None else (logits, tuple(new_caches))


def lm_loss(logits, labels, *, ignore_index, implementation):
  """Mean next-token cross-entropy over the labels that are not ``ignore_index``."""
  return jaxops.cross_entropy(logits, labels, ignore_index=ignore_index,
                              implementation=implementation)


def empty_kv_caches(config, batch: int, max_len: int, dtype=jnp.float32):
  """One zeroed (keys, values) pair [batch, max_len, kv_heads, head_dim] per layer."""
  shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
               for _ in range(config.num_layers))
