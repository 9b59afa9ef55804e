"""Pure ``jax.numpy`` references of every jaxops operator.

These are the specification each kernel is tested against, and what
``implementation="xla"`` runs. They compute in float32 and return the input
dtype, as the kernels do, for float32, bfloat16 and float16 inputs; a float64
input (under ``jax.experimental.enable_x64``) computes in float64, and a
complex one, for the ops whose math has a complex form, in complex64 or
complex128 (see :func:`compute_dtype`): what ``implementation=None`` falls back
to for the dtypes the kernels lack.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32


def compute_dtype(*dtypes):
  """The dtype the references compute in: float32 for float32, bfloat16 and
  float16; float64, complex64 or complex128 when an input has that dtype."""
  return jnp.result_type(_F32, *(jnp.dtype(d) for d in dtypes))


def _real_dtype(dtype):
  """float32 for complex64, float64 for complex128, the dtype itself when real."""
  return jnp.finfo(dtype).dtype


def _abs_squared(x):
  """|x|^2, real (what Flax's norms use for complex inputs); x * x for real x."""
  return jnp.real(x * jnp.conj(x))


def _as_or(param, dtype, default):
  return default if param is None else param.astype(dtype)


# -- normalization ---------------------------------------------------------------


def layer_norm_with_stats(x, weight=None, bias=None, *, epsilon=1e-5):
  """Layer norm over the last axis; also returns the mean and rstd (float32
  for the kernels' dtypes). For complex x the variance is the mean of
  ``|x - mean|^2``, as Flax's LayerNorm computes it."""
  dtype = compute_dtype(x.dtype)
  xf = x.astype(dtype)
  mean = jnp.mean(xf, axis=-1)
  centered = xf - mean[..., None]
  rstd = lax.rsqrt(jnp.mean(_abs_squared(centered), axis=-1) + epsilon)
  y = centered * rstd[..., None] * _as_or(weight, dtype, 1.0) + _as_or(bias, dtype, 0.0)
  return y.astype(x.dtype), mean, rstd


def layer_norm(x, weight=None, bias=None, *, epsilon=1e-5):
  return layer_norm_with_stats(x, weight, bias, epsilon=epsilon)[0]


def rms_norm_with_stats(x, weight=None, *, epsilon=1e-6):
  """RMS norm over the last axis; also returns the rstd (float32 for the
  kernels' dtypes). For complex x the mean square is that of ``|x|``, as Flax's
  RMSNorm computes it."""
  dtype = compute_dtype(x.dtype)
  xf = x.astype(dtype)
  rstd = lax.rsqrt(jnp.mean(_abs_squared(xf), axis=-1) + epsilon)
  y = xf * rstd[..., None] * _as_or(weight, dtype, 1.0)
  return y.astype(x.dtype), rstd


def rms_norm(x, weight=None, *, epsilon=1e-6):
  return rms_norm_with_stats(x, weight, epsilon=epsilon)[0]


def add_rms_norm(x, residual, weight=None, *, epsilon=1e-6):
  """``(rms_norm(x + residual) * weight, x + residual)``; the sum in x's dtype."""
  h = x + residual
  return rms_norm(h, weight, epsilon=epsilon), h


# -- activations -----------------------------------------------------------------
# Elementwise; computed in float32 (or the wider input dtype), one rounding to the
# input dtype at the end. The tanh-approximate GELU and SiLU have a complex form
# (as jax.nn's); the exact GELU has not (erfc is real only).


def _gelu_f32(x, approximate):
  # x/2 (1 + tanh(u)) = x sigmoid(2u), and x/2 (1 + erf(x/sqrt2)) = x/2 erfc(-x/sqrt2):
  # the same functions, written without the cancellation of 1 + tanh / 1 + erf
  # for negative x, so that the reference (and its gradient) stays accurate in
  # relative terms on the negative tail, as the kernels are.
  # The cube is taken of x clipped to +-1e4: beyond, the logistic is already 1
  # or 0 exactly, and x^3 overflows from ~7e12 on, which made the gradient
  # 0 * inf = NaN there (at 1e30, say) where the function is x or 0. A complex
  # x has no order to clip by; its form is jax.nn's, unclipped.
  if approximate:
    clipped = x if jnp.iscomplexobj(x) else jnp.clip(x, -1e4, 1e4)
    inner = clipped + 0.044715 * clipped * clipped * clipped
    return x * lax.logistic(2.0 * math.sqrt(2.0 / math.pi) * inner)
  return 0.5 * x * lax.erfc(x * (-1.0 / math.sqrt(2.0)))


def _silu_f32(x):
  return x * lax.logistic(x)


def gelu(x, approximate=True):
  """GELU: ``x * Phi(x)``, or its tanh approximation when ``approximate``."""
  return _gelu_f32(x.astype(compute_dtype(x.dtype)), approximate).astype(x.dtype)


def silu(x):
  """SiLU (swish): ``x * sigmoid(x)``."""
  return _silu_f32(x.astype(compute_dtype(x.dtype))).astype(x.dtype)


def swiglu(gate, up):
  """``silu(gate) * up``, rounded once."""
  dtype = compute_dtype(gate.dtype, up.dtype)
  return (_silu_f32(gate.astype(dtype)) * up.astype(dtype)).astype(gate.dtype)


def geglu(gate, up, approximate=True):
  """``gelu(gate, approximate) * up``, rounded once."""
  dtype = compute_dtype(gate.dtype, up.dtype)
  return (_gelu_f32(gate.astype(dtype), approximate) * up.astype(dtype)).astype(gate.dtype)


# -- rotary position embedding ---------------------------------------------------


def rope_frequencies(rotary_dim, theta):
  """theta^(-2i / rotary_dim) for i < rotary_dim / 2: evaluated in float64,
  rounded to float32 (a constant of the op, the same in every implementation)."""
  exponents = -np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
  return np.power(np.float64(theta), exponents).astype(np.float32)


def rope(x, positions, *, theta=10000.0, style="neox", rotary_dim=None, inverse=False):
  """Rotary position embedding of x [batch, seq, heads, head_dim].

  Pair i of the first ``rotary_dim`` features (default: all) is rotated by the
  float32 angle ``float32(position) * rope_frequencies(rotary_dim, theta)[i]``;
  the pairs are ``(i, i + rotary_dim/2)`` for ``style="neox"`` and
  ``(2i, 2i + 1)`` for ``style="gptj"``; the other features pass through.
  ``positions`` is [seq] or [batch, seq]; ``inverse`` rotates backwards.
  The rotation is real-linear: complex x rotates its real and imaginary parts
  alike; float64 and complex128 x take the cosine and sine of that float32
  angle in float64.
  """
  head_dim = x.shape[-1]
  rotary_dim = head_dim if rotary_dim is None else rotary_dim
  half = rotary_dim // 2
  positions = jnp.asarray(positions)
  if positions.ndim == 1:
    positions = positions[None]
  angle = positions.astype(_F32)[:, :, None, None] * rope_frequencies(rotary_dim, theta)
  dtype = compute_dtype(x.dtype)
  angle = angle.astype(_real_dtype(dtype))
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  if inverse:
    sin = -sin
  xf = x.astype(dtype)
  rotated, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
  if style == "neox":
    x1, x2 = rotated[..., :half], rotated[..., half:]
  else:
    x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
  y1 = x1 * cos - x2 * sin
  y2 = x2 * cos + x1 * sin
  if style == "neox":
    rotated = jnp.concatenate([y1, y2], axis=-1)
  else:
    rotated = jnp.stack([y1, y2], axis=-1).reshape(rotated.shape)
  return jnp.concatenate([rotated, rest], axis=-1).astype(x.dtype)


# -- embedding -------------------------------------------------------------------


def embedding(table, ids):
  """Rows ``table[ids]`` (shape ``ids.shape + (dim,)``), out-of-range ids clamped
  to ``[0, vocab - 1]``; the gradient of a clamped id goes to the row read."""
  return jnp.take(table, ids, axis=0, mode="clip")


def embedding_grad(dout, ids, vocab):
  """The gradient w.r.t. the table: rows of ``dout`` added at the clamped ids,
  summed in float32 (or dout's wider dtype), returned in ``dout.dtype``."""
  dtype = compute_dtype(dout.dtype)
  rows = jnp.clip(ids, 0, vocab - 1).reshape(-1)
  flat = dout.reshape(-1, dout.shape[-1]).astype(dtype)
  return jnp.zeros((vocab, dout.shape[-1]), dtype).at[rows].add(flat).astype(dout.dtype)


# -- AdamW -------------------------------------------------------------------------


def adamw_leaf(grads, params, m, v, scalars, *, apply_updates, nesterov, decay):
  """One AdamW step on one leaf, as optax.adamw computes it.

  ``scalars`` holds the hyper-parameters in the layout of params/adamw.h:
  [-lr, b1, 1 - b1, b2, 1 - b2, eps, eps_root, weight_decay, 1 - b1^t,
  1 - b2^t, 1 - b1^(t+1), b1 as it multiplies m (rounded to a bfloat16 m's
  dtype, as optax's weakly typed Python float is)]. The step computes in the parameters' dtype promoted
  to at least float32 (complex for complex parameters, whose second moment v
  is real: the EMA of |g|^2); ``decay`` adds ``weight_decay * params``;
  ``nesterov`` takes NAdamW's first moment estimate. Returns the update
  ``-lr * u`` (or the new parameters ``params - lr * u`` when
  ``apply_updates``) in ``params.dtype``, and the new m and v in their dtypes.
  """
  (step, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, weight_decay, c1, c2,
   c1_next, b1_moment) = (scalars[i] for i in range(12))
  compute = jnp.result_type(params.dtype, grads.dtype, m.dtype, scalars.dtype)
  g = grads.astype(compute)
  p = params.astype(compute)
  m_new = one_minus_b1 * g + b1_moment * m.astype(compute)
  g_sq = (jnp.conj(g) * g).real if jnp.iscomplexobj(g) else g * g
  v_new = one_minus_b2 * g_sq + b2 * v.astype(g_sq.dtype)
  if nesterov:
    m_hat = b1 * (m_new / c1_next) + one_minus_b1 * (g / c1)
  else:
    m_hat = m_new / c1
  u = m_hat / (jnp.sqrt(v_new / c2 + eps_root) + eps)
  if decay:
    u = u + weight_decay * p
  u = step * u
  out = p + u if apply_updates else u
  return out.astype(params.dtype), m_new.astype(m.dtype), v_new.astype(v.dtype)

# -- attention -------------------------------------------------------------------


def attention_allowed(batch, num_heads, q_len, kv_len, *, mask=None, is_causal=False,
                      query_seq_lengths=None, key_value_seq_lengths=None,
                      local_window_size=None, query_offset=0, query_segment_ids=None,
                      key_value_segment_ids=None):
  """Boolean [B|1, N|1, T, S]: which keys each query row attends.

  Query row t sits at position t + query_offset: causal keeps keys j <= that
  position, a (left, right) window keeps position - left <= j <= position +
  right; sequence lengths drop rows t >= query_seq_lengths[b] and keys
  j >= key_value_seq_lengths[b]; segment ids ([B, T] and [B, S]) keep key j
  for row t only where they are equal; ``mask`` (bool, broadcastable) is and-ed in.
  """
  del batch, num_heads
  # Key j against row t's position t + offset, as j - t against the offset:
  # the position itself wraps around int32 (an offset of 2^31 - 1 put rows 1..
  # before every key). Rows and keys stay below 2^29, so an offset clamped to
  # +-2^30 and window sides clamped to 2^29 give the same comparisons, and
  # offset - left and offset + right cannot wrap.
  offset = jnp.clip(jnp.asarray(query_offset, jnp.int32), -2**30, 2**30)
  relative = (jnp.arange(kv_len, dtype=jnp.int32)[None, :]
              - jnp.arange(q_len, dtype=jnp.int32)[:, None])
  allowed = jnp.ones((q_len, kv_len), bool)
  if is_causal:
    allowed &= relative <= offset
  if local_window_size is not None:
    left, right = (min(int(side), 2**29) for side in local_window_size)
    allowed &= (relative >= offset - left) & (relative <= offset + right)
  allowed = allowed[None, None]
  if query_seq_lengths is not None:
    rows = jnp.arange(q_len)[None, :] < query_seq_lengths[:, None]
    allowed = allowed & rows[:, None, :, None]
  if key_value_seq_lengths is not None:
    keys = jnp.arange(kv_len)[None, :] < key_value_seq_lengths[:, None]
    allowed = allowed & keys[:, None, None, :]
  if query_segment_ids is not None:
    same = query_segment_ids[:, :, None] == key_value_segment_ids[:, None, :]
    allowed = allowed & same[:, None]
  if mask is not None:
    allowed = allowed & mask
  return allowed


def attention_with_logsumexp(query, key, value, bias=None, mask=None, *, scale=None,
                             is_causal=False, query_seq_lengths=None,
                             key_value_seq_lengths=None, local_window_size=None,
                             query_offset=0, precision=None, logits_soft_cap=None,
                             query_segment_ids=None, key_value_segment_ids=None, sinks=None):
  """Attention on [B, T, N, H] query, [B, S, K, H] key and [B, S, K, Hv] value
  (N % K == 0).

  Returns the output [B, T, N, Hv] in the query's dtype and the log-sum-exp
  of the logits [B, N, T] (float32 for the kernels' dtypes, else the compute
  dtype). Each logit, in this order: ``s = scale * q.k``; with
  ``logits_soft_cap``, ``cap * tanh(s / cap)`` (Gemma's formula); ``+ bias``;
  then the masks (``attention_allowed``: causal and window on positions,
  sequence lengths, segment ids, ``mask``). The softmax runs over the attended
  keys plus, with ``sinks`` ([N]), one extra logit ``sinks[n]`` per row of
  head n whose value vector is zero (gpt-oss), which the log-sum-exp includes.
  A row with no attended key gives output 0 (and log-sum-exp -inf, or its
  sink), and no NaN in any derivative. Complex inputs take the complex
  softmax ``exp(z) / sum(exp(z))`` (as jax.nn's), shifted by the row maximum
  of the real part. ``precision``: the two products' (``lax.dot``'s
  argument; None follows ``jax.default_matmul_precision``).
  """
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  Hv = value.shape[3]
  G = N // K
  scale = 1.0 / math.sqrt(H) if scale is None else scale
  dtype = compute_dtype(query.dtype, key.dtype)
  grouped = query.reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", grouped, key, preferred_element_type=dtype,
                      precision=precision)
  logits = logits.reshape(B, N, T, S) * jnp.asarray(scale, _real_dtype(dtype))
  if logits_soft_cap is not None:
    cap = jnp.asarray(logits_soft_cap, _real_dtype(dtype))
    logits = cap * jnp.tanh(logits / cap)
  if bias is not None:
    logits = logits + bias.astype(dtype)
  allowed = attention_allowed(
      B, N, T, S, mask=mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      query_offset=query_offset, query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids)
  logits = jnp.where(allowed, logits, -jnp.inf)
  # initial=-inf: with S = 0 keys every row attends none (output 0, as jax.nn).
  row_max = jnp.max(jnp.real(logits), axis=-1, keepdims=True, initial=-jnp.inf)
  if sinks is not None:
    sink = sinks.astype(_real_dtype(dtype))[None, :, None, None]
    row_max = jnp.maximum(row_max, sink)
  row_max = lax.stop_gradient(row_max)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.exp(logits - row_max)
  total = jnp.sum(unnormalized, axis=-1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sink - row_max)
  # != 0, not > 0: a NaN row (NaN total) keeps NaN in its log-sum-exp too.
  attended = total != 0
  safe_total = jnp.where(attended, total, 1.0)
  probs = (unnormalized / safe_total).astype(value.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.reshape(B, K, G, T, S), value,
                   preferred_element_type=dtype, precision=precision)
  lse = jnp.where(attended, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
  return out.reshape(B, T, N, Hv).astype(query.dtype), lse


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              return_residual=False, query_offset=0, logits_soft_cap=None,
              query_segment_ids=None, key_value_segment_ids=None, sinks=None):
  """``jax.nn.dot_product_attention``'s arguments and results (plus query_offset,
  and the soft cap, segment ids and sinks of ``attention_with_logsumexp``).

  Also accepts the unbatched [T, N, H] / [S, K, H] forms (segment ids [T] /
  [S]); bias and mask may have rank < 4 (leading axes are added). With
  ``return_residual`` also returns the log-sum-exp [B, T, N] (or [T, N]) in
  the query's dtype. A row with no attended key gives 0 (jax.nn averages V
  there instead).
  """
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
    if query_segment_ids is not None:
      query_segment_ids, key_value_segment_ids = (query_segment_ids[None],
                                                  key_value_segment_ids[None])

  def four_d(x):
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)

  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)
  out, lse = attention_with_logsumexp(
      query, key, value, four_d(bias), four_d(mask), scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, query_offset=query_offset,
      logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids, sinks=sinks)
  lse = jnp.transpose(lse, (0, 2, 1)).astype(query.dtype)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out

