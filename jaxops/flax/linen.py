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
