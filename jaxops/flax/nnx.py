"""Flax NNX modules on jaxops kernels (drop-in for the ``flax.nnx`` ones)."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

import jaxops
from jaxops.flax._dtypes import compute_dtype

Initializer = Callable[..., Any]


class LayerNorm(nnx.Module):
  """``flax.nnx.LayerNorm`` over the last axis, on ``jaxops.layer_norm``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init: Initializer = nnx.initializers.zeros,
               scale_init: Initializer = nnx.initializers.ones,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_features = num_features
    self.epsilon, self.dtype, self.param_dtype = epsilon, dtype, param_dtype
    self.implementation = implementation
    self.scale = (nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
                  if use_scale else None)
    self.bias = (nnx.Param(bias_init(rngs.params(), (num_features,), param_dtype))
                 if use_bias else None)

  def __call__(self, x):
    dtype = compute_dtype(x, self.dtype, self.param_dtype, self.scale is not None or self.bias is not None)
    return jaxops.layer_norm(x.astype(dtype), _value(self.scale), _value(self.bias),
                             epsilon=self.epsilon, implementation=self.implementation)


class RMSNorm(nnx.Module):
  """``flax.nnx.RMSNorm`` over the last axis, on ``jaxops.rms_norm``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_scale: bool = True,
               scale_init: Initializer = nnx.initializers.ones,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_features = num_features
    self.epsilon, self.dtype, self.param_dtype = epsilon, dtype, param_dtype
    self.implementation = implementation
    self.scale = (nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
                  if use_scale else None)

  def __call__(self, x):
    dtype = compute_dtype(x, self.dtype, self.param_dtype, self.scale is not None)
    return jaxops.rms_norm(x.astype(dtype), _value(self.scale), epsilon=self.epsilon,
                           implementation=self.implementation)


class Embed(nnx.Module):
  """``flax.nnx.Embed`` on ``jaxops.embedding``: the same parameter
  (``embedding``), initializer and dtype rule as Flax's, and its ``attend``.
  Out-of-range ids are clamped (see :class:`jaxops.flax.linen.Embed`).
  """

  def __init__(self, num_embeddings: int, features: int, *, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               embedding_init: Initializer = nnx.nn.linear.default_embed_init,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_embeddings, self.features = num_embeddings, features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.implementation = implementation
    self.embedding = nnx.Param(
        embedding_init(rngs.params(), (num_embeddings, features), param_dtype))

  def __call__(self, inputs):
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("jaxops.flax.nnx.Embed: inputs must have an integer dtype, got "
                       f"{inputs.dtype}")
    table = self.embedding[...]
    if self.dtype is not None:
      table = table.astype(self.dtype)
    return jaxops.embedding(table, inputs, implementation=self.implementation)

  def attend(self, query):
    """``query @ embedding.T``: logits over the vocabulary, as Flax's ``attend``."""
    table = self.embedding[...]
    dtype = self.dtype if self.dtype is not None else jnp.result_type(query, table)
    return jnp.dot(query.astype(dtype), table.astype(dtype).T)


class GatedMLP(nnx.Module):
  """``down(act(gate(x)) * up(x))``, as :class:`jaxops.flax.linen.GatedMLP`:
  three ``nnx.Linear`` attributes ``gate``, ``up`` and ``down``."""

  def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
               *, activation: str = "swiglu", use_bias: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: Initializer = nnx.nn.linear.default_kernel_init,
               bias_init: Initializer = nnx.initializers.zeros,
               implementation: str | None = None, rngs: nnx.Rngs):
    _gated_activation("jaxops.flax.nnx.GatedMLP", activation)  # validates it
    self.activation, self.implementation = activation, implementation
    linear = lambda fan_in, fan_out: nnx.Linear(
        fan_in, fan_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
    self.gate = linear(in_features, hidden_features)
    self.up = linear(in_features, hidden_features)
    self.down = linear(hidden_features, out_features or in_features)

  def __call__(self, x):
    gated = _gated_activation("jaxops.flax.nnx.GatedMLP", self.activation)
    hidden = gated(self.gate(x), self.up(x), implementation=self.implementation)
    return self.down(hidden)


class RotaryEmbedding(nnx.Module):
  """Rotary position embedding, as :class:`jaxops.flax.linen.RotaryEmbedding`."""

  def __init__(self, *, theta: float = 10000.0, style: str = "neox",
               rotary_dim: int | None = None, implementation: str | None = None):
    self.theta, self.style, self.rotary_dim = theta, style, rotary_dim
    self.implementation = implementation

  def __call__(self, x, positions):
    return jaxops.rope(x, positions, theta=self.theta, style=self.style,
                       rotary_dim=self.rotary_dim, implementation=self.implementation)


def _value(param):
  return None if param is None else param[...]


def _gated_activation(op, activation):
  if activation == "swiglu":
    return jaxops.swiglu
  if activation == "geglu":
    return jaxops.geglu
  raise ValueError(f"{op}: activation must be 'swiglu' or 'geglu', got {activation!r}")