# -- softmax family -----------------------------------------------------------------
#
# A column is visible when `where` allows it and x + bias there is not -inf.
# Invisible columns give probability 0 / log-probability -inf and receive no
# gradient; a row without a visible column is all 0 / all -inf, never NaN.
# A NaN among the visible columns makes its whole row NaN.


def _visible_logits(x, where, bias):
  dtype = compute_dtype(x.dtype)
  z = x.astype(dtype)
  if bias is not None:
    z = z + bias.astype(dtype)
  visible = z != -jnp.inf
  if where is not None:
    visible = visible & where
  return z, visible


def _softmax_parts(x, axis, where, bias):
  """(z - m over visible columns else 0, visible, sum of exp) with m the row
  max (of the real part: complex x takes the complex softmax, as jax.nn's)."""
  z, visible = _visible_logits(x, where, bias)
  m = jnp.max(jnp.where(visible, jnp.real(z), -jnp.inf), axis=axis, keepdims=True,
              initial=-jnp.inf)
  m = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
  # where() inside exp as well as outside: an invisible +inf or NaN must not
  # reach exp, or its (unused) derivative would turn the gradient into NaN.
  shifted = jnp.where(visible, z - m, 0.0)
  total = jnp.sum(jnp.where(visible, jnp.exp(shifted), 0.0), axis=axis, keepdims=True)
  return shifted, visible, total


