"""Model configurations: plain frozen dataclasses, hashable so they can be static
arguments of ``jax.jit`` and shared by the linen and nnx flavours."""

from __future__ import annotations

import dataclasses

from jaxops._src import validation


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A decoder-only transformer language model.

  ``num_kv_heads`` < ``num_heads`` is grouped-query attention; ``mlp_hidden``
  defaults to 8/3 * d_model rounded up to a multiple of 32 (SwiGLU's usual
  size, keeping the parameter count of a 4x ReLU MLP).
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_hidden: int | None = None
  rope_theta: float = 10000.0
  norm_epsilon: float = 1e-6
  ignore_index: int = -100
  implementation: str | None = None

  def __post_init__(self):
    # The attention layers would refuse these too, but only once the model is built.
    op = "jaxops.models.DecoderConfig"
    if self.d_model % validation.positive_int(op, "num_heads", self.num_heads):
      raise validation.value_error(op, "num_heads", f"divide d_model = {self.d_model}",
                                   str(self.num_heads))
    if self.num_heads % validation.positive_int(op, "num_kv_heads", self.num_kv_heads):
      raise validation.value_error(op, "num_kv_heads", f"divide num_heads = {self.num_heads}",
                                   str(self.num_kv_heads))

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def hidden(self) -> int:
    return self.mlp_hidden or -(-8 * self.d_model // 3 // 32) * 32


@dataclasses.dataclass(frozen=True)
class EncoderDecoderConfig:
  """The "Attention is all you need" encoder-decoder with a shared source/target
  vocabulary (and embedding, as in the paper). ``pad_id`` marks padding in both."""

  vocab_size: int = 64
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_hidden: int = 128
  max_len: int = 512
  pad_id: int = 0
  norm_epsilon: float = 1e-5
  implementation: str | None = None
