"""Pure ``jax.numpy`` references of every jaxops operator.

These are the specification each kernel is tested against, and what
``implementation="xla"`` runs. They compute in float32 and return the input
dtype, as the kernels do.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def _as_f32_or(param, default):
  return default if param is None else param.astype(_F32)


# -- normalization ---------------------------------------------------------------


def layer_norm_with_stats(x, weight=None, bias=None, *, epsilon=1e-5):
  """Layer norm over the last axis; also returns the float32 mean and rstd."""
  xf = x.astype(_F32)
  mean = jnp.mean(xf, axis=-1)
  centered = xf - mean[..., None]
  rstd = lax.rsqrt(jnp.mean(centered * centered, axis=-1) + epsilon)
  y = centered * rstd[..., None] * _as_f32_or(weight, 1.0) + _as_f32_or(bias, 0.0)
  return y.astype(x.dtype), mean, rstd


def layer_norm(x, weight=None, bias=None, *, epsilon=1e-5):
  return layer_norm_with_stats(x, weight, bias, epsilon=epsilon)[0]


def rms_norm_with_stats(x, weight=None, *, epsilon=1e-6):
  """RMS norm over the last axis; also returns the float32 rstd."""
  xf = x.astype(_F32)
  rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1) + epsilon)
  y = xf * rstd[..., None] * _as_f32_or(weight, 1.0)
  return y.astype(x.dtype), rstd


def rms_norm(x, weight=None, *, epsilon=1e-6):
  return rms_norm_with_stats(x, weight, epsilon=epsilon)[0]


def add_rms_norm(x, residual, weight=None, *, epsilon=1e-6):
  """``(rms_norm(x + residual) * weight, x + residual)``; the sum in x's dtype."""
  h = x + residual
  return rms_norm(h, weight, epsilon=epsilon), h