def softmax(x, axis=-1, *, where=None, bias=None):
  """softmax(x + bias) along ``axis`` over the columns ``where`` allows."""
  shifted, visible, total = _softmax_parts(x, axis, where, bias)
  # An invisible column's value is 0 / total (NaN in a NaN row, as the kernels
  # give it), but a constant: its tangent is 0 even in a NaN row, as its VJP
  # is (0 / total differentiated would carry the row's NaN into forward mode).
  total = jnp.where(total == 0.0, 1.0, total)
  y = jnp.where(visible, jnp.exp(shifted) / total, lax.stop_gradient(0.0 / total))
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
  """Per-token losses and logsumexps, float32 (float64 for float64 logits); lse
  is 0 where the loss is not computed."""
  vocab = logits.shape[-1]
  active = labels != ignore_index
  in_range = (labels >= 0) & (labels < vocab)
  computed = active & in_range
  # Rows that are not computed are zeroed first, so that whatever they hold
  # cannot leak a NaN into the gradient through the unused branch.
  x = jnp.where(computed[..., None], logits.astype(compute_dtype(logits.dtype)), 0.0)
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
  return total / jnp.maximum(count, 1).astype(total.dtype)


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  reduction="mean"):
  """Cross-entropy of logits [..., vocab] against integer labels [...], in logits' dtype."""
  loss, _ = cross_entropy_per_token(logits, labels, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, z_loss=z_loss)
  return reduce_loss(loss, labels, ignore_index, reduction).astype(logits.dtype)


