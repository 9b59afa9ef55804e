"""cross_entropy and linear_cross_entropy: primitives and public functions.

cross_entropy: the forward primitive returns the float32 per-token loss and
logsumexp; the backward primitive writes dlogits in one pass over the logits
from that logsumexp (no one-hot, no second reduction). The reduction over
tokens ("mean", "sum") is jnp on the per-token losses, so its cotangent reaches
the backward kernel as a per-token scale.

linear_cross_entropy: the loss of ``x @ weight + bias`` without the [tokens,
vocab] logits. Tokens are processed in blocks by a ``lax.scan``: each block's
logits are an XLA matmul (XLA's CPU dot runs 3-4x faster here than an Eigen GEMM
inside a kernel, and the matmuls are most of the time), and the cross-entropy
kernel turns them into the loss and, in place, their gradient. Blocking over
tokens rather than over the vocabulary keeps every row whole, so each block
needs one matmul forward and two backward and no online rescaling; peak
temporary memory is one block of logits (``_LOGITS_BLOCK_BYTES``) plus the
weight gradient.

For a summed or averaged loss the cotangent is one scalar, so the forward under
differentiation computes the gradients for a unit cotangent in the same sweep
(3 matmuls in all, as many as the unfused jnp program) and the backward only
scales them. reduction="none" has one cotangent per token, unknown during the
forward: its backward sweeps the blocks again (4 matmuls).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops import reference
from jaxops._src import primitive
from jaxops._src.checks import (
    check_array,
    check_float_array,
    check_static_float,
    check_static_int,
)
from jaxops._src.primitive import FfiPrimitive, batch_to_front
from jaxops._src.sharding import leading_axes

_F32 = jnp.float32
_REDUCTIONS = ("mean", "sum", "none")

# float32 logits of one block of tokens in linear_cross_entropy. At 8192 tokens x
# 32000 classes, 32 MiB is 256 tokens a block (3% of the logits): still large
# matmuls, and measured as fast as 64 MiB blocks (fewer passes over the weight
# gradient) while the whole program's temporaries stay at 16% of the logits.
_LOGITS_BLOCK_BYTES = 32 << 20

_ATTRIBUTES = {"ignore_index": np.int64, "label_smoothing": np.float32, "z_loss": np.float32}


class Options(NamedTuple):
  ignore_index: int
  label_smoothing: float
  z_loss: float

  def params(self):
    return self._asdict()


# -- primitives ------------------------------------------------------------------------


def _rows_aval(labels):
  return jax.core.ShapedArray(labels.shape, _F32)


def _fwd_reference(logits, labels, **options):
  return reference.cross_entropy_per_token(logits, labels, **options)


def _bwd_reference(logits, labels, lse, dloss, *, ignore_index, label_smoothing, z_loss):
  vocab = logits.shape[-1]
  computed = (labels != ignore_index) & (labels >= 0) & (labels < vocab)
  x = jnp.where(computed[..., None], logits.astype(_F32), 0.0)
  lse = jnp.where(computed, lse, 0.0)[..., None]
  onehot = jnp.arange(vocab) == labels[..., None]
  d = (jnp.exp(x - lse) * (1.0 + 2.0 * z_loss * lse) - label_smoothing / vocab
       - (1.0 - label_smoothing) * onehot)
  d = jnp.where(computed[..., None], d * dloss[..., None], 0.0)
  return (d.astype(logits.dtype),)


def _fwd_grad_reference(logits, labels, **options):
  loss, lse = _fwd_reference(logits, labels, **options)
  return loss, _bwd_reference(logits, labels, lse, jnp.ones_like(loss), **options)[0]


def _row_batch_rule(prim, args, dims, **params):
  args, _ = batch_to_front(args, dims, range(len(args)))
  outs = prim(*args, **params)
  return outs, (0,) * len(outs)


def _make(name, abstract_eval, reference_fn, roles, target=None, input_output_aliases=None):
  # Tokens shard (logits, labels, losses alike); the vocabulary axis stays whole.
  # The mean over tokens is taken outside the primitive, where XLA reduces it.
  return FfiPrimitive(name=name, target=target or name, abstract_eval=abstract_eval,
                      reference=reference_fn, attributes=_ATTRIBUTES,
                      batch_rule=_row_batch_rule,
                      input_output_aliases=input_output_aliases or {},
                      sharding=leading_axes(roles))


cross_entropy_fwd_p = _make(
    "jaxops_cross_entropy_fwd",
    lambda logits, labels, **_: (_rows_aval(labels), _rows_aval(labels)),
    _fwd_reference, "xs -> ss")

_bwd_aval = lambda logits, labels, lse, dloss, **_: (
    jax.core.ShapedArray(logits.shape, logits.dtype),)

cross_entropy_bwd_p = _make("jaxops_cross_entropy_bwd", _bwd_aval, _bwd_reference, "xsss -> x")

# The same kernel writing dlogits over the logits: for logits that die with the
# call (linear_cross_entropy's blocks). Where the logits are still live, XLA
# would copy them first, which is why cross_entropy uses the variant above.
cross_entropy_bwd_inplace_p = _make(
    "jaxops_cross_entropy_bwd_inplace", _bwd_aval, _bwd_reference, "xsss -> x",
    target="jaxops_cross_entropy_bwd", input_output_aliases={0: 0})

cross_entropy_fwd_grad_p = _make(
    "jaxops_cross_entropy_fwd_grad",
    lambda logits, labels, **_: (_rows_aval(labels),
                                 jax.core.ShapedArray(logits.shape, logits.dtype)),
    _fwd_grad_reference, "xs -> sx", input_output_aliases={0: 1})


# -- cross_entropy -----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy_rows(logits, labels, options):
  return cross_entropy_fwd_p(logits, labels, **options.params())[0]


def _cross_entropy_rows_fwd(logits, labels, options):
  loss, lse = cross_entropy_fwd_p(logits, labels, **options.params())
  return loss, (logits, labels, lse)


def _cross_entropy_rows_bwd(options, residuals, dloss):
  logits, labels, lse = residuals
  return cross_entropy_bwd_p(logits, labels, lse, dloss, **options.params())[0], None


_cross_entropy_rows.defvjp(_cross_entropy_rows_fwd, _cross_entropy_rows_bwd)


def cross_entropy(logits, labels, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, reduction: str = "mean", implementation=None):
  """Softmax cross-entropy of ``logits`` [..., vocab] against integer ``labels`` [...].

  Per token, with ``lse = logsumexp(logits)`` and ``eps = label_smoothing``::

    (1 - eps) * (lse - logits[label]) + eps * (lse - mean(logits)) + z_loss * lse**2

  i.e. the cross-entropy against ``(1 - eps) * onehot + eps / vocab``, plus the
  z-loss that keeps the log-partition near 0. Computed in float32, returned in
  ``logits.dtype``.

  Labels: a token labelled ``ignore_index`` has loss 0, no gradient, and is not
  counted by the mean (a mean over no token is 0, not NaN). Any other label
  outside ``[0, vocab)`` is a caller error that cannot raise inside a compiled
  program, so it is made loud instead: that token's loss is NaN (hence the mean
  or sum is NaN), its gradient is 0, and it is never used as an index.

  Args:
    logits: float32, bfloat16 or float16 array of rank >= 1.
    labels: integer array of shape ``logits.shape[:-1]``.
    ignore_index: label value of tokens to skip (may lie inside the vocabulary).
    label_smoothing: in [0, 1].
    z_loss: coefficient (>= 0) of ``lse**2``.
    reduction: "mean" (over non-ignored tokens), "sum" or "none" (per token).
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).
  """
  op = "jaxops.cross_entropy"
  logits = check_float_array(op, "logits", logits, min_rank=1)
  labels = _check_labels(op, labels, logits.shape[:-1], "logits.shape[:-1]")
  options, reduction = _check_options(op, ignore_index, label_smoothing, z_loss, reduction)
  if not primitive.use_kernel(op, implementation, [logits.dtype]):
    return reference.cross_entropy(logits, labels, reduction=reduction, **options.params())
  loss = _cross_entropy_rows(logits, _kernel_labels(labels), options)
  return reference.reduce_loss(loss, labels, ignore_index, reduction).astype(logits.dtype)


# -- linear_cross_entropy ----------------------------------------------------------------


class _Linear(NamedTuple):
  """Static configuration of one linear_cross_entropy call."""
  options: Options
  block: int  # tokens per block
  x_dtype: str
  weight_dtype: str


def _block_tokens(tokens, vocab):
  """Tokens per block: within the byte budget, and as even as the count allows,
  so that padding (a copy of x) is rarely needed and never more than a row a block."""
  limit = max(8, _LOGITS_BLOCK_BYTES // (4 * vocab))
  blocks = -(-tokens // limit)
  return -(-tokens // blocks)


def _blocked(array, block, fill):
  """[tokens, ...] -> [blocks, block, ...], the last block padded with ``fill``."""
  blocks = -(-array.shape[0] // block)
  pad = blocks * block - array.shape[0]
  if pad:
    array = jnp.concatenate([array, jnp.full((pad, *array.shape[1:]), fill, array.dtype)])
  return array.reshape(blocks, block, *array.shape[1:])


def _unblocked(array, tokens):
  return array.reshape(-1, *array.shape[2:])[:tokens]


def _logits_block(xb, weight, bias):
  logits = jnp.dot(xb, weight, preferred_element_type=_F32)
  if bias.shape[0]:
    logits = logits + bias.astype(_F32)
  return logits


def _grad_block(xb, dlogits, weight, carry):
  """dx for the block, and the weight and bias gradients accumulated in float32."""
  dweight, dbias = carry
  d = dlogits.astype(weight.dtype)
  dx = jnp.dot(d, weight.T, preferred_element_type=_F32)
  # The token axis is contracted: with tokens sharded over Explicit mesh axes,
  # JAX asks where the sum goes; it goes where the accumulator lives.
  dweight = dweight + jnp.dot(xb.T, d, preferred_element_type=_F32,
                              out_sharding=jax.typeof(dweight).sharding)
  if dbias.shape[0]:
    dbias = dbias + jnp.sum(dlogits, axis=0)
  return dx, (dweight, dbias)


def _zero_grads(weight, bias):
  return jnp.zeros(weight.shape, _F32), jnp.zeros(bias.shape, _F32)


def _loss_and_lse(x, weight, bias, labels, config):
  options = config.options

  def body(_, block):
    xb, lb = block
    loss, lse = cross_entropy_fwd_p(_logits_block(xb, weight, bias), lb, **options.params())
    return None, (loss, lse)

  blocks = (_blocked(x, config.block, 0), _blocked(labels, config.block, options.ignore_index))
  _, (loss, lse) = lax.scan(body, None, blocks)
  return _unblocked(loss, x.shape[0]), _unblocked(lse, x.shape[0])


def _loss_and_unit_grads(x, weight, bias, labels, config):
  """Per-token losses and the float32 gradients of their sum."""
  options = config.options

  def body(carry, block):
    xb, lb = block
    loss, dlogits = cross_entropy_fwd_grad_p(_logits_block(xb, weight, bias), lb,
                                             **options.params())
    dx, carry = _grad_block(xb, dlogits, weight, carry)
    return carry, (loss, dx)

  blocks = (_blocked(x, config.block, 0), _blocked(labels, config.block, options.ignore_index))
  (dweight, dbias), (loss, dx) = lax.scan(body, _zero_grads(weight, bias), blocks)
  return _unblocked(loss, x.shape[0]), _unblocked(dx, x.shape[0]), dweight, dbias


def _grads_for(x, weight, bias, labels, lse, dloss, config):
  """The gradients of sum(dloss * loss), sweeping the blocks again."""
  options = config.options

  def body(carry, block):
    xb, lb, lse_b, dloss_b = block
    dlogits, = cross_entropy_bwd_inplace_p(_logits_block(xb, weight, bias), lb, lse_b, dloss_b,
                                           **options.params())
    dx, carry = _grad_block(xb, dlogits, weight, carry)
    return carry, dx

  blocks = (_blocked(x, config.block, 0), _blocked(labels, config.block, options.ignore_index),
            _blocked(lse, config.block, 0), _blocked(dloss, config.block, 0))
  (dweight, dbias), dx = lax.scan(body, _zero_grads(weight, bias), blocks)
  return _unblocked(dx, x.shape[0]), dweight, dbias


def _cast_grads(config, dx, dweight, dbias, scale=1.0):
  return ((dx * scale).astype(config.x_dtype), (dweight * scale).astype(config.weight_dtype),
          (dbias * scale).astype(config.weight_dtype))


def _denominator(labels, config, mean):
  if not mean:
    return jnp.float32(1.0)
  count = jnp.sum(labels != config.options.ignore_index)
  return jnp.maximum(count, 1).astype(_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _linear_reduced(x, weight, bias, labels, config, mean):
  loss, _ = _loss_and_lse(x, weight, bias, labels, config)
  return jnp.sum(loss) / _denominator(labels, config, mean)


def _linear_reduced_fwd(x, weight, bias, labels, config, mean):
  loss, dx, dweight, dbias = _loss_and_unit_grads(x, weight, bias, labels, config)
  denominator = _denominator(labels, config, mean)
  return jnp.sum(loss) / denominator, (dx, dweight, dbias, denominator)


def _linear_reduced_bwd(config, mean, residuals, g):
  dx, dweight, dbias, denominator = residuals
  return (*_cast_grads(config, dx, dweight, dbias, g / denominator), None)


_linear_reduced.defvjp(_linear_reduced_fwd, _linear_reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _linear_rows(x, weight, bias, labels, config):
  return _loss_and_lse(x, weight, bias, labels, config)[0]


def _linear_rows_fwd(x, weight, bias, labels, config):
  loss, lse = _loss_and_lse(x, weight, bias, labels, config)
  return loss, (x, weight, bias, labels, lse)


def _linear_rows_bwd(config, residuals, dloss):
  x, weight, bias, labels, lse = residuals
  return (*_cast_grads(config, *_grads_for(x, weight, bias, labels, lse, dloss, config)), None)


_linear_rows.defvjp(_linear_rows_fwd, _linear_rows_bwd)


def linear_cross_entropy(x, weight, labels, *, bias=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean", implementation=None):
  """``cross_entropy(x @ weight + bias, labels, ...)`` without materialising the logits.

  The logits are computed in float32 one block of tokens at a time and turned
  into the loss (and, under differentiation, into their gradient) in place;
  peak temporary memory is one block of logits plus the float32 weight
  gradient, not [tokens, vocab]. Gradients flow to ``x``, ``weight`` and
  ``bias``. Options and label handling as in :func:`cross_entropy`; the result
  has ``x.dtype``.

  Args:
    x: float array [..., hidden].
    weight: float array [hidden, vocab] (cast to x's dtype).
    labels: integer array of shape ``x.shape[:-1]``.
    bias: optional float array [vocab] (cast to x's dtype).
  """
  op = "jaxops.linear_cross_entropy"
  x = check_float_array(op, "x", x, min_rank=1)
  weight = check_float_array(op, "weight", weight)
  if weight.ndim != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] == 0:
    raise ValueError(f"{op}: weight must have shape (hidden, vocab) = ({x.shape[-1]}, vocab > 0) "
                     f"to match x {x.shape}, got {weight.shape}")
  weight = weight.astype(x.dtype)
  vocab = weight.shape[1]
  if bias is not None:
    bias = check_float_array(op, "bias", bias)
    if bias.shape != (vocab,):
      raise ValueError(f"{op}: bias must have shape ({vocab},) to match weight {weight.shape}, "
                       f"got {bias.shape}")
    bias = bias.astype(x.dtype)
  labels = _check_labels(op, labels, x.shape[:-1], "x.shape[:-1]")
  options, reduction = _check_options(op, ignore_index, label_smoothing, z_loss, reduction)
  tokens = math.prod(x.shape[:-1])
  if not tokens or not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.linear_cross_entropy(x, weight, labels, bias=bias, reduction=reduction,
                                          **options.params())
  config = _Linear(options, _block_tokens(tokens, vocab), x.dtype.name, weight.dtype.name)
  args = (x.reshape(tokens, x.shape[-1]), weight,
          jnp.zeros((0,), x.dtype) if bias is None else bias,
          _kernel_labels(labels).reshape(tokens))
  if reduction == "none":
    return _linear_rows(*args, config).reshape(labels.shape).astype(x.dtype)
  return _linear_reduced(*args, config, reduction == "mean").astype(x.dtype)


# -- argument handling --------------------------------------------------------------------


def _check_labels(op, labels, shape, shape_name):
  labels = check_array(op, "labels", labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must have an integer dtype, got {labels.dtype}")
  if labels.shape != tuple(shape):
    raise ValueError(f"{op}: labels must have shape {shape_name} = {tuple(shape)}, "
                     f"got {labels.shape}")
  return labels


def _kernel_labels(labels):
  """int32 or int64 labels for the kernels; wider unsigned values are clipped,
  which keeps an out-of-range label out of range."""
  if labels.dtype in (jnp.int32, jnp.int64):
    return labels
  info = jnp.iinfo(labels.dtype)
  if info.bits <= 16:
    return labels.astype(jnp.int32)
  target = jnp.int64 if info.bits == 64 else jnp.int32
  return jnp.minimum(labels, jnp.iinfo(target).max).astype(target)


def _check_options(op, ignore_index, label_smoothing, z_loss, reduction):
  ignore_index = check_static_int(op, "ignore_index", ignore_index)
  label_smoothing = check_static_float(op, "label_smoothing", label_smoothing, low=0.0, high=1.0)
  z_loss = check_static_float(op, "z_loss", z_loss, low=0.0, high=math.inf)
  if reduction not in _REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
  return Options(ignore_index, label_smoothing, z_loss), reduction
