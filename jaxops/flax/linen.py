"""Flax linen modules on jaxops kernels (drop-in for the ``flax.linen`` ones)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

import jaxops
from jaxops.flax._dtypes import compute_dtype

Initializer = Callable[..., Any]


class LayerNorm(nn.Module):
  """``flax.linen.LayerNorm`` over the last axis, on ``jaxops.layer_norm``.

  Same parameters (``scale``, ``bias``), defaults (``epsilon=1e-6``) and dtype
  rule as Flax's; only the last axis is normalised.
  """

  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = nn.initializers.zeros
  scale_init: Initializer = nn.initializers.ones
  implementation: str | None = None

  @nn.compact
  def __call__(self, x):
    features = (x.shape[-1],)
    scale = self.param("scale", self.scale_init, features, self.param_dtype) if self.use_scale else None
    bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.use_bias else None
    dtype = compute_dtype(x, self.dtype, self.param_dtype, self.use_scale or self.use_bias)
    return jaxops.layer_norm(x.astype(dtype), scale, bias, epsilon=self.epsilon,
                             implementation=self.implementation)


class RMSNorm(nn.Module):
  """``flax.linen.RMSNorm`` over the last axis, on ``jaxops.rms_norm``."""

  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_scale: bool = True
  scale_init: Initializer = nn.initializers.ones
  implementation: str | None = None

  @nn.compact
  def __call__(self, x):
    scale = (self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
             if self.use_scale else None)
    dtype = compute_dtype(x, self.dtype, self.param_dtype, self.use_scale)
    return jaxops.rms_norm(x.astype(dtype), scale, epsilon=self.epsilon,
                           implementation=self.implementation)


class Embed(nn.Module):
  """``flax.linen.Embed`` on ``jaxops.embedding``: the same parameter
  (``embedding``, shape ``(num_embeddings, features)``), initializer and dtype
  rule as Flax's, and its ``attend``.

  One difference: out-of-range ids (negative ones included) are clamped to
  ``[0, num_embeddings - 1]`` (see :func:`jaxops.embedding`), where Flax's
  ``jnp.take`` returns NaN past the end and wraps negative ids around.
  """

  num_embeddings: int
  features: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  embedding_init: Initializer = nn.linear.default_embed_init
  implementation: str | None = None

  def setup(self):
    self.embedding = self.param("embedding", self.embedding_init,
                                (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, inputs):
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("jaxops.flax.linen.Embed: inputs must have an integer dtype, got "
                       f"{inputs.dtype}")
    table = self.embedding if self.dtype is None else self.embedding.astype(self.dtype)
    return jaxops.embedding(table, inputs, implementation=self.implementation)

  def attend(self, query):
    """``query @ embedding.T``: logits over the vocabulary, as Flax's ``attend``."""
    dtype = self.dtype if self.dtype is not None else jnp.result_type(query, self.embedding)
    return jnp.dot(query.astype(dtype), self.embedding.astype(dtype).T)


class GatedMLP(nn.Module):
  """The gated feed-forward block of Llama / PaLM style transformers:
  ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (``"swiglu"``) or GELU
  (``"geglu"``, tanh form), the gating fused in ``jaxops.swiglu`` /
  ``jaxops.geglu``.

  Flax has no such module; its parameters are three ``nn.Dense`` submodules
  named ``gate``, ``up`` (``features -> hidden_features``) and ``down``
  (``hidden_features -> out_features``, default: the input's features), each
  with ``kernel`` (and ``bias`` when ``use_bias``).
  """

  hidden_features: int
  out_features: int | None = None
  activation: str = "swiglu"
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = nn.linear.default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  implementation: str | None = None

  @nn.compact
  def __call__(self, x):
    gated = _gated_activation("jaxops.flax.linen.GatedMLP", self.activation)
    dense = lambda features, name: nn.Dense(
        features, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, name=name)
    gate = dense(self.hidden_features, "gate")(x)
    up = dense(self.hidden_features, "up")(x)
    hidden = gated(gate, up, implementation=self.implementation)
    return dense(self.out_features or x.shape[-1], "down")(hidden)


class RotaryEmbedding(nn.Module):
  """Rotary position embedding of queries or keys [batch, seq, heads, head_dim]
  at integer ``positions`` ([seq] or [batch, seq]), on ``jaxops.rope``. No
  parameters; ``theta``, ``style`` and ``rotary_dim`` as in :func:`jaxops.rope`.
  """

  theta: float = 10000.0
  style: str = "neox"
  rotary_dim: int | None = None
  implementation: str | None = None

  def __call__(self, x, positions):
    return jaxops.rope(x, positions, theta=self.theta, style=self.style,
                       rotary_dim=self.rotary_dim, implementation=self.implementation)


def _gated_activation(op, activation):
  if activation == "swiglu":
    return jaxops.swiglu
  if activation == "geglu":
    return jaxops.geglu
  raise ValueError(f"{op}: activation must be 'swiglu' or 'geglu', got {activation!r}")
