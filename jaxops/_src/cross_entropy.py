"""cross_entropy and linear_cross_entropy: primitives and public functions.

cross_entropy: the forward primitive returns the float32 per-token loss and
logsumexp; the tangent primitive (forward mode) reads the logits and their
tangent once per row; its transpose, the backward primitive, writes dlogits in
one pass over the logits from that logsumexp (no one-hot, no second
reduction). The reduction over tokens ("mean", "sum") is jnp on the per-token
losses, so its cotangent reaches the backward kernel as a per-token scale. The
logsumexp is a residual: the references that take it recompute it.

linear_cross_entropy: the loss of ``x @ weight + bias`` without the [tokens,
vocab] logits. Its primitives have no kernel of their own: on the kernel
platforms they lower to a ``lax.scan`` over blocks of tokens, where each
block's logits are an XLA matmul (XLA's CPU dot runs 3-4x faster here than an
Eigen GEMM inside a kernel, and the matmuls are most of the time) and the
cross-entropy kernels turn them into the loss, its tangent or, in place, its
gradient. Blocking over tokens rather than over the vocabulary keeps every row
whole, so each block needs one matmul forward and two backward and no online
rescaling; peak temporary memory is one block of logits
(``_LOGITS_BLOCK_BYTES``) plus the weight gradient.

Every matmul (forward, tangent and backward) is XLA's dot at the precision
the call resolved (``allow_tf32``, :mod:`jaxops._src.matmul_precision`): TF32
on a GPU at the default and "high" precisions, full float32 at "highest", as
the jnp program and its autodiff would compute it; full float32 on the CPU.

For a summed or averaged loss the cotangent is one scalar, so when the loss is
differentiated its forward computes the gradient for a unit cotangent in the
same sweep (3 matmuls in all, as many as the unfused jnp program): the tangent
is then the dot product of that gradient with the input tangents, and its
transpose (reverse mode) only scales it. reduction="none" has one cotangent per
token, unknown during the forward: its tangent and its backward each sweep the
blocks again.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxops import reference
from jaxops._src import matmul_precision, primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, batch_to_front, is_absent
from jaxops._src.sharding import Factors, leading_axes

_F32 = jnp.float32
_REDUCTIONS = ("mean", "sum", "none")

# float32 logits of one block of tokens in linear_cross_entropy. At 8192 tokens x
# 32000 classes, 64 MiB is 512 tokens a block (6% of the logits). XLA's CPU dots
# are faster on larger blocks (x.T @ dlogits 171 GFLOP/s at 256 tokens, 250 at
# 1024): the float32 value_and_grad took 6.9 s with 64 MiB blocks against 7.3 s
# with 32 MiB and 6.6-6.9 s with 128 MiB (2 cores, alternated), but 128 MiB
# blocks put the program's temporaries at 28% of the logits, and they must stay
# under a quarter (22% here; test_linear_does_not_materialise_the_logits).
_LOGITS_BLOCK_BYTES = 64 << 20



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


def _bwd_reference(logits, labels, lse, dloss, **options):
  del lse  # recomputed, so that the reference differentiates exactly
  _, vjp = jax.vjp(lambda l: _fwd_reference(l, labels, **options)[0], logits.astype(_F32))
  computed = _computed(labels, logits.shape[-1], options)
  d = jnp.where(computed[..., None], vjp(jnp.where(computed, dloss, 0.0))[0], 0.0)
  return (d.astype(logits.dtype),)


def _jvp_reference(logits, labels, lse, dlogits, **options):
  del lse
  _, dloss = jax.jvp(lambda l: _fwd_reference(l, labels, **options)[0],
                     (logits.astype(_F32),), (dlogits.astype(_F32),))
  # A label out of range has a NaN loss and, like its gradient, a zero tangent.
  return (jnp.where(_computed(labels, logits.shape[-1], options), dloss, 0.0),)


def _computed(labels, vocab, options):
  """Tokens whose loss is computed: not ignored, label in range."""
  return (labels != options["ignore_index"]) & (labels >= 0) & (labels < vocab)


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
  return FfiPrimitive(name=name, target=target or name,
                      abstract_eval=abstract_eval, reference=reference_fn,
                      batch_rule=_row_batch_rule,
                      input_output_aliases=input_output_aliases or {},
                      sharding=leading_axes(roles))


cross_entropy_fwd_p = _make(
    "jaxops_cross_entropy_fwd",
    lambda logits, labels, **_: (_rows_aval(labels), _rows_aval(labels)),
    _fwd_reference, "xs -> ss")

cross_entropy_jvp_p = _make(
    "jaxops_cross_entropy_jvp",
    lambda logits, labels, lse, dlogits, **_: (_rows_aval(labels),),
    _jvp_reference, "xssx -> s")

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


def _cross_entropy_transpose(cotangents, saved, wanted, **options):
  (dloss,), (logits, labels, lse) = cotangents, saved
  return cross_entropy_bwd_p(logits, labels, lse, dloss, **options)


Differentiable(
    forward=cross_entropy_fwd_p, tangent=cross_entropy_jvp_p, transpose=_cross_entropy_transpose,
    tangent_inputs=(0,), outputs=1, saved_inputs=(0, 1), saved_outputs=(1,),
    checkpoint_name="jaxops.cross_entropy")


# -- cross_entropy -----------------------------------------------------------------------


def cross_entropy(logits, labels, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, reduction: str = "mean", implementation=None):
  """Softmax cross-entropy of ``logits`` [..., vocab] against integer ``labels`` [...].

  Per token, with ``lse = logsumexp(logits)`` and ``eps = label_smoothing``::

    (1 - eps) * (lse - logits[label]) + eps * (lse - mean(logits)) + z_loss * lse**2

  i.e. the cross-entropy against ``(1 - eps) * onehot + eps / vocab``, plus the
  z-loss that keeps the log-partition near 0. Computed in float32, returned in
  ``logits.dtype``. With the defaults and ``reduction="none"``, the values of
  ``optax.softmax_cross_entropy_with_integer_labels``; unlike optax, a token
  can be ignored and a bad label gives NaN.

  Labels: a token labelled ``ignore_index`` has loss 0, no gradient, and is not
  counted by the mean (a mean over no token is 0, not NaN). Any other label
  outside ``[0, vocab)`` is a caller error that cannot raise inside a compiled
  program, so it is made loud instead: that token's loss is NaN (hence the mean
  or sum is NaN), its gradient is 0, and it is never used as an index.

  Args:
    logits: float32, bfloat16 or float16 (the kernel) or float64 (the jnp
      reference) array of rank >= 1; not complex (as optax, a loss is real).
    labels: integer array of shape ``logits.shape[:-1]``.
    ignore_index: label value of tokens to skip (may lie inside the vocabulary).
    label_smoothing: in [0, 1].
    z_loss: coefficient (>= 0) of ``lse**2``.
    reduction: "mean" (over non-ignored tokens), "sum" or "none" (per token).
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  Returns:
    The loss: a scalar for ``"mean"`` and ``"sum"``, ``labels``' shape for
    ``"none"``; ``logits.dtype``.

  Raises:
    TypeError: ``logits`` is not a real floating-point array, ``labels`` not an
      integer array, or an option has the wrong type.
    ValueError: ``labels``' shape is not ``logits.shape[:-1]``, an option is out
      of range, or ``reduction`` is unknown.

  Examples:
    >>> logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> jaxops.cross_entropy(logits, jnp.array([0, 1]), reduction="none")
    Array([0.239..., 1.098...], dtype=float32)
    >>> jaxops.cross_entropy(logits, jnp.array([0, -100]))   # the second is ignored
    Array(0.239..., dtype=float32)
  """
  op = "jaxops.cross_entropy"
  logits = _rows_input(op, "logits", logits)
  labels = _check_labels(op, labels, logits.shape[:-1], "logits.shape[:-1]")
  options, reduction = _check_options(op, ignore_index, label_smoothing, z_loss, reduction)
  if not primitive.use_kernel(op, implementation, {"logits": logits.dtype}):
    return reference.cross_entropy(logits, labels, reduction=reduction, **options.params())
  loss, _ = cross_entropy_fwd_p(logits, _kernel_labels(labels), **options.params())
  return reference.reduce_loss(loss, labels, ignore_index, reduction).astype(logits.dtype)


# -- linear_cross_entropy ----------------------------------------------------------------


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


def _logits_block(xb, weight, bias, precision):
  logits = jnp.dot(xb, weight, precision=precision, preferred_element_type=_F32)
  if bias.shape[0]:
    logits = logits + bias.astype(_F32)
  return logits


def _grad_block(xb, dlogits, weight, carry, precision):
  """dx for the block, and the weight and bias gradients accumulated in float32."""
  dweight, dbias = carry
  d = dlogits.astype(weight.dtype)
  dx = jnp.dot(d, weight.T, precision=precision, preferred_element_type=_F32)
  # The token axis is contracted: with tokens sharded over Explicit mesh axes,
  # JAX asks where the sum goes; it goes where the accumulator lives.
  dweight = dweight + jnp.dot(xb.T, d, precision=precision, preferred_element_type=_F32,
                              out_sharding=jax.typeof(dweight).sharding)
  if dbias.shape[0]:
    dbias = dbias + jnp.sum(dlogits, axis=0)
  return dx, (dweight, dbias)


def _zero_grads(weight, bias):
  return jnp.zeros_like(weight, _F32), jnp.zeros_like(bias, _F32)


def _sweep(body, carry, x, labels, block, ignore_index, *per_token):
  """``lax.scan`` of ``body(carry, xb, lb, *per_token_b)`` over blocks of tokens."""
  blocks = (_blocked(x, block, 0), _blocked(labels, block, ignore_index),
            *(_blocked(a, block, 0) for a in per_token))
  return lax.scan(lambda c, b: body(c, *b), carry, blocks)


def _loss_and_lse(x, weight, bias, labels, *, block, allow_tf32, **options):
  precision = matmul_precision.dot_precision(allow_tf32)

  def body(_, xb, lb):
    return None, cross_entropy_fwd_p(_logits_block(xb, weight, bias, precision), lb, **options)

  _, (loss, lse) = _sweep(body, None, x, labels, block, options["ignore_index"])
  return _unblocked(loss, x.shape[0]), _unblocked(lse, x.shape[0])


def _loss_and_unit_grads(x, weight, bias, labels, *, block, allow_tf32, **options):
  """Per-token losses and the float32 gradients of their sum."""
  precision = matmul_precision.dot_precision(allow_tf32)

  def body(carry, xb, lb):
    loss, dlogits = cross_entropy_fwd_grad_p(_logits_block(xb, weight, bias, precision), lb,
                                             **options)
    dx, carry = _grad_block(xb, dlogits, weight, carry, precision)
    return carry, (loss, dx)

  (dweight, dbias), (loss, dx) = _sweep(body, _zero_grads(weight, bias), x, labels, block,
                                        options["ignore_index"])
  return _unblocked(loss, x.shape[0]), _unblocked(dx, x.shape[0]), dweight, dbias


def _loss_tangent(x, weight, bias, labels, lse, dx, dweight, dbias, *, block, allow_tf32,
                  **options):
  """Per-token tangents of the losses, sweeping the blocks again: each block's
  logits and their tangent dx @ weight + x @ dweight + dbias."""
  precision = matmul_precision.dot_precision(allow_tf32)

  def body(_, xb, lb, lse_b, *tangents):
    dlogits = jnp.zeros((xb.shape[0], weight.shape[1]), _F32)
    if not is_absent(dx):
      dlogits = dlogits + jnp.dot(tangents[0], weight, precision=precision,
                                  preferred_element_type=_F32)
    if not is_absent(dweight):
      dlogits = dlogits + jnp.dot(xb, dweight, precision=precision, preferred_element_type=_F32)
    if not is_absent(dbias):
      dlogits = dlogits + dbias.astype(_F32)
    return None, cross_entropy_jvp_p(_logits_block(xb, weight, bias, precision), lb, lse_b,
                                     dlogits, **options)[0]

  per_token = (lse,) if is_absent(dx) else (lse, dx)
  _, dloss = _sweep(body, None, x, labels, block, options["ignore_index"], *per_token)
  return (_unblocked(dloss, x.shape[0]),)


def _grads_for(x, weight, bias, labels, lse, dloss, *, block, allow_tf32, **options):
  """The float32 gradients of sum(dloss * loss), sweeping the blocks again."""
  precision = matmul_precision.dot_precision(allow_tf32)

  def body(carry, xb, lb, lse_b, dloss_b):
    dlogits, = cross_entropy_bwd_inplace_p(_logits_block(xb, weight, bias, precision), lb, lse_b,
                                           dloss_b, **options)
    dx, carry = _grad_block(xb, dlogits, weight, carry, precision)
    return carry, dx

  (dweight, dbias), dx = _sweep(body, _zero_grads(weight, bias), x, labels, block,
                                options["ignore_index"], lse, dloss)
  return _unblocked(dx, x.shape[0]), dweight, dbias


def _denominator(labels, ignore_index, mean):
  if not mean:
    return jnp.float32(1.0)
  return jnp.maximum(jnp.sum(labels != ignore_index), 1).astype(_F32)


# -- linear_cross_entropy primitives: scans of XLA matmuls and the kernels above --------
#
# Operands (x [tokens, hidden], weight [hidden, vocab], bias [vocab] or absent,
# labels [tokens]); parameters: the cross-entropy options, `block` (tokens per
# block) and `allow_tf32` (the matmuls' precision); the reduced loss also `mean`
# (else the sum).


def _linear_logits_reference(x, weight, bias, allow_tf32):
  logits = jnp.matmul(x, weight, precision=matmul_precision.dot_precision(allow_tf32),
                      preferred_element_type=_F32)
  return logits + bias.astype(_F32) if bias.shape[0] else logits


def _linear_rows_reference(x, weight, bias, labels, *, block, allow_tf32, **options):
  return reference.cross_entropy_per_token(
      _linear_logits_reference(x, weight, bias, allow_tf32), labels, **options)


def _linear_rows_tangent_reference(x, weight, bias, labels, lse, dx, dweight, dbias, **params):
  del lse
  primals = tuple(a.astype(_F32) for a in (x, weight, bias))
  tangents = tuple(jnp.zeros_like(p) if is_absent(t) else t.astype(_F32)
                   for p, t in zip(primals, (dx, dweight, dbias)))
  rows = lambda *a: _linear_rows_reference(*a, labels, **params)[0]
  _, dloss = jax.jvp(rows, primals, tangents)
  return (jnp.where(_computed(labels, weight.shape[1], params), dloss, 0.0),)


def _linear_loss_reference(x, weight, bias, labels, *, mean, **params):
  loss, _ = _linear_rows_reference(x, weight, bias, labels, **params)
  return (jnp.sum(loss) / _denominator(labels, params["ignore_index"], mean),)


def _linear_loss_grads_reference(x, weight, bias, labels, **params):
  primals = tuple(a.astype(_F32) for a in (x, weight, bias))
  loss_of = lambda *a: _linear_loss_reference(*a, labels, **params)[0]
  loss, grads = jax.value_and_grad(loss_of, (0, 1, 2))(*primals)
  return (loss, *grads)


def _linear_loss_grads(x, weight, bias, labels, *, mean, **params):
  loss, dx, dweight, dbias = _loss_and_unit_grads(x, weight, bias, labels, **params)
  scale = 1.0 / _denominator(labels, params["ignore_index"], mean)
  return jnp.sum(loss) * scale, dx * scale, dweight * scale, dbias * scale


def _linear_loss_tangent(gx, gweight, gbias, dx, dweight, dbias, **params):
  """The tangent of a summed loss: its (unit) gradient dotted with the tangents."""
  dloss = jnp.float32(0.0)
  for grad, tangent in ((gx, dx), (gweight, dweight), (gbias, dbias)):
    if not is_absent(tangent):
      # Product, then sum: with tokens sharded over Explicit mesh axes a dot
      # over them would have to be told where its result lives.
      dloss = dloss + jnp.sum(grad * tangent.astype(_F32))
  return (dloss,)


def _fold_tokens_batch_rule(prim, args, dims, **params):
  """vmap over x and labels (the weight shared): more tokens for one sweep."""
  if any(d is not NOT_MAPPED for d in dims[1:3]):
    return None
  (x, _, _, labels), size = batch_to_front(args, dims, (0, 3))
  tokens = x.shape[1]
  outs = prim(x.reshape(size * tokens, x.shape[-1]), args[1], args[2],
              labels.reshape(size * tokens), **params)
  return [o.reshape(size, tokens) for o in outs], (0,) * len(outs)


def _per_example_loss_batch_rule(prim, args, dims, *, mean, **params):
  """vmap of a summed or averaged loss (the weight shared): the per-token losses
  of every example in one sweep, then each example's own sum or mean."""
  if any(d is not NOT_MAPPED for d in dims[1:3]):
    return None
  (x, _, _, labels), size = batch_to_front(args, dims, (0, 3))
  rows, _ = _fold_tokens_batch_rule(linear_rows_p, [x, args[1], args[2], labels],
                                    (0, NOT_MAPPED, NOT_MAPPED, 0), **params)
  loss = rows[0].sum(axis=1) / jax.vmap(
      lambda l: _denominator(l, params["ignore_index"], mean))(labels)
  return (loss,), (0,)