def linear_cross_entropy(x, weight, labels, *, bias=None, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, reduction="mean"):
  """cross_entropy(x @ weight + bias, labels), the logits in float32 (float64
  when an input is float64); x's dtype out."""
  dtype = compute_dtype(x.dtype, weight.dtype)
  logits = jnp.matmul(x, weight, precision=lax.Precision.HIGHEST, preferred_element_type=dtype)
  if bias is not None:
    logits = logits + bias.astype(dtype)
  loss, _ = cross_entropy_per_token(logits, labels, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, z_loss=z_loss)
  return reduce_loss(loss, labels, ignore_index, reduction).astype(x.dtype)

# -- paged KV cache ------------------------------------------------------------------
#
# Layouts, masking and the clamping of traced data follow params/paged_attention.h:
# pages [P, page_size, K, H]; block_tables [B, M]; kv_lens [B]; the queries are
# the last query_lens[b] tokens of sequence b; int8 pages carry float32 scales
# [P, page_size, K].


def paged_gather(pages, block_tables, scales=None):
  """Each sequence's cache as a dense [B, M * page_size, K, H] array, read
  through block_tables (page ids clamped to [0, P - 1]); int8 pages come out
  dequantized (pages * scales) in float32."""
  P, page_size, K, H = pages.shape
  B, M = block_tables.shape
  ids = jnp.clip(block_tables, 0, P - 1)
  dense = pages[ids]
  if scales is not None:
    dense = dense.astype(_F32) * scales[ids][..., None]
  return dense.reshape(B, M * page_size, K, H)


