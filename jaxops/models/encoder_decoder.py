"""The "Attention is all you need" encoder-decoder (Vaswani et al., 2017), linen.

Post-norm residual layers (``LayerNorm(x + sublayer(x))``), sinusoidal
positions added to the scaled, shared source/target embedding, and the masks
written out as the paper describes them: a padding mask on the keys of every
attention, and the look-ahead mask on the decoder's self-attention. The
feed-forward block uses GELU (a jaxops kernel) where the paper has ReLU.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops.flax import linen as jl
from jaxops.models.config import EncoderDecoderConfig


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
  """[length, d_model]: sin on even features, cos on odd, wavelengths 2pi .. 10000 * 2pi."""
  position = np.arange(length)[:, None]
  inv_freq = np.exp(-math.log(10000.0) * np.arange(0, d_model, 2) / d_model)
  table = np.zeros((length, d_model), np.float32)
  table[:, 0::2] = np.sin(position * inv_freq)
  table[:, 1::2] = np.cos(position * inv_freq)[:, : d_model // 2]
  return table


def padding_mask(tokens, pad_id: int):
  """[B, 1, 1, S] bool: attend to key j unless it is padding."""
  return (tokens != pad_id)[:, None, None, :]


def look_ahead_mask(length: int):
  """[1, 1, T, T] bool: query t attends keys j <= t."""
  return jnp.tril(jnp.ones((length, length), bool))[None, None]


class FeedForward(nn.Module):
  """The position-wise feed-forward block: ``Dense(hidden) -> GELU -> Dense(d_model)``."""
  hidden: int
  implementation: str | None = None

  @nn.compact
  def __call__(self, x):
    h = jaxops.gelu(nn.Dense(self.hidden, name="inner")(x), implementation=self.implementation)
    return nn.Dense(x.shape[-1], name="outer")(h)


def _attention(config: EncoderDecoderConfig, name: str):
  return jl.MultiHeadAttention(num_heads=config.num_heads, implementation=config.implementation,
                               name=name)


def _norm(config: EncoderDecoderConfig, name: str):
  return jl.LayerNorm(epsilon=config.norm_epsilon, implementation=config.implementation,
                      name=name)


class EncoderLayer(nn.Module):
  """Self-attention and feed-forward, each a post-norm residual block."""
  config: EncoderDecoderConfig

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    x = _norm(c, "self_attn_norm")(x + _attention(c, "self_attn")(x, mask=mask))
    return _norm(c, "ffn_norm")(x + FeedForward(c.mlp_hidden, c.implementation, name="ffn")(x))


class DecoderLayer(nn.Module):
  """Masked self-attention, cross-attention and feed-forward, each a post-norm residual block."""
  config: EncoderDecoderConfig

  @nn.compact
  def __call__(self, y, memory, self_mask, cross_mask):
    c = self.config
    y = _norm(c, "self_attn_norm")(y + _attention(c, "self_attn")(y, mask=self_mask))
    y = _norm(c, "cross_attn_norm")(y + _attention(c, "cross_attn")(y, memory, mask=cross_mask))
    return _norm(c, "ffn_norm")(y + FeedForward(c.mlp_hidden, c.implementation, name="ffn")(y))


class EncoderDecoder(nn.Module):
  """``apply(params, source [B, S], target_in [B, T])`` -> logits [B, T, vocab]
  through the shared embedding's transpose."""

  config: EncoderDecoderConfig

  def setup(self):
    c = self.config
    self.embed = jl.Embed(c.vocab_size, c.d_model, implementation=c.implementation)
    self.encoder_layers = [EncoderLayer(c) for _ in range(c.num_layers)]
    self.decoder_layers = [DecoderLayer(c) for _ in range(c.num_layers)]
    self.positions = sinusoidal_positions(c.max_len, c.d_model)

  def _embed(self, tokens):
    # The paper scales the embedding by sqrt(d_model) so it is not drowned by the positions.
    x = self.embed(tokens) * math.sqrt(self.config.d_model)
    return x + self.positions[: tokens.shape[1]]

  def encode(self, source):
    mask = padding_mask(source, self.config.pad_id)
    x = self._embed(source)
    for layer in self.encoder_layers:
      x = layer(x, mask)
    return x

  def decode(self, memory, source, target_in):
    pad_id = self.config.pad_id
    self_mask = padding_mask(target_in, pad_id) & look_ahead_mask(target_in.shape[1])
    cross_mask = padding_mask(source, pad_id)
    y = self._embed(target_in)
    for layer in self.decoder_layers:
      y = layer(y, memory, self_mask, cross_mask)
    return self.embed.attend(y)

  def __call__(self, source, target_in):
    return self.decode(self.encode(source), source, target_in)


def seq2seq_loss(model: EncoderDecoder, variables, source, target):
  """Teacher-forced loss of ``target`` [B, T] (starting with a BOS token) given
  ``source``; padded target positions are ignored."""
  c = model.config
  logits = model.apply(variables, source, target[:, :-1])
  labels = jnp.where(target[:, 1:] == c.pad_id, -100, target[:, 1:])
  return jaxops.cross_entropy(logits, labels, ignore_index=-100, implementation=c.implementation)