def _rows_aval_of(x, *_, **__):
  return jax.core.ShapedArray(x.shape[:1], _F32)


def _linear_sharding(roles):
  """Tokens shard (role "t": x's rows, labels, per-token results, x's gradient);
  everything else (role "w": the weight, bias and their gradients; scalars) is
  whole. ``roles``: one letter per operand, "->", one per result."""
  operand_roles, result_roles = (part.strip() for part in roles.split("->"))

  def dims(role, aval):
    if role == "t" and not is_absent(aval):
      return ("tokens",) + (None,) * (aval.ndim - 1)
    return (None,) * aval.ndim

  def factors(avals_in, avals_out, **params):
    return Factors([dims(r, a) for r, a in zip(operand_roles, avals_in)],
                   [dims(r, a) for r, a in zip(result_roles, avals_out)])

  return factors


def _composite(name, roles, abstract_eval, reference_fn, composite, batch_rule=None):
  return FfiPrimitive(name=name, target=None, abstract_eval=abstract_eval,
                      reference=reference_fn, composite=composite, batch_rule=batch_rule,
                      sharding=_linear_sharding(roles))


linear_rows_p = _composite(
    "jaxops_linear_cross_entropy_rows", "twwt -> tt",
    lambda x, w, b, l, **_: (_rows_aval_of(x), _rows_aval_of(x)),
    _linear_rows_reference, _loss_and_lse, _fold_tokens_batch_rule)

