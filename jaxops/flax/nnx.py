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


def _value(param):
  return None if param is None else param[...]
