"""Argument checks of the linen and nnx wrappers, on the rules of
``jaxops._src.validation`` and under the module's own name
(``jaxops.flax.nnx.LayerNorm: epsilon must be >= 0.0, got -1.0``).

nnx modules check their configuration when they are built; linen modules when
they are called, since Flax builds and clones linen dataclasses freely (a
partially configured one is not an error until it runs). The ops check the
arguments again under their own name: the wrapper's check only says which
module was misconfigured.
"""

from __future__ import annotations

import jaxops
from jaxops._src import validation
from jaxops._src.primitive import IMPLEMENTATIONS


def _implementation(op, value):
  return validation.choice(op, "implementation", value, IMPLEMENTATIONS)


def norm(op, *, epsilon, implementation, num_features=None):
  """LayerNorm and RMSNorm."""
  if num_features is not None:
    validation.positive_int(op, "num_features", num_features)
  validation.static_float(op, "epsilon", epsilon, low=0.0)
  _implementation(op, implementation)


def embed(op, *, num_embeddings, features, implementation):
  validation.positive_int(op, "num_embeddings", num_embeddings)
  validation.non_negative_int(op, "features", features)
  _implementation(op, implementation)


def embed_ids(op, inputs):
  return validation.integer_array(op, "inputs", inputs)


def gated_activation(op, activation):
  """The fused gate of a GatedMLP: jaxops.swiglu or jaxops.geglu."""
  activation = validation.choice(op, "activation", activation, ("swiglu", "geglu"))
  return jaxops.swiglu if activation == "swiglu" else jaxops.geglu


def rotary(op, *, theta, style, rotary_dim, implementation):
  """RotaryEmbedding's options; rotary_dim's upper bound (head_dim) is checked
  by jaxops.rope once x is known."""
  validation.static_float(op, "theta", theta, low=0.0, low_open=True)
  validation.choice(op, "style", style, ("neox", "gptj"))
  if rotary_dim is not None:
    validation.static_int(op, "rotary_dim", rotary_dim, low=2)
  _implementation(op, implementation)


def attention_heads(op, *, qkv_features, num_heads, num_kv_heads, dropout_rate, is_causal,
                    implementation):
  """MultiHeadAttention's options; returns (num_kv_heads, head_dim)."""
  num_heads = validation.positive_int(op, "num_heads", num_heads)
  num_kv_heads = (num_heads if num_kv_heads is None
                  else validation.positive_int(op, "num_kv_heads", num_kv_heads))
  qkv_features = validation.positive_int(op, "qkv_features", qkv_features)
  if qkv_features % num_heads:
    raise validation.value_error(op, "num_heads", f"divide qkv_features = {qkv_features}",
                                 str(num_heads))
  if num_heads % num_kv_heads:
    raise validation.value_error(op, "num_kv_heads", f"divide num_heads = {num_heads}",
                                 str(num_kv_heads))
  validation.static_float(op, "dropout_rate", dropout_rate, low=0.0, high=1.0)
  validation.static_bool(op, "is_causal", is_causal)
  _implementation(op, implementation)
  return num_kv_heads, qkv_features // num_heads


def no_mask_with_cache(op, mask, bias):
  """kv_cache decoding masks by the cache length and is_causal: a mask or bias
  shaped for the whole sequence has no meaning there."""
  for name, value in (("mask", mask), ("bias", bias)):
    if value is not None:
      raise validation.value_error(op, name, "be None with kv_cache", validation.describe(value))


def no_decode_with_cache(op, decode):
  """``kv_cache`` (jaxops' cache, passed in and returned) and Flax's ``decode``
  (the cache kept in the module's variables) are two caches: one at a time."""
  if decode:
    raise validation.value_error(op, "decode", "be False with kv_cache", repr(decode))


def context_parallel(op, *, axis, layout, strategy):
  """The context-parallel options of an attention module: None (attention on
  the whole sequence, the default) or ``jaxops.ring_attention``'s axis_name,
  layout and strategy, as a dict."""
  from jaxops._src.ring_attention import LAYOUTS, STRATEGIES
  layout = validation.choice(op, "context_parallel_layout", layout, LAYOUTS)
  strategy = validation.choice(op, "context_parallel_strategy", strategy, STRATEGIES)
  if axis is None:
    return None
  names = axis if isinstance(axis, tuple) else (axis,)
  if not names or not all(isinstance(name, str) for name in names):
    raise validation.type_error(op, "context_parallel_axis",
                                "be None, a mesh axis name (str) or a tuple of them",
                                validation.describe(axis))
  return dict(axis_name=axis, layout=layout, strategy=strategy)


def no_context_parallel_with(op, context_parallel, what, value):
  """Ring attention runs the fused kernels on blocks of one sequence: Flax's
  paths that need the whole attention weights, and the decode caches, have
  no ring form."""
  if context_parallel is not None and value:
    raise validation.value_error(
        op, "context_parallel_axis", f"be None with {what} (ring attention splits the "
        "sequence over devices; that path needs it whole)",
        repr(context_parallel["axis_name"]))