linear_rows_tangent_p = _composite(
    "jaxops_linear_cross_entropy_rows_jvp", "twwtttww -> t",
    lambda x, *_, **__: (_rows_aval_of(x),),
    _linear_rows_tangent_reference, _loss_tangent)

_SCALAR = jax.core.ShapedArray((), _F32)

linear_loss_p = _composite(
    "jaxops_linear_cross_entropy_loss", "twwt -> w",
    lambda x, w, b, l, **_: (_SCALAR,),
    _linear_loss_reference,
    lambda x, w, b, labels, *, mean, **params: (
        jnp.sum(_loss_and_lse(x, w, b, labels, **params)[0])
        / _denominator(labels, params["ignore_index"], mean),),
    _per_example_loss_batch_rule)

linear_loss_grads_p = _composite(
    "jaxops_linear_cross_entropy_loss_grads", "twwt -> wtww",
    lambda x, w, b, l, **_: (_SCALAR, *(jax.core.ShapedArray(a.shape, _F32) for a in (x, w, b))),
    _linear_loss_grads_reference, _linear_loss_grads)

linear_loss_tangent_p = _composite(
    "jaxops_linear_cross_entropy_loss_jvp", "twwtww -> w", lambda *_, **__: (_SCALAR,),
    _linear_loss_tangent, None)