def paged_attention_with_logsumexp(query, key_pages, value_pages, block_tables, kv_lens,
                                   query_lens=None, *, scale=None, logits_soft_cap=None,
                                   local_window_size=None, key_scales=None,
                                   value_scales=None, sinks=None, value_head_dim=None):
  """Attention of query [B, T, N, H] over the paged cache: the output
  [B, T, N, Hv] in the query's dtype and the log-sum-exp [B, N, T] float32.
  With ``sinks`` ([N]), each row's softmax has one extra logit ``sinks[n]``
  whose value is zero (as in ``attention_with_logsumexp``). Hv is the value
  pages' head dim; with ``value_pages=None`` the values are the first
  ``value_head_dim`` features of the (dequantized) keys (absorbed MLA).

  Query row t < query_lens[b] sits at position kv_lens[b] - query_lens[b] + t
  and attends keys j <= position (and j >= position - local_window_size);
  logits are scale * q.k, then logits_soft_cap * tanh(logits / cap) when a cap
  is given. Padding rows and rows without a key give 0 and -inf. A key that no
  query row of its sequence attends (past kv_lens, before the first row's
  window: a free or stale slot) is never read, values included: whatever it
  holds (NaN, inf) reaches no result, as in the kernels.
  """
  B, T, N, H = query.shape
  keys = paged_gather(key_pages, block_tables, key_scales)
  if value_pages is None:
    values = keys[..., :value_head_dim]
  else:
    values = paged_gather(value_pages, block_tables, value_scales)
  Hv = values.shape[-1]
  S, K = keys.shape[1], keys.shape[2]
  G = N // K
  if scale is None:
    scale = 1.0 / math.sqrt(H) if H > 0 else 1.0  # an empty head vector's logits are 0
  dtype = compute_dtype(query.dtype)
  kv = jnp.clip(kv_lens.astype(jnp.int32), 0, S)
  rows = T if query_lens is None else query_lens.astype(jnp.int32)
  rows = jnp.clip(jnp.minimum(rows, kv), 0, T)
  t = jnp.arange(T, dtype=jnp.int32)
  position = (kv - rows)[:, None] + t[None, :]
  key_index = jnp.arange(S, dtype=jnp.int32)
  allowed = (key_index[None, None, :] <= position[:, :, None]) & (t[None, :] < rows[:, None])[..., None]
  if local_window_size is not None:
    allowed &= key_index[None, None, :] >= position[:, :, None] - min(int(local_window_size), 2**30)
  grouped = query.reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", grouped.astype(dtype), keys.astype(dtype),
                      precision=lax.Precision.HIGHEST)
  logits = logits.reshape(B, N, T, S) * jnp.asarray(scale, dtype)
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  logits = jnp.where(allowed[:, None], logits, -jnp.inf)
  # The masked probabilities are 0, and 0 * NaN is NaN: the values of the keys
  # no row attends are zeroed, not only their scores.
  read = jnp.any(allowed, axis=1)[:, :, None, None]
  values = jnp.where(read, values, jnp.zeros((), values.dtype))
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(dtype)[None, :, None, None]
    row_max = jnp.maximum(row_max, sink)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.exp(logits - row_max)
  total = jnp.sum(unnormalized, axis=-1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sink - row_max)
  attended = total != 0
  probs = unnormalized / jnp.where(attended, total, 1.0)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.reshape(B, K, G, T, S), values.astype(dtype),
                   precision=lax.Precision.HIGHEST)
  lse = jnp.where(attended, row_max + jnp.log(jnp.where(attended, total, 1.0)), -jnp.inf)[..., 0]
  return out.reshape(B, T, N, Hv).astype(query.dtype), lse.astype(_F32)


def paged_attention(query, key_pages, value_pages, block_tables, kv_lens, *, query_lens=None,
                    scale=None, logits_soft_cap=None, local_window_size=None,
                    return_residual=False, key_scales=None, value_scales=None, sinks=None,
                    value_head_dim=None):
  """jaxops.paged_attention's arguments and results: query [B, N, H] (decode)
  or [B, T, N, H]; the log-sum-exp [B, N] or [B, N, T] with return_residual."""
  decode = query.ndim == 3
  out, lse = paged_attention_with_logsumexp(
      query[:, None] if decode else query, key_pages, value_pages, block_tables, kv_lens,
      query_lens, scale=scale, logits_soft_cap=logits_soft_cap,
      local_window_size=local_window_size, key_scales=key_scales, value_scales=value_scales,
      sinks=sinks, value_head_dim=value_head_dim)
  if decode:
    out, lse = out[:, 0], lse[..., 0]
  return (out, lse) if return_residual else out


