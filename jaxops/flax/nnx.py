"""Flax NNX modules on jaxops kernels (drop-in for the ``flax.nnx`` ones)."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxops
from jaxops.flax import _arguments
from jaxops.flax._attention import (attend_cached, context_parallel_arguments, model_features,
                                     nnx_causality, only_on_jaxops, rotate,
                                     self_attention_inputs)
from jaxops.flax._attention import nnx_dot_product_attention as dot_product_attention
from jaxops.flax._dtypes import is_kernel_dtype
from jaxops.flax._norms import runs_kernel
from jaxops.flax._signature import bind, extended
from jaxops.flax._patch_embed import NnxPatchEmbed as PatchEmbed  # noqa: F401
from jaxops.flax._sparse import NnxSparseDense as SparseDense, SparseMetadata  # noqa: F401

Initializer = Callable[..., Any]

_LAYER_NORM = extended(nnx.LayerNorm.__init__, implementation=None)
_RMS_NORM = extended(nnx.RMSNorm.__init__, implementation=None)
_EMBED = extended(nnx.Embed.__init__, implementation=None)


class LayerNorm(nnx.LayerNorm):
  """``flax.nnx.LayerNorm`` on ``jaxops.layer_norm``: a subclass taking every
  constructor argument of Flax's (same defaults) plus ``implementation``, with
  Flax's parameters and call (``x, *, mask=None``). The kernel runs on the last
  axis; every other configuration runs Flax's own computation (see
  :class:`jaxops.flax.linen.LayerNorm`). ``promote_dtype`` is applied as Flax
  applies it.

  Examples:
    >>> from flax import nnx
    >>> import jaxops.flax.nnx as jnnx
    >>> norm = jnnx.LayerNorm(4, rngs=nnx.Rngs(0))
    >>> norm(jnp.array([[1.0, 2.0, 3.0, 4.0]]))
    Array([[-1.341..., -0.447..., 0.447..., 1.341...]], dtype=float32)
  """

  def __init__(self, *args, implementation=None, **kwargs):
    arguments = bind(_LAYER_NORM, self, *args, implementation=implementation, **kwargs)
    _arguments.norm("jaxops.flax.nnx.LayerNorm", num_features=arguments["num_features"],
                    epsilon=arguments["epsilon"], implementation=implementation)
    super().__init__(*args, **kwargs)
    self.implementation = implementation

  __init__.__signature__ = _LAYER_NORM

  def __call__(self, x, *, mask=None):
    x_promoted, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                                 dtype=self.dtype)
    if not runs_kernel(self, x, x_promoted.dtype, mask):
      return super().__call__(x, mask=mask)
    return jaxops.layer_norm(x_promoted, scale, bias, epsilon=self.epsilon,
                             implementation=self.implementation)


class RMSNorm(nnx.RMSNorm):
  """``flax.nnx.RMSNorm`` on ``jaxops.rms_norm``: every constructor argument
  of Flax's plus ``implementation``, and Flax's call (``x, mask=None``); the
  kernel and the fallback as for :class:`LayerNorm`.

  Examples:
    >>> from flax import nnx
    >>> import jaxops.flax.nnx as jnnx
    >>> jnnx.RMSNorm(2, rngs=nnx.Rngs(0))(jnp.array([[3.0, 4.0]]))
    Array([[0.848..., 1.131...]], dtype=float32)
  """

  def __init__(self, *args, implementation=None, **kwargs):
    arguments = bind(_RMS_NORM, self, *args, implementation=implementation, **kwargs)
    _arguments.norm("jaxops.flax.nnx.RMSNorm", num_features=arguments["num_features"],
                    epsilon=arguments["epsilon"], implementation=implementation)
    super().__init__(*args, **kwargs)
    self.implementation = implementation

  __init__.__signature__ = _RMS_NORM

  def __call__(self, x, mask=None):
    x_promoted, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
    if not runs_kernel(self, x, x_promoted.dtype, mask):
      return super().__call__(x, mask=mask)
    return jaxops.rms_norm(x_promoted, scale, epsilon=self.epsilon,
                           implementation=self.implementation)


class Embed(nnx.Embed):
  """``flax.nnx.Embed`` on ``jaxops.embedding``: every constructor argument of
  Flax's plus ``implementation``, the same parameter (``embedding``) and Flax's
  own ``attend``. ``out_sharding`` and float64/complex tables run Flax's
  ``jnp.take``. Out-of-range ids are clamped (see
  :class:`jaxops.flax.linen.Embed`).

  Examples:
    >>> from flax import nnx
    >>> import jaxops.flax.nnx as jnnx
    >>> embed = jnnx.Embed(num_embeddings=10, features=4, rngs=nnx.Rngs(0))
    >>> embed(jnp.array([[1, 2, 3]])).shape
    (1, 3, 4)
  """

  def __init__(self, *args, implementation=None, **kwargs):
    arguments = bind(_EMBED, self, *args, implementation=implementation, **kwargs)
    _arguments.embed("jaxops.flax.nnx.Embed", num_embeddings=arguments["num_embeddings"],
                     features=arguments["features"], implementation=implementation)
    super().__init__(*args, **kwargs)
    self.implementation = implementation

  __init__.__signature__ = _EMBED

  def __call__(self, inputs, out_sharding=None):
    inputs = _arguments.embed_ids("jaxops.flax.nnx.Embed", inputs)
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    if out_sharding is not None or not is_kernel_dtype(table.dtype):
      return super().__call__(inputs, out_sharding=out_sharding)
    return jaxops.embedding(table, inputs, implementation=self.implementation)


class GatedMLP(nnx.Module):
  """``down(act(gate(x)) * up(x))``, as :class:`jaxops.flax.linen.GatedMLP`:
  three ``nnx.Linear`` attributes ``gate``, ``up`` and ``down``.

  Examples:
    >>> from flax import nnx
    >>> import jaxops.flax.nnx as jnnx
    >>> mlp = jnnx.GatedMLP(8, 32, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8))).shape
    (2, 8)
  """

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
  """Rotary position embedding, as :class:`jaxops.flax.linen.RotaryEmbedding`.

  Examples:
    >>> import jaxops.flax.nnx as jnnx
    >>> jnnx.RotaryEmbedding()(jnp.ones((1, 2, 1, 4)), jnp.array([0, 1])).shape
    (1, 2, 1, 4)
  """

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
_MULTI_HEAD_ATTENTION = extended(
    nnx.MultiHeadAttention.__init__, attention_fn=dot_product_attention, is_causal=False,
    rope=None, implementation=None, logits_soft_cap=None, learnable_sinks=False,
    context_parallel_axis=None, context_parallel_layout="contiguous",
    context_parallel_strategy="ring")


class MultiHeadAttention(nnx.MultiHeadAttention):
  """``flax.nnx.MultiHeadAttention`` on ``jaxops.attention`` (fused
  flash-attention kernel): a subclass taking every constructor and call
  argument of Flax's, with Flax's submodules and parameters (LinearGeneral
  ``query``, ``key``, ``value``, ``out``; ``query_ln``/``key_ln``;
  grouped-query ``num_kv_heads``), dropout rngs and ``init_cache``/``decode``
  cache, so its state transfers unchanged.

  The one changed default is ``attention_fn``:
  :func:`jaxops.flax.nnx.dot_product_attention`, which runs the kernel and
  falls back to Flax's ``flax.nnx.dot_product_attention`` where the attention
  weights must exist (``sow_weights=True``: sown as ``nnx.Intermediate`` as
  with Flax; dropout on the weights) and for float64/complex. Any other
  ``attention_fn`` is called as Flax calls it.

  Beyond Flax: ``is_causal`` (constructor; Flax's call argument ``is_causal``
  works too), ``rope(x, positions)`` applied to the projected query (positions
  ``query_offset`` + t, or the cache index with ``decode``) and key, and the
  call arguments ``bias`` (added to the logits), ``query_offset`` (may be
  traced) and ``kv_cache=(keys, values)``: each [batch, S_max, num_kv_heads,
  head_dim] (zeros to start); the call writes the new keys and values at
  ``query_offset``, attends over the cached prefix and returns
  ``(output, kv_cache)``. ``decode`` left unset means False (Flax raises).
  ``logits_soft_cap`` (constructor) is ``jaxops.attention``'s soft cap;
  ``learnable_sinks=True`` gives the module a learnable per-head sink logit, the
  parameter ``sinks`` [num_heads] (zeros at init; gpt-oss); the call
  arguments ``query_segment_ids`` [batch..., T] and ``key_value_segment_ids``
  [batch..., S] (default: the query's, for self-attention) pack sequences.
  ``context_parallel_axis`` (constructor; with ``context_parallel_layout`` and
  ``context_parallel_strategy``): called inside ``jax.shard_map`` on this
  device's block of a sequence split over that mesh axis, the module attends
  by ``jaxops.ring_attention``, with ``rope``, ``is_causal`` and
  ``query_offset`` on global positions (as
  :class:`jaxops.flax.linen.MultiHeadDotProductAttention`'s; not with
  ``kv_cache``, ``decode``, ``sow_weights``, dropout on the weights or another
  ``attention_fn``).

  ``precision`` applies, as in Flax, to the projections and to the attention
  products (the kernel's float32 precision: docs/precision.md). On the kernel
  path a query row with no attended key gives 0 (Flax averages the values).
  """

  def __init__(self, *args, attention_fn=dot_product_attention, is_causal=False, rope=None,
               implementation=None, logits_soft_cap=None, learnable_sinks=False,
               context_parallel_axis=None, context_parallel_layout="contiguous",
               context_parallel_strategy="ring", **kwargs):
    a = bind(_MULTI_HEAD_ATTENTION, self, *args, attention_fn=attention_fn,
             is_causal=is_causal, rope=rope, implementation=implementation,
             logits_soft_cap=logits_soft_cap, learnable_sinks=learnable_sinks,
             context_parallel_axis=context_parallel_axis,
             context_parallel_layout=context_parallel_layout,
             context_parallel_strategy=context_parallel_strategy, **kwargs)
    _arguments.attention_heads(
        _MHA, qkv_features=a["qkv_features"] or a["in_features"], num_heads=a["num_heads"],
        num_kv_heads=a["num_kv_heads"], dropout_rate=a["dropout_rate"], is_causal=is_causal,
        implementation=implementation)
    context_parallel = _arguments.context_parallel(
        _MHA, axis=context_parallel_axis, layout=context_parallel_layout,
        strategy=context_parallel_strategy)
    super().__init__(*args, attention_fn=attention_fn, **kwargs)
    self.context_parallel = context_parallel
    self.is_causal, self.rope, self.implementation = is_causal, rope, implementation
    self.logits_soft_cap = logits_soft_cap
    self.sinks = (nnx.Param(jnp.zeros((a["num_heads"],), a["param_dtype"]))
                  if learnable_sinks else None)

  __init__.__signature__ = _MULTI_HEAD_ATTENTION

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic: bool | None = None, rngs=None, sow_weights: bool = False,
               decode: bool | None = None, is_causal: bool = False, out_sharding=None,
               qkv_sharding=None, bias=None, query_offset=0, kv_cache=None,
               query_segment_ids=None, key_value_segment_ids=None):
    """Flax's call plus ``bias``, ``query_offset``, ``kv_cache`` and the
    segment ids (see the class docstring)."""
    inputs_k, inputs_v = self_attention_inputs(inputs_q, inputs_k, inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"Incompatible input dimension, got {inputs_q.shape[-1]} "
                       f"but module expects {self.in_features}.")
    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    is_causal = is_causal or self.is_causal
    decode = decode if decode is not None else bool(self.decode)
    features = model_features(_MHA, self.logits_soft_cap, _value(self.sinks),
                              query_segment_ids, key_value_segment_ids, query.dtype)
    _arguments.no_context_parallel_with(_MHA, self.context_parallel, "kv_cache",
                                        kv_cache is not None)
    _arguments.no_context_parallel_with(_MHA, self.context_parallel, "decode", decode)
    if kv_cache is not None:
      _arguments.no_mask_with_cache(_MHA, mask, bias)
      _arguments.no_decode_with_cache(_MHA, decode)
      x, kv_cache = attend_cached(query, key, value, kv_cache, query_offset=query_offset,
                                  is_causal=is_causal, rope=self.rope,
                                  precision=self.precision, implementation=self.implementation,
                                  **features)
    else:
      if decode:
        query, key, value, mask, query_offset = self._decode_step(query, key, value, mask)
      else:
        query, key = rotate(self.rope, query, key, query_offset,
                            context_parallel=self.context_parallel)
      x = self._attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal,
                          query_offset=query_offset, deterministic=deterministic, rngs=rngs,
                          sow_weights=sow_weights, features=features)
    out = self.out(x, out_sharding=out_sharding)
    return out if kv_cache is None else (out, kv_cache)

  def _decode_step(self, query, key, value, mask):
    """Flax's ``decode``: the new token written into the cache made by
    ``init_cache`` at ``cache_index``; the mask hides rows not written yet.
    RoPE sees the token's position (the cache index)."""
    if self.cached_key is None or self.cached_value is None or self.cache_index is None:
      raise ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
    *batch, max_length, heads, depth = self.cached_key.shape
    if key.shape != (*batch, 1, heads, depth):
      raise ValueError("Autoregressive cache shape error, expected key shape "
                       f"{(*batch, 1, heads, depth)} instead got {key.shape}.")
    index = self.cache_index[...]
    query, key = rotate(self.rope, query, key, index, index)
    zero = jnp.zeros((), index.dtype)
    at = (zero,) * len(batch) + (index, zero, zero)
    self.cached_key[...] = lax.dynamic_update_slice(self.cached_key[...], key, at)
    self.cached_value[...] = lax.dynamic_update_slice(self.cached_value[...], value, at)
    self.cache_index[...] += 1
    written = jnp.broadcast_to(jnp.arange(max_length) <= index, (*batch, 1, 1, max_length))
    return (query, self.cached_key[...], self.cached_value[...],
            nnx.combine_masks(mask, written), index)

  def _attention(self, query, key, value, *, mask, bias, is_causal, query_offset, deterministic,
                 rngs, sow_weights, features):
    """``attention_fn`` with the arguments Flax gives it (dropout rng and
    ``deterministic`` resolved as Flax resolves them); jaxops' own also gets
    ``bias``, ``query_offset`` and ``implementation``."""
    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = deterministic if deterministic is not None else self.deterministic
      if deterministic is None:
        raise ValueError("No `deterministic` argument was provided to MultiHeadAttention "
                         "as either a __call__ argument, class attribute, or nnx.flag.")
      if not deterministic:
        rngs = self.rngs if rngs is None else rngs
        if rngs is None:
          raise ValueError("'rngs' must be provided to __call__ method if "
                           "MultiHeadAttention instance is defined with keep_rngs=False.")
        dropout_rng = rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs()
    else:
      deterministic = True
    kwargs = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                  broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
                  dtype=self.dtype, precision=self.precision,
                  module=self if sow_weights else None)
    if self.attention_fn is dot_product_attention:
      return dot_product_attention(query, key, value, bias=bias, is_causal=is_causal,
                                   query_offset=query_offset,
                                   implementation=self.implementation, **kwargs, **features,
                                   **context_parallel_arguments(self.context_parallel))
    only_on_jaxops(_MHA, features)
    _arguments.no_context_parallel_with(_MHA, self.context_parallel, "another attention_fn",
                                        True)
    kwargs["mask"], is_causal = nnx_causality(query, key, mask, is_causal, query_offset)
    if bias is not None:
      kwargs["bias"] = bias
    return self.attention_fn(query, key, value, is_causal=is_causal, **kwargs)


def _value(param):
  return None if param is None else param[...]