def _cast(grads, wanted, scale=1.0):
  return [None if w is None else (g * scale).astype(w.dtype) for g, w in zip(grads, wanted)]


def _linear_rows_transpose(cotangents, saved, wanted, **params):
  (dloss,), (x, weight, bias, labels, lse) = cotangents, saved
  return _cast(_grads_for(x, weight, bias, labels, lse, dloss, **params), wanted)


def _linear_loss_transpose(cotangents, saved, wanted, **params):
  return _cast(saved, wanted, cotangents[0])


Differentiable(
    forward=linear_rows_p, tangent=linear_rows_tangent_p, transpose=_linear_rows_transpose,
    tangent_inputs=(0, 1, 2), outputs=1, saved_inputs=(0, 1, 2, 3), saved_outputs=(1,),
    checkpoint_name="jaxops.linear_cross_entropy")

Differentiable(
    forward=linear_loss_p, jvp_forward=linear_loss_grads_p, tangent=linear_loss_tangent_p,
    transpose=_linear_loss_transpose, tangent_inputs=(0, 1, 2), outputs=1,
    saved_outputs=(1, 2, 3), checkpoint_name="jaxops.linear_cross_entropy")


def linear_cross_entropy(x, weight, labels, *, bias=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean", precision=None, implementation=None):
  """``cross_entropy(x @ weight + bias, labels, ...)`` without materialising the logits.

  The logits are computed in float32 one block of tokens at a time and turned
  into the loss (and, under differentiation, into their gradient) in place;
  peak temporary memory is one block of logits plus the float32 weight
  gradient, not [tokens, vocab]. Gradients flow to ``x``, ``weight`` and
  ``bias``. Options and label handling as in :func:`cross_entropy`; the result
  has ``x.dtype``.

  Args:
    x: float array [..., hidden]; float64 runs the jnp reference.
    weight: float array [hidden, vocab] (cast to x's dtype).
    labels: integer array of shape ``x.shape[:-1]``.
    bias: optional float array [vocab] (cast to x's dtype).
    precision: the matmuls' precision, as ``lax.dot``'s (None follows
      ``jax.default_matmul_precision``). The logits, their tangent and the
      gradients are XLA's dots at it, as the jnp program and its autodiff
      are: TF32 on a GPU at the default and ``"high"`` precisions, full
      float32 at ``"highest"``/``"float32"`` and on the CPU
      (docs/precision.md). The jnp reference (``implementation="xla"``,
      float64 inputs) computes at ``"highest"`` whatever it says.

  Returns:
    The loss, as :func:`cross_entropy`'s, in ``x.dtype``.

  Raises:
    TypeError: as :func:`cross_entropy`, for ``x``, ``weight`` and ``bias``.
    ValueError: as :func:`cross_entropy`, or ``weight`` is not ``[hidden, vocab]``.

  Examples:
    >>> x, weight = jnp.ones((4, 8)), jnp.zeros((8, 16))
    >>> jaxops.linear_cross_entropy(x, weight, jnp.array([0, 1, 2, 3]))   # log(16)
    Array(2.772..., dtype=float32)
  """
  op = "jaxops.linear_cross_entropy"
  x = _rows_input(op, "x", x)
  weight = validation.float_array(op, "weight", weight)
  if weight.ndim != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] == 0:
    raise validation.value_error(
        op, "weight", f"have shape (hidden, vocab) = ({x.shape[-1]}, vocab > 0) to match x "
        f"{x.shape}", f"shape {weight.shape}")
  weight = weight.astype(x.dtype)
  vocab = weight.shape[1]
  if bias is not None:
    bias = validation.float_array(op, "bias", bias)
    validation.shape(op, "bias", bias, (vocab,), of="weight.shape[1:]")
    bias = bias.astype(x.dtype)
  labels = _check_labels(op, labels, x.shape[:-1], "x.shape[:-1]")
  options, reduction = _check_options(op, ignore_index, label_smoothing, z_loss, reduction)
  allow_tf32 = matmul_precision.allow_tf32(op, precision)
  tokens = math.prod(x.shape[:-1])
  if not tokens or not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.linear_cross_entropy(x, weight, labels, bias=bias, reduction=reduction,
                                          **options.params())
  params = dict(options.params(), block=_block_tokens(tokens, vocab), allow_tf32=allow_tf32)
  args = (x.reshape(tokens, x.shape[-1]), weight, absent(x.dtype) if bias is None else bias,
          _kernel_labels(labels).reshape(tokens))
  if reduction == "none":
    loss, _ = linear_rows_p(*args, **params)
    return loss.reshape(labels.shape).astype(x.dtype)
  return linear_loss_p(*args, mean=reduction == "mean", **params)[0].astype(x.dtype)


# -- argument handling --------------------------------------------------------------------


def _rows_input(op, name, x):
  """logits, or linear_cross_entropy's x: float [..., features], features > 0."""
  x = validation.float_array(op, name, x)
  validation.rank(op, name, x, low=1)
  validation.non_empty_axis(op, name, x)
  return x


def _check_labels(op, labels, shape, shape_name):
  labels = validation.integer_array(op, "labels", labels)
  validation.shape(op, "labels", labels, shape, of=shape_name)
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
  ignore_index = validation.static_int(op, "ignore_index", ignore_index)
  label_smoothing = validation.static_float(op, "label_smoothing", label_smoothing, low=0.0,
                                            high=1.0)
  z_loss = validation.static_float(op, "z_loss", z_loss, low=0.0)
  reduction = validation.choice(op, "reduction", reduction, _REDUCTIONS)
  return Options(ignore_index, label_smoothing, z_loss), reduction
