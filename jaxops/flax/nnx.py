"""Flax NNX modules on jaxops kernels (drop-in for the ``flax.nnx`` ones)."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

import jaxops
from jaxops.flax import _arguments
from jaxops.flax._attention import attend, attend_cached
from jaxops.flax._attention import dot_product_attention  # noqa: F401  (an attention_fn for Flax)
from jaxops.flax._dtypes import compute_dtype

Initializer = Callable[..., Any]


class LayerNorm(nnx.Module):
  """``flax.nnx.LayerNorm`` over the last axis, on ``jaxops.layer_norm``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init: Initializer = nnx.initializers.zeros,
               scale_init: Initializer = nnx.initializers.ones,
               implementation: str | None = None, rngs: nnx.Rngs):
    _arguments.norm("jaxops.flax.nnx.LayerNorm", num_features=num_features,
                    epsilon=epsilon, implementation=implementation)
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
    _arguments.norm("jaxops.flax.nnx.RMSNorm", num_features=num_features,
                    epsilon=epsilon, implementation=implementation)
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
    _arguments.embed("jaxops.flax.nnx.Embed", num_embeddings=num_embeddings, features=features,
                     implementation=implementation)
    self.num_embeddings, self.features = num_embeddings, features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.implementation = implementation
    self.embedding = nnx.Param(
        embedding_init(rngs.params(), (num_embeddings, features), param_dtype))

  def __call__(self, inputs):
    inputs = _arguments.embed_ids("jaxops.flax.nnx.Embed", inputs)
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
    _arguments.gated_activation("jaxops.flax.nnx.GatedMLP", activation)  # fails early
    self.activation, self.implementation = activation, implementation
    linear = lambda fan_in, fan_out: nnx.Linear(
        fan_in, fan_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
    self.gate = linear(in_features, hidden_features)
    self.up = linear(in_features, hidden_features)
    self.down = linear(hidden_features, out_features or in_features)

  def __call__(self, x):
    gated = _arguments.gated_activation("jaxops.flax.nnx.GatedMLP", self.activation)
    hidden = gated(self.gate(x), self.up(x), implementation=self.implementation)
    return self.down(hidden)


class RotaryEmbedding(nnx.Module):
  """Rotary position embedding, as :class:`jaxops.flax.linen.RotaryEmbedding`."""

  def __init__(self, *, theta: float = 10000.0, style: str = "neox",
               rotary_dim: int | None = None, implementation: str | None = None):
    _arguments.rotary("jaxops.flax.nnx.RotaryEmbedding", theta=theta, style=style,
                      rotary_dim=rotary_dim, implementation=implementation)
    self.theta, self.style, self.rotary_dim = theta, style, rotary_dim
    self.implementation = implementation

  def __call__(self, x, positions):
    return jaxops.rope(x, positions, theta=self.theta, style=self.style,
                       rotary_dim=self.rotary_dim, implementation=self.implementation)


_MHA = "jaxops.flax.nnx.MultiHeadAttention"


class MultiHeadAttention(nnx.Module):
  """Multi-head attention on ``jaxops.attention`` (fused flash-attention kernel).

  Submodules and parameters are those of ``flax.nnx.MultiHeadAttention``
  (LinearGeneral ``query``, ``key``, ``value``, ``out``), so its parameters
  transfer unchanged, grouped-query attention (``num_kv_heads``) included.

  Differences from Flax's module: dropout (``dropout_rate``) applies to the
  attention output, not to the attention weights (which the kernel never
  stores); ``is_causal`` masks without building a mask; ``rope(x, positions)``,
  if given, is applied to the projected query (positions query_offset + t) and
  key (positions j); a query row with no attended key gives 0.

  KV-cache decoding: pass ``kv_cache=(keys, values)``, each [batch, S_max,
  num_kv_heads, head_dim] (zeros to start), and the new tokens' absolute
  position as ``query_offset``; the call writes the new keys and values into
  the cache, attends over the cached prefix and returns ``(output, kv_cache)``.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, is_causal: bool = False,
               rope: Callable[[Any, Any], Any] | None = None, dropout_rate: float = 0.0,
               deterministic: bool | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: Initializer = nnx.nn.linear.default_kernel_init,
               out_kernel_init: Initializer | None = None,
               bias_init: Initializer = nnx.initializers.zeros_init(),
               out_bias_init: Initializer | None = None, use_bias: bool = True,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.num_kv_heads, self.head_dim = _arguments.attention_heads(
        _MHA, qkv_features=qkv_features or in_features, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dropout_rate=dropout_rate, is_causal=is_causal,
        implementation=implementation)
    self.is_causal, self.rope, self.implementation = is_causal, rope, implementation
    self.deterministic = deterministic
    linear = lambda in_f, heads: nnx.LinearGeneral(
        in_f, (heads, self.head_dim), dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    kv_in = in_kv_features or in_features
    self.query = linear(in_features, num_heads)
    self.key = linear(kv_in, self.num_kv_heads)
    self.value = linear(kv_in, self.num_kv_heads)
    self.out = nnx.LinearGeneral(
        (num_heads, self.head_dim), out_features or in_features, axis=(-2, -1), dtype=dtype,
        param_dtype=param_dtype, kernel_init=out_kernel_init or kernel_init,
        bias_init=out_bias_init or bias_init, use_bias=use_bias, rngs=rngs)
    self.dropout = (nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=rngs)
                    if dropout_rate > 0.0 else None)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
               query_offset=0, kv_cache=None, deterministic: bool | None = None):
    """Attends from ``inputs_q`` [batch..., T, F] to ``inputs_k``/``inputs_v``
    [batch..., S, F] (default: ``inputs_q``). ``mask`` (bool) and ``bias`` are
    broadcastable to [batch..., heads, T, S]; ``query_offset`` places query row 0
    (for ``is_causal`` and RoPE; may be traced). With ``kv_cache`` (see the
    class docstring) returns ``(output, kv_cache)``."""
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if kv_cache is not None:
      _arguments.no_mask_with_cache(_MHA, mask, bias)
      x, kv_cache = attend_cached(query, key, value, kv_cache, query_offset=query_offset,
                                  is_causal=self.is_causal, rope=self.rope,
                                  implementation=self.implementation)
    else:
      x = attend(query, key, value, bias, mask, is_causal=self.is_causal,
                 query_offset=query_offset, rope=self.rope, implementation=self.implementation)
    out = self.out(x)
    if self.dropout is not None:
      out = self.dropout(out, deterministic=deterministic)
    return out if kv_cache is None else (out, kv_cache)


def _value(param):
  return None if param is None else param[...]
