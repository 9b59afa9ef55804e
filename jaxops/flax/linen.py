"""Flax linen modules on jaxops kernels (drop-in for the ``flax.linen`` ones)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

import jaxops
from jaxops.flax import _arguments
from jaxops.flax._attention import (attend_cached, context_parallel_arguments, flax_inputs,
                                     model_features, only_on_jaxops, rotate,
                                     self_attention_inputs)
from jaxops.flax._attention import linen_dot_product_attention as dot_product_attention
from jaxops.flax._dtypes import compute_dtype, is_kernel_dtype
from jaxops.flax._norms import runs_kernel
from jaxops.flax._patch_embed import LinenPatchEmbed as PatchEmbed  # noqa: F401
from jaxops.flax._sparse import LinenSparseDense as SparseDense  # noqa: F401

Initializer = Callable[..., Any]


class LayerNorm(nn.LayerNorm):
  """``flax.linen.LayerNorm`` on ``jaxops.layer_norm``: a subclass taking every
  attribute of Flax's (same defaults) plus ``implementation``, with Flax's
  parameters (``scale``, ``bias``) and call (``x, *, mask=None``).

  The kernel normalises the last axis with float32 statistics. Any other
  configuration runs Flax's own computation on the same parameters (same
  values and trees): ``reduction_axes``/``feature_axes`` other than the last
  axis, a ``mask``, ``axis_name`` (statistics across devices),
  ``force_float32_reductions=False``, float64 or complex inputs.
  ``use_fast_variance`` does not change the kernel, whose variance is exact up
  to float32 rounding.

  Examples:
    >>> import jaxops.flax.linen as jnn
    >>> norm = jnn.LayerNorm()
    >>> variables = norm.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> jax.tree.map(jnp.shape, variables)
    {'params': {'bias': (4,), 'scale': (4,)}}
    >>> norm.apply(variables, jnp.array([[1.0, 2.0, 3.0, 4.0]]))
    Array([[-1.341..., -0.447..., 0.447..., 1.341...]], dtype=float32)
  """

  implementation: str | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    _arguments.norm("jaxops.flax.linen.LayerNorm", epsilon=self.epsilon,
                    implementation=self.implementation)
    dtype = compute_dtype(x, self.dtype, self.param_dtype, self.use_scale or self.use_bias)
    if not runs_kernel(self, x, dtype, mask):
      return super().__call__(x, mask=mask)
    param = lambda name, init: self.param(name, init, (x.shape[-1],), self.param_dtype)
    scale = param("scale", self.scale_init) if self.use_scale else None
    bias = param("bias", self.bias_init) if self.use_bias else None
    return jaxops.layer_norm(x.astype(dtype), scale, bias, epsilon=self.epsilon,
                             implementation=self.implementation)


class RMSNorm(nn.RMSNorm):
  """``flax.linen.RMSNorm`` on ``jaxops.rms_norm``: every attribute of Flax's
  plus ``implementation``; the kernel and Flax's fallback as for
  :class:`LayerNorm`.

  Examples:
    >>> import jaxops.flax.linen as jnn
    >>> norm = jnn.RMSNorm()
    >>> variables = norm.init(jax.random.key(0), jnp.ones((1, 2)))
    >>> norm.apply(variables, jnp.array([[3.0, 4.0]]))
    Array([[0.848..., 1.131...]], dtype=float32)
  """

  implementation: str | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    _arguments.norm("jaxops.flax.linen.RMSNorm", epsilon=self.epsilon,
                    implementation=self.implementation)
    dtype = compute_dtype(x, self.dtype, self.param_dtype, self.use_scale)
    if not runs_kernel(self, x, dtype, mask):
      return super().__call__(x, mask=mask)
    scale = (self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
             if self.use_scale else None)
    return jaxops.rms_norm(x.astype(dtype), scale, epsilon=self.epsilon,
                           implementation=self.implementation)


class Embed(nn.Embed):
  """``flax.linen.Embed`` on ``jaxops.embedding``: every attribute of Flax's
  (``promote_dtype`` included) plus ``implementation``; the same parameter
  (``embedding``, shape ``(num_embeddings, features)``) and Flax's own ``attend``.
  Tables in float64 or complex run Flax's ``jnp.take``.

  One difference: out-of-range ids (negative ones included) are clamped to
  ``[0, num_embeddings - 1]`` (see :func:`jaxops.embedding`), where Flax's
  ``jnp.take`` returns NaN past the end and wraps negative ids around.
  Non-integer ids raise ``TypeError`` (Flax: ``ValueError``).

  Examples:
    >>> import jaxops.flax.linen as jnn
    >>> embed = jnn.Embed(num_embeddings=10, features=4)
    >>> variables = embed.init(jax.random.key(0), jnp.array([1, 2]))
    >>> embed.apply(variables, jnp.array([[1, 2, 3]])).shape
    (1, 3, 4)
  """

  implementation: str | None = None

  def setup(self):
    _arguments.embed("jaxops.flax.linen.Embed", num_embeddings=self.num_embeddings,
                     features=self.features, implementation=self.implementation)
    super().setup()

  def __call__(self, inputs):
    inputs = _arguments.embed_ids("jaxops.flax.linen.Embed", inputs)
    (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    if not is_kernel_dtype(table.dtype):
      return super().__call__(inputs)
    return jaxops.embedding(table, inputs, implementation=self.implementation)


class GatedMLP(nn.Module):
  """The gated feed-forward block of Llama / PaLM style transformers:
  ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (``"swiglu"``) or GELU
  (``"geglu"``, tanh form), the gating fused in ``jaxops.swiglu`` /
  ``jaxops.geglu``.

  Flax has no such module; its parameters are three ``nn.Dense`` submodules
  named ``gate``, ``up`` (``features -> hidden_features``) and ``down``
  (``hidden_features -> out_features``, default: the input's features), each
  with ``kernel`` (and ``bias`` when ``use_bias``).

  Examples:
    >>> import jaxops.flax.linen as jnn
    >>> mlp = jnn.GatedMLP(hidden_features=32)
    >>> variables = mlp.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> jax.tree.map(jnp.shape, variables["params"])
    {'down': {'kernel': (32, 8)}, 'gate': {'kernel': (8, 32)}, 'up': {'kernel': (8, 32)}}
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

  Examples:
    >>> import jaxops.flax.linen as jnn
    >>> x = jnp.ones((1, 2, 1, 4))                # [batch, seq, heads, head_dim]
    >>> jnn.RotaryEmbedding().apply({}, x, jnp.array([0, 1])).shape
    (1, 2, 1, 4)
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


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """``flax.linen.MultiHeadDotProductAttention`` on ``jaxops.attention`` (fused
  flash-attention kernel): a subclass taking every attribute and call argument
  of Flax's, with Flax's parameters (DenseGeneral ``query``, ``key``,
  ``value``, ``out``; ``query_ln``/``key_ln`` with ``normalize_qk``) and its
  ``cache`` collection with ``decode``, so checkpoints load unchanged.

  The one changed default is ``attention_fn``:
  :func:`jaxops.flax.linen.dot_product_attention`, which runs the kernel and
  falls back to Flax's ``flax.linen.dot_product_attention`` wherever the
  attention weights must exist: ``sow_weights=True`` (the weights land in
  ``intermediates`` as with Flax), dropout on the weights (``dropout_rate > 0``
  and not ``deterministic``: Flax's dropout, same rng, same values), custom
  einsums (``qk_attn_weights_einsum_cls``...), float64/complex. Any other
  ``attention_fn`` is called as Flax calls it.

  Beyond Flax (attributes after Flax's, call arguments after Flax's):

  - ``num_kv_heads``: grouped-query attention; ``key``/``value`` then have
    ``num_kv_heads`` heads (default ``num_heads``, Flax's layout).
  - ``is_causal``: masks without building a mask; ``query_offset`` (call,
    may be traced) places query row 0.
  - ``rope(x, positions)``: applied to the projected query (positions
    query_offset + t, or the cache index with ``decode``) and key.
  - ``bias`` (call): added to the attention logits.
  - ``kv_cache=(keys, values)`` (call): each [batch, S_max, num_kv_heads,
    head_dim] (zeros to start); the call writes the new keys and values at
    ``query_offset``, attends over the cached prefix and returns
    ``(output, kv_cache)``. Flax's ``decode`` (one token a call, the cache in
    the ``cache`` collection) works as in Flax.
  - ``implementation``: passed to ``jaxops.attention``.
  - ``logits_soft_cap``: ``jaxops.attention``'s soft cap (Gemma: 50.0).
  - ``learnable_sinks``: True gives the module a learnable per-head sink logit, the
    parameter ``sinks`` [num_heads] (zeros at init; gpt-oss).
  - ``query_segment_ids``, ``key_value_segment_ids`` (call): packed
    sequences, [batch..., T] and [batch..., S] (``key_value_segment_ids``
    defaults to ``query_segment_ids``, for self-attention).

  - ``context_parallel_axis`` (a mesh axis name, or a tuple of them): the
    module is called inside ``jax.shard_map`` on this device's block of a
    sequence split over that axis, and attends by ``jaxops.ring_attention``
    (``context_parallel_layout``: ``"contiguous"`` or ``"zigzag"``;
    ``context_parallel_strategy``: ``"ring"`` or ``"all_gather"``). ``rope``,
    ``is_causal`` and ``query_offset`` then act on global positions (this
    device's rows under the layout); a ``mask`` or ``bias`` covers the local
    query rows against every key, as ``jaxops.ring_attention`` takes them.
    Not with ``kv_cache``, ``decode``, ``sow_weights``, dropout on the weights,
    custom einsums or another ``attention_fn``.

  ``precision`` applies, as in Flax, to the projections and to the attention
  products (the kernel's float32 precision: docs/precision.md). On the kernel
  path a query row with no attended key gives 0 (Flax averages the values).
  """

  attention_fn: Callable[..., Any] = dot_product_attention
  num_kv_heads: int | None = None
  is_causal: bool = False
  rope: Callable[[Any, Any], Any] | None = None
  implementation: str | None = None
  logits_soft_cap: float | None = None
  learnable_sinks: bool = False
  context_parallel_axis: str | tuple[str, ...] | None = None
  context_parallel_layout: str = "contiguous"
  context_parallel_strategy: str = "ring"

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               deterministic: bool | None = None, dropout_rng=None, sow_weights: bool = False,
               bias=None, query_offset=0, kv_cache=None, query_segment_ids=None,
               key_value_segment_ids=None):
    """Flax's call (``inputs_q``, ``inputs_k``/``inputs_v`` default
    ``inputs_q``, ``mask`` broadcastable to [batch..., heads, T, S], ...) plus
    ``bias``, ``query_offset``, ``kv_cache`` and the segment ids (see the
    class docstring)."""
    inputs_k, inputs_v = self_attention_inputs(inputs_q, inputs_k, inputs_v, inputs_kv)
    num_kv_heads, head_dim = _arguments.attention_heads(
        _MHA, qkv_features=self.qkv_features or inputs_q.shape[-1], num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, dropout_rate=self.dropout_rate,
        is_causal=self.is_causal, implementation=self.implementation)
    context_parallel = _arguments.context_parallel(
        _MHA, axis=self.context_parallel_axis, layout=self.context_parallel_layout,
        strategy=self.context_parallel_strategy)
    _arguments.no_context_parallel_with(_MHA, context_parallel, "kv_cache", kv_cache is not None)
    _arguments.no_context_parallel_with(_MHA, context_parallel, "decode", self.decode)
    dense = lambda heads, name: nn.DenseGeneral(
        features=(heads, head_dim), axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls, name=name)
    query = dense(self.num_heads, "query")(inputs_q)
    key = dense(num_kv_heads, "key")(inputs_k)
    value = dense(num_kv_heads, "value")(inputs_v)
    if self.normalize_qk:
      norm = lambda name: LayerNorm(use_bias=False, dtype=self.dtype,
                                    param_dtype=self.param_dtype,
                                    implementation=self.implementation, name=name)
      query, key = norm("query_ln")(query), norm("key_ln")(key)
    sinks = (self.param("sinks", nn.initializers.zeros_init(), (self.num_heads,),
                        self.param_dtype) if self.learnable_sinks else None)
    features = model_features(_MHA, self.logits_soft_cap, sinks, query_segment_ids,
                              key_value_segment_ids, query.dtype)
    if kv_cache is not None:
      _arguments.no_mask_with_cache(_MHA, mask, bias)
      _arguments.no_decode_with_cache(_MHA, self.decode)
      x, kv_cache = attend_cached(query, key, value, kv_cache, query_offset=query_offset,
                                  is_causal=self.is_causal, rope=self.rope,
                                  precision=self.precision, implementation=self.implementation,
                                  **features)
    else:
      if self.decode:
        query, key, value, mask, query_offset = self._decode_step(query, key, value, mask)
      else:
        query, key = rotate(self.rope, query, key, query_offset,
                            context_parallel=context_parallel)
      x = self._attention(query, key, value, mask=mask, bias=bias, query_offset=query_offset,
                          deterministic=deterministic, dropout_rng=dropout_rng,
                          sow_weights=sow_weights, features=features,
                          context_parallel=context_parallel)
    out = nn.DenseGeneral(
        features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision, dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)
    return out if kv_cache is None else (out, kv_cache)

  def _decode_step(self, query, key, value, mask):
    """Flax's ``decode``: one new token written into the ``cache`` collection at
    ``cache_index``; the mask hides the rows not written yet. RoPE sees the
    token's position (the cache index). Returns the query, the whole cached
    keys/values, the mask and the query's position."""
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
    if not initialized:  # Flax's init pass: attend over the (rotated) inputs themselves
      return (*rotate(self.rope, query, key, 0), value, mask, 0)
    *batch, max_length, heads, depth = cached_key.value.shape
    if key.shape != (*batch, 1, heads, depth):
      raise ValueError("Autoregressive cache shape error, expected key shape "
                       f"{(*batch, 1, heads, depth)} instead got {key.shape}.")
    index = cache_index.value
    query, key = rotate(self.rope, query, key, index, index)
    zero = jnp.zeros((), index.dtype)
    at = (zero,) * len(batch) + (index, zero, zero)
    cached_key.value = lax.dynamic_update_slice(cached_key.value, key, at)
    cached_value.value = lax.dynamic_update_slice(cached_value.value, value, at)
    cache_index.value = index + 1
    written = jnp.broadcast_to(jnp.arange(max_length) <= index, (*batch, 1, 1, max_length))
    return (query, cached_key.value, cached_value.value, nn.combine_masks(mask, written), index)

  def _attention(self, query, key, value, *, mask, bias, query_offset, deterministic,
                 dropout_rng, sow_weights, features, context_parallel=None):
    """``attention_fn`` with Flax's arguments (dropout merged as Flax merges
    it); jaxops' own also gets grouped-query key/value, ``is_causal``,
    ``query_offset``, ``bias`` and ``implementation``."""
    if self.dropout_rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True
    einsums = dict(
        qk_attn_weights_einsum=(self.qk_attn_weights_einsum_cls()
                                if self.qk_attn_weights_einsum_cls else None),
        attn_weights_value_einsum=(self.attn_weights_value_einsum_cls()
                                   if self.attn_weights_value_einsum_cls else None))
    kwargs = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                  broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
                  dtype=self.dtype, precision=self.precision,
                  force_fp32_for_softmax=self.force_fp32_for_softmax, **einsums)
    if sow_weights:
      kwargs["module"] = self
    if self.attention_fn is dot_product_attention:
      return dot_product_attention(query, key, value, bias=bias, is_causal=self.is_causal,
                                   query_offset=query_offset,
                                   implementation=self.implementation, **kwargs, **features,
                                   **context_parallel_arguments(context_parallel))
    only_on_jaxops(_MHA, features)
    _arguments.no_context_parallel_with(_MHA, context_parallel, "another attention_fn", True)
    # Another attention_fn gets what Flax gives it: equal heads, causality as a mask.
    key, value, kwargs["mask"] = flax_inputs(query, key, value, mask, is_causal=self.is_causal,
                                             query_offset=query_offset)
    if bias is not None:
      kwargs["bias"] = bias
    accepted = inspect.signature(self.attention_fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted or k in ("module", "bias")}
    return self.attention_fn(query, key, value, **kwargs)


class MultiHeadAttention(MultiHeadDotProductAttention):
  """``flax.linen.MultiHeadAttention`` (Flax's alias of
  ``MultiHeadDotProductAttention``, named ``MultiHeadAttention_<i>`` by
  default) on jaxops: see :class:`MultiHeadDotProductAttention`."""


class SelfAttention(MultiHeadDotProductAttention):
  """``flax.linen.SelfAttention`` on jaxops: attention of ``inputs_q`` to
  itself, with Flax's call (``inputs_q, mask, deterministic, dropout_rng,
  sow_weights``) plus ``bias``, ``query_offset`` and ``kv_cache``; see
  :class:`MultiHeadDotProductAttention`. (Flax's warns that it will be
  deprecated; this one does not.)"""

  @nn.compact
  def __call__(self, inputs_q, mask=None, deterministic: bool | None = None, dropout_rng=None,
               sow_weights: bool = False, *, bias=None, query_offset=0, kv_cache=None):
    return super().__call__(inputs_q, mask=mask, deterministic=deterministic,
                            dropout_rng=dropout_rng, sow_weights=sow_weights, bias=bias,
                            query_offset=query_offset, kv_cache=kv_cache)