def quantize_int8_rows(rows):
  """Symmetric int8 quantization over the last axis: scale = max|x| / 127 (0
  for an all-zero row), q = round(x / scale) in [-127, 127]. Returns (q, scale)."""
  x = rows.astype(_F32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  # A true division, as the kernels compute it: XLA would turn a division by a
  # constant into a product with its rounded reciprocal, 1 ulp off at times.
  scale = amax / lax.optimization_barrier(jnp.full(amax.shape, 127.0, _F32))
  safe = jnp.where(scale > 0, scale, 1.0)[..., None]
  q = jnp.where(scale[..., None] > 0, jnp.round(x / safe), 0.0)
  return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def paged_kv_update(key_pages, value_pages, key, value, slot_mapping, key_scales=None,
                    value_scales=None):
  """Token i's key/value rows [num_tokens, K, H] written to slot
  slot_mapping[i] (= page * page_size + offset) of the pages; slots outside
  [0, P * page_size) are skipped, and a slot named twice keeps the last
  token's rows. int8 pages quantize each row (quantize_int8_rows) and write its
  scale. Returns the pages (and the scales for int8 pages). A cache without
  value pages (``value_pages`` and ``value`` None: its values are in its keys)
  writes the keys only and returns None in the value pages' (and scales')
  places."""
  P, page_size, K, H = key_pages.shape
  slots = P * page_size
  n = slot_mapping.shape[0]
  token = jnp.arange(n, dtype=jnp.int32)
  slot = slot_mapping.astype(jnp.int32)
  valid = (slot >= 0) & (slot < slots)
  slot = jnp.where(valid, slot, slots)
  last = jnp.full((slots + 1,), -1, jnp.int32).at[slot].max(token)
  target = jnp.where(valid & (last[slot] == token), slot, slots)  # slots: dropped

  def write(pages, rows, scales):
    if pages is None:
      return None, None
    flat = pages.reshape(slots, *pages.shape[2:])
    if scales is None:
      return flat.at[target].set(rows.astype(pages.dtype), mode="drop").reshape(pages.shape), None
    q, s = quantize_int8_rows(rows)
    pages = flat.at[target].set(q, mode="drop").reshape(pages.shape)
    scales = scales.reshape(slots, K).at[target].set(s, mode="drop").reshape(scales.shape)
    return pages, scales

  if value_pages is None and key_scales is not None:
    value_scales = None

  key_pages, key_scales = write(key_pages, key, key_scales)
  value_pages, value_scales = write(value_pages, value, value_scales)
  if key_scales is None:
    return key_pages, value_pages
  return key_pages, value_pages, key_scales, value_scales

# -- sampling -------------------------------------------------------------------------


def sampling_params(vocab, temperature, top_k, top_p, min_p, uniforms):
  """The per-row parameters of `sample_with_uniforms` as the kernels read them
  (traced values are clamped, never trusted): temperature NaN or <= 0 is greedy;
  top_k <= 0 or >= vocab keeps the whole vocabulary; top_p NaN or >= 1 is off
  and <= 0 keeps the most likely token only; min_p NaN is 0 and is clipped to
  [0, 1]; a uniform NaN is 0 and is clipped to [0, 1)."""
  greedy = ~(temperature > 0)
  top_k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
  top_p = jnp.where(jnp.isnan(top_p) | (top_p >= 1), 1.0, top_p)
  min_p = jnp.clip(jnp.where(jnp.isnan(min_p), 0.0, min_p), 0.0, 1.0)
  below_one = jnp.nextafter(jnp.float32(1), jnp.float32(0))
  uniforms = jnp.clip(jnp.where(jnp.isnan(uniforms), 0.0, uniforms), 0.0, below_one)
  return greedy, top_k, top_p, min_p, uniforms


def sample_with_uniforms(logits, uniforms, temperature, top_k, top_p, min_p, *,
                         static_top_k=None):
  """Token ids int32 [batch] drawn from logits [batch, vocab], one uniform per row.

  Per row, in the compute dtype (float32 for float32/bfloat16/float16 logits):
  z = logits / temperature; the row's tokens are ordered by z descending, lower
  index first among equal z (the order of `lax.top_k`). The kept tokens are a
  prefix of that order: the first top_k; of those, the shortest prefix whose
  probability (renormalised over the top_k) reaches top_p; of those, the tokens
  with p >= min_p * p_max. The draw is the inverse CDF over the kept tokens in
  index order: with weights e = exp(z - max z), the first kept token whose
  cumulative weight exceeds uniform * (total kept weight) (the last kept token
  if rounding leaves none). +inf logits share the mass equally (weight 1, every
  other token 0). Greedy rows return the argmax (lowest index on ties). A row
  that contains a NaN, or has no logit above -inf, returns -1.

  `static_top_k`: a bound on every row's top_k known at trace time, so that
  only that many tokens are sorted (the reference's `lax.top_k` fast path).
  """
  dtype = compute_dtype(logits.dtype)
  x = logits.astype(dtype)
  vocab = x.shape[-1]
  greedy, top_k, top_p, min_p, uniforms = sampling_params(
      vocab, temperature, top_k, top_p, min_p, uniforms)
  z = x / jnp.where(greedy, 1.0, temperature).astype(dtype)[:, None]
  z = jnp.where(z == 0, 0.0, z).astype(dtype)  # -0 ties with +0 (lax.top_k puts it after)
  top = jnp.max(z, axis=-1, keepdims=True)
  shifted = jnp.where(top == jnp.inf, jnp.where(z == jnp.inf, 0.0, -jnp.inf), z - top)
  weight = jnp.exp(shifted)
  width = vocab if static_top_k is None else static_top_k
  _, order = lax.top_k(z, width)
  sorted_weight = jnp.take_along_axis(weight, order, axis=-1)
  position = jnp.arange(width)
  in_top_k = position < top_k[:, None]
  top_k_weight = jnp.where(in_top_k, sorted_weight, 0.0)
  top_k_mass = jnp.sum(top_k_weight, axis=-1, keepdims=True)
  mass_before = jnp.cumsum(top_k_weight, axis=-1) - top_k_weight
  limit = top_p.astype(dtype)[:, None] * top_k_mass
  in_top_p = (top_p[:, None] >= 1) | (mass_before < limit) | (position == 0)
  in_min_p = sorted_weight >= min_p.astype(dtype)[:, None]
  kept_sorted = in_top_k & in_top_p & in_min_p
  rows = jnp.arange(x.shape[0])[:, None]
  kept = jnp.zeros(x.shape, bool).at[rows, order].set(kept_sorted)
  cumulative = jnp.cumsum(jnp.where(kept, weight, 0.0), axis=-1)
  target = uniforms.astype(dtype) * cumulative[:, -1]
  hit = kept & (cumulative > target[:, None])
  last_kept = vocab - 1 - jnp.argmax(kept[:, ::-1], axis=-1)
  sampled = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last_kept)
  tokens = jnp.where(greedy, jnp.argmax(z, axis=-1), sampled)
  invalid = jnp.any(jnp.isnan(x), axis=-1) | (top[:, 0] == -jnp.inf)
  return jnp.where(invalid, -1, tokens).astype(jnp.int32)

