"""The decoder-only language model in two flavours, ``DecoderLM`` (linen) and
``DecoderLMNNX`` (nnx), built from the jaxops Flax modules and sharing their
math (:mod:`jaxops.models.blocks`) and parameter layout:

  embed/embedding                       [vocab, d_model], tied with the output
  layers_<i>/attn_norm/scale, mlp_norm/scale
  layers_<i>/attn/{query,key,value,out}/kernel   (no biases)
  layers_<i>/mlp/{gate,up,down}/kernel
  final_norm/scale

``linen_to_nnx`` and ``nnx_to_linen`` move parameters between the two.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxops.flax import linen as jl
from jaxops.flax import nnx as jn
from jaxops.models import blocks
from jaxops.models.config import DecoderConfig


class DecoderLayer(nn.Module):
  """One pre-norm block: RMSNorm, attention (RoPE, GQA), RMSNorm, SwiGLU MLP (linen)."""
  config: DecoderConfig

  def setup(self):
    c = self.config
    impl = c.implementation
    self.attn_norm = jl.RMSNorm(epsilon=c.norm_epsilon, implementation=impl)
    self.attn = jl.MultiHeadAttention(
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, is_causal=True, use_bias=False,
        rope=jl.RotaryEmbedding(theta=c.rope_theta, implementation=impl),
        implementation=impl)
    self.mlp_norm = jl.RMSNorm(epsilon=c.norm_epsilon, implementation=impl)
    self.mlp = jl.GatedMLP(hidden_features=c.hidden, activation="swiglu", implementation=impl)

  def __call__(self, x, *, query_offset=0, kv_cache=None):
    return blocks.decoder_layer(x, attn_norm=self.attn_norm, attn=self.attn,
                                mlp_norm=self.mlp_norm, mlp=self.mlp,
                                query_offset=query_offset, kv_cache=kv_cache)


class DecoderLM(nn.Module):
  """Linen decoder-only LM: ``apply(params, tokens)`` -> logits [B, T, vocab]."""

  config: DecoderConfig

  def setup(self):
    c = self.config
    self.embed = jl.Embed(c.vocab_size, c.d_model, implementation=c.implementation)
    self.layers = [DecoderLayer(c) for _ in range(c.num_layers)]
    self.final_norm = jl.RMSNorm(epsilon=c.norm_epsilon, implementation=c.implementation)

  def __call__(self, tokens, *, query_offset=0, kv_caches=None):
    return blocks.decoder_logits(tokens, embed=self.embed, layers=self.layers,
                                 final_norm=self.final_norm, query_offset=query_offset,
                                 kv_caches=kv_caches)


class DecoderLayerNNX(nnx.Module):
  """:class:`DecoderLayer` in nnx, on the same block function and parameters."""
  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    impl = c.implementation
    self.attn_norm = jn.RMSNorm(c.d_model, epsilon=c.norm_epsilon, implementation=impl, rngs=rngs)
    self.attn = jn.MultiHeadAttention(
        c.num_heads, c.d_model, num_kv_heads=c.num_kv_heads, is_causal=True, use_bias=False,
        rope=jn.RotaryEmbedding(theta=c.rope_theta, implementation=impl),
        implementation=impl, rngs=rngs)
    self.mlp_norm = jn.RMSNorm(c.d_model, epsilon=c.norm_epsilon, implementation=impl, rngs=rngs)
    self.mlp = jn.GatedMLP(c.d_model, c.hidden, activation="swiglu", implementation=impl,
                           rngs=rngs)

  def __call__(self, x, *, query_offset=0, kv_cache=None):
    return blocks.decoder_layer(x, attn_norm=self.attn_norm, attn=self.attn,
                                mlp_norm=self.mlp_norm, mlp=self.mlp,
                                query_offset=query_offset, kv_cache=kv_cache)


class DecoderLMNNX(nnx.Module):
  """NNX decoder-only LM: ``model(tokens)`` -> logits [B, T, vocab]."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = jn.Embed(config.vocab_size, config.d_model,
                          implementation=config.implementation, rngs=rngs)
    self.layers = nnx.List([DecoderLayerNNX(config, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = jn.RMSNorm(config.d_model, epsilon=config.norm_epsilon,
                                 implementation=config.implementation, rngs=rngs)

  def __call__(self, tokens, *, query_offset=0, kv_caches=None):
    return blocks.decoder_logits(tokens, embed=self.embed, layers=self.layers,
                                 final_norm=self.final_norm, query_offset=query_offset,
                                 kv_caches=kv_caches)


def init_params(config: DecoderConfig, seed: int = 0):
  """Linen parameters ({"params": ...}) of a fresh model.

  Args:
    config: the model's configuration.
    seed: the initialisation seed.

  Returns:
    ``{"params": ...}``, the variables :class:`DecoderLM` applies.

  Examples:
    >>> from jaxops.models import decoder
    >>> from jaxops.models.config import DecoderConfig
    >>> variables = decoder.init_params(DecoderConfig(d_model=32, num_layers=1))
    >>> logits = decoder.linen_model(DecoderConfig(d_model=32, num_layers=1)).apply(
    ...     variables, jnp.zeros((1, 8), jnp.int32))
    >>> logits.shape
    (1, 8, 256)
  """
  return linen_model(config).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))


def linen_to_nnx(variables, model: DecoderLMNNX) -> None:
  """Loads linen ``variables`` ({"params": ...}) into the nnx ``model`` in place."""
  pure = dict(variables["params"])
  layers = {i: pure.pop(f"layers_{i}") for i in range(model.config.num_layers)}
  pure["layers"] = layers
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(model, state)


def nnx_to_linen(model: DecoderLMNNX):
  """The nnx ``model``'s parameters as linen variables ({"params": ...})."""
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  layers = pure.pop("layers")
  pure.update({f"layers_{i}": layer for i, layer in layers.items()})
  return {"params": pure}


@functools.lru_cache(maxsize=None)
def linen_model(config: DecoderConfig) -> DecoderLM:
  """One module object per config, so jitted functions keyed on it are reused."""
  return DecoderLM(config)
