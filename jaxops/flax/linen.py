"""Flax linen modules on jaxops kernels (drop-in for the ``flax.linen`` ones)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

import jaxops
from jaxops.flax import _arguments
from jaxops.flax._attention import attend, attend_cached
from jaxops.flax._attention import dot_product_attention  # noqa: F401  (an attention_fn for Flax)
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
    _arguments.norm("jaxops.flax.linen.LayerNorm", epsilon=self.epsilon,
                    implementation=self.implementation)
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
    _arguments.norm("jaxops.flax.linen.RMSNorm", epsilon=self.epsilon,
                    implementation=self.implementation)
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
    _arguments.embed("jaxops.flax.linen.Embed", num_embeddings=self.num_embeddings,
                     features=self.features, implementation=self.implementation)
    self.embedding = self.param("embedding", self.embedding_init,
                                (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, inputs):
    inputs = _arguments.embed_ids("jaxops.flax.linen.Embed", inputs)
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
    gated = _arguments.gated_activation("jaxops.flax.linen.GatedMLP", self.activation)
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
    _arguments.rotary("jaxops.flax.linen.RotaryEmbedding", theta=self.theta, style=self.style,
                      rotary_dim=self.rotary_dim, implementation=self.implementation)
    return jaxops.rope(x, positions, theta=self.theta, style=self.style,
                       rotary_dim=self.rotary_dim, implementation=self.implementation)


_MHA = "jaxops.flax.linen.MultiHeadAttention"


class MultiHeadAttention(nn.Module):
  """Multi-head attention on ``jaxops.attention`` (fused flash-attention kernel).

  Parameters are those of ``flax.linen.MultiHeadDotProductAttention`` (Dense
  ``query``, ``key``, ``value`` [features, heads, head_dim] and ``out``), so
  its checkpoints load unchanged; with ``num_kv_heads`` < ``num_heads``
  (grouped-query attention) ``key``/``value`` have ``num_kv_heads`` heads.

  Differences from Flax's module: dropout (``dropout_rate``) applies to the
  attention output, not to the attention weights (which the kernel never
  stores); ``is_causal`` masks without building a mask; ``rope(x, positions)``,
  if given, is applied to the projected query (positions query_offset + t) and
  key (positions j); a query row with no attended key gives 0.

  KV-cache decoding: pass ``kv_cache=(keys, values)``, each [batch, S_max,
  num_kv_heads, head_dim] (zeros to start), and the new tokens' absolute
  position as ``query_offset``; the call writes the new keys and values into
  the cache, attends over the cached prefix and returns ``(output, kv_cache)``.

  Attributes:
    num_heads: query heads.
    num_kv_heads: key/value heads (default ``num_heads``); divides ``num_heads``.
    qkv_features: query features over all heads (default: the input's).
    out_features: output features (default: the query input's).
    is_causal, rope, dropout_rate, deterministic: see above.
    dtype, param_dtype, kernel_init, out_kernel_init, bias_init, out_bias_init,
      use_bias: as in Flax.
    implementation: passed to ``jaxops.attention``.
  """

  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  out_features: int | None = None
  is_causal: bool = False
  rope: Callable[[Any, Any], Any] | None = None
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = nn.linear.default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  out_bias_init: Initializer | None = None
  use_bias: bool = True
  implementation: str | None = None

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
               query_offset=0, kv_cache=None, deterministic: bool | None = None, dropout_rng=None):
    """Attends from ``inputs_q`` [batch..., T, F] to ``inputs_k``/``inputs_v``
    [batch..., S, F] (default: ``inputs_q``). ``mask`` (bool) and ``bias`` are
    broadcastable to [batch..., heads, T, S]; ``query_offset`` places query row 0
    (for ``is_causal`` and RoPE; may be traced). With ``kv_cache`` (see the
    class docstring) returns ``(output, kv_cache)``."""
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    num_kv_heads, head_dim = _arguments.attention_heads(
        _MHA, qkv_features=self.qkv_features or inputs_q.shape[-1], num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, dropout_rate=self.dropout_rate,
        is_causal=self.is_causal, implementation=self.implementation)
    dense = lambda heads, name: nn.DenseGeneral(
        features=(heads, head_dim), axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias, name=name)
    query = dense(self.num_heads, "query")(inputs_q)
    key = dense(num_kv_heads, "key")(inputs_k)
    value = dense(num_kv_heads, "value")(inputs_v)
    if kv_cache is not None:
      _arguments.no_mask_with_cache(_MHA, mask, bias)
      x, kv_cache = attend_cached(query, key, value, kv_cache, query_offset=query_offset,
                                  is_causal=self.is_causal, rope=self.rope,
                                  implementation=self.implementation)
    else:
      x = attend(query, key, value, bias, mask, is_causal=self.is_causal,
                 query_offset=query_offset, rope=self.rope, implementation=self.implementation)
    out = nn.DenseGeneral(
        features=self.out_features or inputs_q.shape[-1], axis=(-2, -1), dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, name="out")(x)
    if self.dropout_rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      out = nn.Dropout(rate=self.dropout_rate)(out, deterministic=deterministic, rng=dropout_rng)
    return out if kv_cache is None else (out, kv_cache)