# -- mixture-of-experts routing ------------------------------------------------------


ROUTER_SCORES = ("softmax", "sigmoid")
# A group's score is the sum of its best ROUTER_GROUP_TOP selection keys (DeepSeek-V3).
ROUTER_GROUP_TOP = 2


def router_scores(logits, score="softmax"):
  """The router's scores of logits [..., num_experts] in float32 (float64 for
  float64 logits): softmax over the experts, or the elementwise sigmoid."""
  x = logits.astype(compute_dtype(logits.dtype))
  if score == "sigmoid":
    return jax.nn.sigmoid(x)
  e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _selection_keys(values):
  """What the selection compares: NaN ranks last, like -inf."""
  return jnp.where(jnp.isnan(values), -jnp.inf, values)


def topk_router_experts(logits, k, *, score="softmax", expert_bias=None, num_groups=None,
                        group_topk=None):
  """The k experts [..., k] (int32) of each token, in selection order.

  The selection key is score + expert_bias; with num_groups, the experts form
  num_groups equal consecutive groups, a group's key is the sum of its best
  ROUTER_GROUP_TOP keys (all of them in a smaller group), and only the experts
  of the group_topk best groups compete. Ties go to the lower index, as
  lax.top_k's.
  """
  keys = lax.stop_gradient(router_scores(logits, score))
  if expert_bias is not None:
    keys = keys + expert_bias.astype(keys.dtype)
  keys = _selection_keys(keys)
  if num_groups is None or num_groups == 1:
    return lax.top_k(keys, k)[1].astype(jnp.int32)
  num_experts = keys.shape[-1]
  size = num_experts // num_groups
  grouped = keys.reshape(*keys.shape[:-1], num_groups, size)
  best = lax.top_k(grouped, min(ROUTER_GROUP_TOP, size))[0]
  group_keys = best[..., 0]
  for i in range(1, best.shape[-1]):
    group_keys = group_keys + best[..., i]
  # The kept groups in index order, so that the position of an expert among
  # theirs orders ties as its index does.
  kept = jnp.sort(lax.top_k(_selection_keys(group_keys), group_topk)[1], axis=-1)
  candidates = jnp.take_along_axis(grouped, kept[..., None], axis=-2)
  position = lax.top_k(candidates.reshape(*keys.shape[:-1], group_topk * size), k)[1]
  group = jnp.take_along_axis(kept, position // size, axis=-1)
  return (group * size + position % size).astype(jnp.int32)


def topk_router_weights(logits, experts, *, score="softmax", renormalize=True):
  """The weights [..., k] of the given experts: their (unbiased) scores, divided
  by their sum when renormalize; float32 (float64 for float64 logits). Expert
  ids are clipped to [0, num_experts), as the kernels clamp them."""
  # Clipped, not wrapped: a negative id is expert 0, as in the kernels.
  experts = jnp.clip(experts, 0, logits.shape[-1] - 1)
  if score == "sigmoid":
    # Elementwise: the experts' logits are gathered first, so that a NaN or
    # inf logit of an unselected expert stays out of the gradient (sigmoid's
    # derivative there times the gather's zero cotangent would be NaN).
    x = logits.astype(compute_dtype(logits.dtype))
    weights = jax.nn.sigmoid(jnp.take_along_axis(x, experts, axis=-1))
  else:
    weights = jnp.take_along_axis(router_scores(logits, score), experts, axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights


def topk_router(logits, k, *, score="softmax", renormalize=True, expert_bias=None,
                num_groups=None, group_topk=None):
  """(weights [..., k] float32, experts [..., k] int32) of a top-k MoE router."""
  experts = topk_router_experts(logits, k, score=score, expert_bias=expert_bias,
                                num_groups=num_groups, group_topk=group_topk)
  return topk_router_weights(logits, experts, score=score, renormalize=renormalize), experts


def moe_aux_loss(probs, expert_counts, k, coeff):
  """The Switch/GShard load-balancing loss of router probabilities probs
  [..., num_experts] and the tokens routed to each expert, expert_counts
  [num_experts]: coeff * num_experts * sum_e f_e * P_e, f_e = counts_e /
  (tokens * k), P_e = the mean of probs[..., e] over the tokens. A float32
  scalar (float64 for float64 probs); the counts are constants."""
  dtype = compute_dtype(probs.dtype)
  num_experts = probs.shape[-1]
  p = probs.astype(dtype).reshape(-1, num_experts)
  tokens = p.shape[0]
  fraction = lax.stop_gradient(expert_counts.astype(dtype)) / (tokens * k)
  return coeff * num_experts * jnp.sum(fraction * jnp.mean(p, axis=0))

# -- patch embedding ----------------------------------------------------------------


def patch_embed_conv(images, kernel, *, patch_size):
  """The patches' products, [B, N, D]: the stride-``patch_size`` VALID
  convolution of images [B, H, W, C] (NHWC) with kernel [p, p, C, D] (HWIO,
  Flax's nn.Conv), its (H/p, W/p) grid flattened row-major, in
  ``compute_dtype``."""
  dtype = compute_dtype(images.dtype, kernel.dtype)
  y = lax.conv_general_dilated(
      images.astype(dtype), kernel.astype(dtype), window_strides=(patch_size, patch_size),
      padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=lax.Precision.HIGHEST)
  return y.reshape(y.shape[0], y.shape[1] * y.shape[2], y.shape[3])


def patch_embed(images, kernel, bias=None, *, patch_size, pos_embed=None, cls_token=None):
  """ViT patch embedding: ``patch_embed_conv`` + bias, the class token [D]
  prepended as token 0 of every image, + pos_embed [N(+1), D]."""
  y = patch_embed_conv(images, kernel, patch_size=patch_size)
  dtype = y.dtype
  if bias is not None:
    y = y + bias.astype(dtype)
  if cls_token is not None:
    cls = jnp.broadcast_to(cls_token.astype(dtype), (y.shape[0], 1, y.shape[2]))
    y = jnp.concatenate([cls, y], axis=1)
  if pos_embed is not None:
    y = y + pos_embed.astype(dtype)
  return y.astype(images.dtype)

# -- 2:4 structured-sparse linear ---------------------------------------------------
# The packed layout (jaxops/_src/sparse.py, params/sparse.h): values [..., out, in / 2]
# (the 2 kept values of every group of 4 inputs, in index order) and uint8 metadata
# [..., out, ceil(in / 8)] (byte j: the 2-bit in-group positions of values 4j .. 4j + 3,
# low bits first).


def sparse_2_4_columns(metadata, in_features):
  """The input column of every packed value: int32 [..., out, in / 2]."""
  k = jnp.arange(in_features // 2)
  byte = jnp.take(metadata, k // 4, axis=-1).astype(jnp.int32)
  return 4 * (k // 2) + ((byte >> (2 * (k % 4))) & 3)


def sparse_2_4_decompress(values, metadata, in_features):
  """The dense [..., out, in] weight; two values at one position add up."""
  groups = in_features // 4
  positions = sparse_2_4_columns(metadata, in_features) % 4
  v = values.reshape(values.shape[:-1] + (groups, 2, 1))
  hit = positions.reshape(positions.shape[:-1] + (groups, 2, 1)) == jnp.arange(4)
  dense = jnp.where(hit, v, jnp.zeros((), values.dtype)).sum(axis=-2, dtype=values.dtype)
  return dense.reshape(values.shape[:-1] + (in_features,))


def sparse_linear(x, values, metadata, bias=None):
  """x @ W.T + bias with W the decompressed [out, in] weight, in float32; x's dtype out."""
  in_features = x.shape[-1]
  dtype = compute_dtype(x.dtype, values.dtype)
  w = sparse_2_4_decompress(values, metadata, in_features).astype(dtype)
  y = jnp.matmul(x.astype(dtype), w.T, precision=lax.Precision.HIGHEST)
  if bias is not None:
    y = y + bias.astype(dtype)
  return y.astype(x.dtype)


def sparse_linear_dx(dy, values, metadata, in_features):
  """dy @ W: the gradient of sparse_linear with respect to x, in dy's dtype."""
  dtype = compute_dtype(dy.dtype, values.dtype)
  w = sparse_2_4_decompress(values, metadata, in_features).astype(dtype)
  return jnp.matmul(dy.astype(dtype), w, precision=lax.Precision.HIGHEST).astype(dy.dtype)


def sparse_linear_dvalues(dy, x, metadata):
  """(dy^T x) at the kept positions: the gradient with respect to the packed
  values [out, in / 2] (the specification; it forms the dense product)."""
  dtype = compute_dtype(dy.dtype, x.dtype)
  dyf = dy.reshape(-1, dy.shape[-1]).astype(dtype)
  xf = x.reshape(-1, x.shape[-1]).astype(dtype)
  dense = jnp.matmul(dyf.T, xf, precision=lax.Precision.HIGHEST)
  columns = sparse_2_4_columns(metadata, x.shape[-1])
  return jnp.take_along_axis(dense, columns, axis=-1).astype(x.dtype)
