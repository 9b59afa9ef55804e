"""Pure ``jax.numpy`` references of every jaxops operator.

These are the specification each kernel is tested against, and what
``implementation="xla"`` runs. They compute in float32 and return the input
dtype, as the kernels do.
"""

from __future__ import annotations

import jax
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


# -- cross-entropy ------------------------------------------------------------------
#
# Per token, with lse = logsumexp(logits) and eps = label_smoothing:
#   (1 - eps) * (lse - logits[label]) + eps * (lse - mean(logits)) + z_loss * lse**2
# A token labelled ignore_index has loss 0 and no gradient and is not counted by
# the mean; any other label outside [0, vocab) gives that token a NaN loss (so a
# mean or sum is NaN) and no gradient, and is counted.


def cross_entropy_per_token(logits, labels, *, ignore_index=-100, label_smoothing=0.0,
                            z_loss=0.0):
  """Per-token float32 losses and logsumexps (lse is 0 where the loss is not computed)."""
  vocab = logits.shape[-1]
  active = labels != ignore_index
  in_range = (labels >= 0) & (labels < vocab)
  computed = active & in_range
  # Rows that are not computed are zeroed first, so that whatever they hold
  # cannot leak a NaN into the gradient through the unused branch.
  x = jnp.where(computed[..., None], logits.astype(_F32), 0.0)
  lse = jax.nn.logsumexp(x, axis=-1)
  picked = jnp.take_along_axis(x, jnp.where(computed, labels, 0)[..., None], axis=-1)[..., 0]
  eps = label_smoothing
  loss = (1.0 - eps) * (lse - picked) + eps * (lse - jnp.mean(x, axis=-1)) + z_loss * lse * lse
  loss = jnp.where(computed, loss, jnp.where(active, jnp.nan, 0.0))
  return loss, jnp.where(computed, lse, 0.0)


def reduce_loss(loss, labels, ignore_index, reduction):
  """'none': per token; 'sum'; 'mean': over the tokens whose label is not ignore_index."""
  if reduction == "none":
    return loss
  total = jnp.sum(loss)
  if reduction == "sum":
    return total
  count = jnp.sum(labels != ignore_index)
  return total / jnp.maximum(count, 1).astype(_F32)


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  reduction="mean"):
  """Cross-entropy of logits [..., vocab] against integer labels [...], in logits' dtype."""
  loss, _ = cross_entropy_per_token(logits, labels, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, z_loss=z_loss)
  return reduce_loss(loss, labels, ignore_index, reduction).astype(logits.dtype)


def linear_cross_entropy(x, weight, labels, *, bias=None, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, reduction="mean"):
  """cross_entropy(x @ weight + bias, labels), the logits in float32; x's dtype out."""
  logits = jnp.matmul(x, weight, precision=lax.Precision.HIGHEST, preferred_element_type=_F32)
  if bias is not None:
    logits = logits + bias.astype(_F32)
  loss, _ = cross_entropy_per_token(logits, labels, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, z_loss=z_loss)
  return reduce_loss(loss, labels, ignore_index, reduction).astype(x.dtype)
