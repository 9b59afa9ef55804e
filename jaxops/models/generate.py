"""KV-cache decoding of the linen decoder: a prefill call over the prompt, then
one token per step under ``lax.fori_loop`` with the position as a traced
``query_offset``, so the loop compiles once whatever its length."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxops.models.blocks import empty_kv_caches
from jaxops.models.config import DecoderConfig
from jaxops.models.decoder import linen_model


def _prefill(variables, config, prompt, max_len):
  caches = empty_kv_caches(config, prompt.shape[0], max_len)
  return linen_model(config).apply(variables, prompt, query_offset=0, kv_caches=caches)


def _step(variables, config, token, position, caches):
  """Logits [B, vocab] of the token [B] at ``position`` (traced), and the caches."""
  logits, caches = linen_model(config).apply(variables, token[:, None], query_offset=position,
                                             kv_caches=caches)
  return logits[:, 0], caches


@functools.partial(jax.jit, static_argnames=("config", "num_new"))
def generate(variables, prompt, key, *, config: DecoderConfig, num_new: int,
             temperature: float = 1.0):
  """Samples ``num_new`` tokens after ``prompt`` with a KV cache.

  One ``jit``: the prompt is read in one cached call (prefill), then a
  ``lax.fori_loop`` decodes one token per step with the position as a traced
  ``query_offset``, so the loop compiles once.

  Args:
    variables: the linen variables ``{"params": ...}`` of a :class:`DecoderLM`.
    prompt: int32 ``[B, P]`` token ids, ``P >= 1``.
    key: a PRNG key for the sampling.
    config: the model's :class:`~jaxops.models.config.DecoderConfig`.
    num_new: how many tokens to generate.
    temperature: the sampling temperature (0: greedy).

  Returns:
    int32 ``[B, P + num_new]``: the prompt followed by the new tokens.
  """
  batch, prompt_len = prompt.shape
  logits, caches = _prefill(variables, config, prompt, prompt_len + num_new)
  tokens = jnp.concatenate([prompt, jnp.zeros((batch, num_new), prompt.dtype)], axis=1)

  def body(i, carry):
    tokens, last_logits, caches, key = carry
    key, sample_key = jax.random.split(key)
    token = jax.random.categorical(sample_key, last_logits / temperature).astype(tokens.dtype)
    position = prompt_len + i
    tokens = lax.dynamic_update_slice(tokens, token[:, None], (0, position))
    last_logits, caches = _step(variables, config, token, position, caches)
    return tokens, last_logits, caches, key

  tokens, *_ = lax.fori_loop(0, num_new, body, (tokens, logits[:, -1], caches, key))
  return tokens


@functools.partial(jax.jit, static_argnames=("config", "prefill_len"))
def decode_logits(variables, tokens, *, config: DecoderConfig, prefill_len: int):
  """The logits a decode computes, for testing it against the full forward.

  The first ``prefill_len`` tokens are read in one cached call, the rest one at
  a time (teacher forcing). They equal the full-sequence forward's logits; the
  tests check it.

  Args:
    variables: the linen variables of a :class:`DecoderLM`.
    tokens: int32 ``[B, L]``.
    config: the model's configuration.
    prefill_len: tokens read by the first call, in ``[1, L]``.

  Returns:
    float ``[B, L, vocab]``.
  """
  batch, length = tokens.shape
  logits, caches = _prefill(variables, config, tokens[:, :prefill_len], length)
  all_logits = jnp.zeros((batch, length, logits.shape[-1]), logits.dtype)
  all_logits = all_logits.at[:, :prefill_len].set(logits)

  def body(position, carry):
    all_logits, caches = carry
    token = lax.dynamic_index_in_dim(tokens, position, axis=1, keepdims=False)
    logits, caches = _step(variables, config, token, position, caches)
    all_logits = lax.dynamic_update_slice(all_logits, logits[:, None], (0, position, 0))
    return all_logits, caches

  all_logits, _ = lax.fori_loop(prefill_len, length, body, (all_logits, caches))
  return all_logits
