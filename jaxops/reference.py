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


# -- softmax family -----------------------------------------------------------------
#
# A column is visible when `where` allows it and x + bias there is not -inf.
# Invisible columns give probability 0 / log-probability -inf and receive no
# gradient; a row without a visible column is all 0 / all -inf, never NaN.
# A NaN among the visible columns makes its whole row NaN.


def _visible_logits(x, where, bias):
  z = x.astype(_F32)
  if bias is not None:
    z = z + bias.astype(_F32)
  visible = z != -jnp.inf
  if where is not None:
    visible = visible & where
  return z, visible


def _softmax_parts(x, axis, where, bias):
  """(z - m over visible columns else 0, visible, sum of exp) with m the row max."""
  z, visible = _visible_logits(x, where, bias)
  m = jnp.max(jnp.where(visible, z, -jnp.inf), axis=axis, keepdims=True, initial=-jnp.inf)
  m = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
  # where() inside exp as well as outside: an invisible +inf or NaN must not
  # reach exp, or its (unused) derivative would turn the gradient into NaN.
  shifted = jnp.where(visible, z - m, 0.0)
  total = jnp.sum(jnp.where(visible, jnp.exp(shifted), 0.0), axis=axis, keepdims=True)
  return shifted, visible, total


def softmax(x, axis=-1, *, where=None, bias=None):
  """softmax(x + bias) along ``axis`` over the columns ``where`` allows."""
  shifted, visible, total = _softmax_parts(x, axis, where, bias)
  y = jnp.where(visible, jnp.exp(shifted), 0.0) / jnp.where(total == 0.0, 1.0, total)
  return y.astype(x.dtype)


def log_softmax(x, axis=-1, *, where=None, bias=None):
  """log_softmax(x + bias) along ``axis``; -inf where invisible."""
  shifted, visible, total = _softmax_parts(x, axis, where, bias)
  y = jnp.where(visible, shifted - jnp.log(jnp.where(total == 0.0, 1.0, total)), -jnp.inf)
  return y.astype(x.dtype)


def causal_mask(queries, keys, query_offset=0):
  """[queries, keys] boolean: query i sees keys j <= i + query_offset."""
  return (jnp.arange(keys)[None, :] <= jnp.arange(queries)[:, None] + query_offset)


def causal_softmax(x, *, query_offset=0):
  """softmax over the last axis with query i (axis -2) seeing keys j <= i + query_offset."""
  return softmax(x, where=causal_mask(x.shape[-2], x.shape[-1], query_offset))
