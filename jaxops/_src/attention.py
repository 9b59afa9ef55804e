"""attention: flash-attention primitives and the public function, a drop-in for
``jax.nn.dot_product_attention``.

The forward primitive returns the output and the float32 log-sum-exp [B, N, T]
(-inf for a row with no attended key); the backward primitive recomputes the
probabilities tile by tile and returns dq, dk, dv and, when the bias is
differentiated, dbias. Absent optional operands (bias, mask, sequence lengths,
the log-sum-exp cotangent, zero tangents) are zero-size arrays.
``query_offset`` is an int32 scalar operand, so a traced offset (a decode loop)
does not recompile.

Forward mode runs one fused kernel (``attention_fwd_jvp_p``): the output, the
log-sum-exp and both their tangents in a single flash pass over K/V, from the
tangents of q, k, v and the bias. Reverse mode is unchanged: partial
evaluation splits that primitive into the forward and the tangent primitive,
whose transpose is the backward kernel (see jaxops/_src/autodiff.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import reference
from jaxops._src import ffi_targets, matmul_precision, primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, is_absent
from jaxops._src.sharding import Factors

_F32 = jnp.float32
_I32 = jnp.int32

# The CUDA kernels hold whole head vectors in shared memory (params/attention.h).
_CUDA_MAX_HEAD_DIM = ffi_targets.limit("cuda_attention_max_head_dim")


def _optional(x):
  return None if is_absent(x) else x


def _window(window_left, window_right):
  # The public function gives both sides or neither (-1 = no window).
  return None if window_left < 0 else (window_left, window_right)


# -- primitives -------------------------------------------------------------------
#
# Operands of the forward: q, k, v, bias, mask, q_lengths, kv_lengths,
# q_segments, kv_segments, query_offset (the int32 scalar, at _OFFSET); the
# forward-mode kernel appends the tangents dq, dk, dv, dbias, the backward out,
# lse, dout, dlse. Sinks are not an operand: they merge into the results by
# log-sum-exp outside the kernels (merge_sinks).

_OFFSET = 9
_FORWARD_OPERANDS = 10


def _fwd_abstract_eval(q, k, v, *operands, **params):
  B, T, N, _ = q.shape
  return (jax.core.ShapedArray((B, T, N, v.shape[3]), q.dtype),
          jax.core.ShapedArray((B, N, T), _F32))


def _fwd_reference(q, k, v, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments,
                   query_offset, *, scale, is_causal, window_left, window_right,
                   logits_soft_cap, allow_tf32, context_parallel=None):
  del context_parallel  # how a sharded sequence partitions (ring_attention.partitioned)
  return reference.attention_with_logsumexp(
      q, k, v, _optional(bias), _optional(mask), scale=scale, is_causal=is_causal,
      query_seq_lengths=_optional(q_lengths), key_value_seq_lengths=_optional(kv_lengths),
      local_window_size=_window(window_left, window_right), query_offset=query_offset,
      precision=matmul_precision.dot_precision(allow_tf32),
      logits_soft_cap=logits_soft_cap or None, query_segment_ids=_optional(q_segments),
      key_value_segment_ids=_optional(kv_segments))


def _bwd_abstract_eval(q, k, v, bias, *operands, with_dbias, **params):
  dbias_shape = bias.shape if with_dbias else (0,)
  return (jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(k.shape, k.dtype),
          jax.core.ShapedArray(v.shape, v.dtype), jax.core.ShapedArray(dbias_shape, _F32))


def _bwd_reference(*args, with_dbias, **params):
  operands, (out, lse, dout, dlse) = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS:]
  del out, lse  # recomputed, so that the reference differentiates exactly

  def forward(q, k, v, bias):
    return _fwd_reference(q, k, v, bias, *operands[4:], **params)

  (_, lse_ref), vjp = jax.vjp(forward, *operands[:4])
  dlse = jnp.zeros_like(lse_ref) if is_absent(dlse) else dlse
  dq, dk, dv, dbias = vjp((dout, dlse))
  return dq, dk, dv, dbias if with_dbias else absent(_F32)


def _fwd_jvp_reference(*args, **params):
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS:]

  def forward(q, k, v, bias):
    return _fwd_reference(q, k, v, bias, *operands[4:], **params)

  primals = operands[:4]
  tangents = tuple(jnp.zeros_like(p) if is_absent(t) else t for p, t in zip(primals, tangents))
  (out, lse), (dout, dlse) = jax.jvp(forward, primals, tangents)
  return out, lse, dout, dlse


def _fwd_jvp_abstract_eval(q, *operands, **params):
  out, lse = _fwd_abstract_eval(q, *operands[:_FORWARD_OPERANDS - 1], **params)
  return out, lse, out, lse


def _jvp_reference(*args, **params):
  # out and lse are recomputed, so that the reference differentiates exactly.
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS + 2:]
  return _fwd_jvp_reference(*operands, *tangents, **params)[2:]


def _jvp_with_fused_kernel(*args, **params):
  """The tangents alone (e.g. evaluating a linearized attention): the fused
  forward-mode kernel, its primal results dropped."""
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS + 2:]
  return attention_fwd_jvp_p(*operands, *tangents, **params)[2:]


# -- batching: the vmapped axis folds into the batch axis B --------------------------


def _fold(x, size, batched, batch, may_broadcast):
  """x as [size * B, ...]: the vmapped axis (at the front when batched) folds into B.

  A bias or mask (may_broadcast) whose B axis is 1 and that is shared by all
  examples stays broadcast; absent (zero-size) shared operands stay absent.
  """
  if not batched:
    if is_absent(x) or (may_broadcast and x.shape[0] == 1):
      return x
    return jnp.broadcast_to(x[None], (size, *x.shape)).reshape(size * batch, *x.shape[1:])
  if x.shape[1] != batch:
    x = jnp.broadcast_to(x, (size, batch, *x.shape[2:]))
  return x.reshape(size * batch, *x.shape[2:])


def _fold_all(args, dims, size, batch, may_broadcast=(3, 4)):
  return [_fold(x if d is NOT_MAPPED else jnp.moveaxis(x, d, 0), size, d is not NOT_MAPPED,
                batch, i in may_broadcast)
          for i, (x, d) in enumerate(zip(args, dims))]


def _sizes(args, dims):
  """(vmapped size, the query's B)."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
  q_shape = list(args[0].shape)
  if dims[0] is not NOT_MAPPED:
    del q_shape[dims[0]]
  return size, q_shape[0]


def _fwd_batch_rule(prim, args, dims, **params):
  """The forward and the forward-mode primitives: every operand but
  query_offset folds into B (a bias, a mask and the bias tangent, always last,
  may stay broadcast)."""
  if dims[_OFFSET] is not NOT_MAPPED:  # a per-example query_offset: vmap the reference
    return None
  size, batch = _sizes(args, dims)
  order = [i for i in range(len(args)) if i != _OFFSET]
  with_tangents = len(args) > _FORWARD_OPERANDS
  may_broadcast = (3, 4, len(order) - 1) if with_tangents else (3, 4)
  folded = _fold_all([args[i] for i in order], [dims[i] for i in order], size, batch,
                     may_broadcast)
  bias, dbias = folded[3], folded[-1]
  if with_tangents and not is_absent(dbias) and dbias.shape != bias.shape:
    # A tangent has its primal's shape: where one of them is batched, neither
    # stays broadcast along B.
    shape = np.broadcast_shapes(bias.shape, dbias.shape)
    folded[3], folded[-1] = jnp.broadcast_to(bias, shape), jnp.broadcast_to(dbias, shape)
  outs = prim(*folded[:_OFFSET], args[_OFFSET], *folded[_OFFSET:], **params)
  return [o.reshape(size, batch, *o.shape[1:]) for o in outs], (0,) * len(outs)


def _bwd_batch_rule(prim, args, dims, *, with_dbias, **params):
  if dims[_OFFSET] is not NOT_MAPPED:
    return None
  size, batch = _sizes(args, dims)
  args, dims = list(args), list(dims)
  bias_batched = dims[3] is not NOT_MAPPED
  bias = jnp.moveaxis(args[3], dims[3], 0) if bias_batched else args[3][None]
  if with_dbias:
    # dbias is per example: every (example, b) gets its own bias slot, and the
    # slots are summed back over b where the bias was broadcast along B.
    args[3] = jnp.broadcast_to(bias, (size, batch, *bias.shape[2:]))
    dims[3] = 0
  order = [i for i in range(len(args)) if i != _OFFSET]
  folded = _fold_all([args[i] for i in order], [dims[i] for i in order], size, batch)
  dq, dk, dv, dbias = prim(*folded[:_OFFSET], args[_OFFSET], *folded[_OFFSET:],
                           with_dbias=with_dbias, **params)
  unfold = lambda x: x.reshape(size, batch, *x.shape[1:])
  if with_dbias:
    dbias = unfold(dbias)
    if bias.shape[1] == 1:
      dbias = dbias.sum(axis=1, keepdims=True)
  else:
    dbias = jnp.broadcast_to(dbias[None], (size, *dbias.shape))
  return (unfold(dq), unfold(dk), unfold(dv), dbias), (0, 0, 0, 0)


# -- sharding: batch and heads shard; sequences and head_dim stay whole ----------------


def _sharding(extra_operands, results, ring):
  """Batch- and head-sharded attention runs locally on each shard.

  ``extra_operands``: the layouts of the operands after query_offset;
  ``results``: those of the results ("q" like the query, "kv" like a key,
  "bnts" like the bias, "bnt" like the log-sum-exp).

  With GQA the query heads are (kv_heads, group): they shard through the KV
  heads, so each shard holds whole groups with their KV heads. A bias or mask
  broadcast along B or N keeps that axis whole, and its gradient (the sum of
  the broadcast copies) is summed over the shards. The query and key sequence
  axes and head_dim stay whole: the kernel needs every key of a query row.

  With the ``context_parallel`` parameter (``attention(...,
  context_parallel="ring")``), the query and key sequences are one factor,
  ``seq``, which may shard: each shard then runs ``ring`` (``"forward"``,
  ``"forward_jvp"`` or ``"backward"``) of jaxops.ring_attention over its mesh
  axes instead of the kernel (``ring_attention.partitioned``).
  """

  def factors(avals_in, avals_out, **params):
    q, k = avals_in[0], avals_in[1]
    option = params.get("context_parallel")
    seq = None if option is None else "seq"
    B, _, N, _ = q.shape
    K = k.shape[2]
    if N == K or K == 1:
      # MHA: heads shard alike. MQA: query heads shard, the one KV head is whole.
      heads, kv_heads, sizes = "heads", ("heads" if N == K else None), {}
    else:
      heads, kv_heads, sizes = ("kv_heads", "group"), "kv_heads", {"group": N // K}

    def dims(aval, layout):
      if is_absent(aval):
        return (None,)
      if layout == "q":
        return ("batch", seq, heads, None)
      if layout == "kv":
        return ("batch", seq, kv_heads, None)
      if layout == "bnts":  # bias, mask and dbias: [B or 1, N or 1, T, S]
        return ("batch" if aval.shape[0] == B else None,
                heads if aval.shape[1] == N else None,
                seq if aval.shape[2] == q.shape[1] else None, None)
      if layout == "bnt":  # log-sum-exp
        return ("batch", heads, seq)
      if layout == "b":  # sequence lengths
        return ("batch",)
      if layout == "bt":  # segment ids: [B, T] or [B, S]; the sequence whole unless "seq"
        return ("batch", seq)
      return (None,) * aval.ndim  # query_offset

    operands = ["q", "kv", "kv", "bnts", "bnts", "b", "b", "bt", "bt", "scalar",
                *extra_operands]
    partitioned = None
    if option is not None:
      from jaxops._src import ring_attention  # it is built on this module
      partitioned = ring_attention.partitioned(ring, params)
    return Factors([dims(a, l) for a, l in zip(avals_in, operands)],
                   [dims(a, l) for a, l in zip(avals_out, results)], sizes, partitioned)

  return factors


attention_fwd_p = FfiPrimitive(
    name="jaxops_attention_fwd", target="jaxops_attention_fwd",
    abstract_eval=_fwd_abstract_eval, reference=_fwd_reference,
    batch_rule=_fwd_batch_rule, sharding=_sharding([], ["q", "bnt"], "forward"),
    reference_params=("context_parallel",))

attention_fwd_jvp_p = FfiPrimitive(
    name="jaxops_attention_fwd_jvp", target="jaxops_attention_fwd_jvp",
    abstract_eval=_fwd_jvp_abstract_eval, reference=_fwd_jvp_reference,
    batch_rule=_fwd_batch_rule,
    sharding=_sharding(["q", "kv", "kv", "bnts"], ["q", "bnt", "q", "bnt"], "forward_jvp"),
    reference_params=("context_parallel",))

attention_jvp_p = FfiPrimitive(
    name="jaxops_attention_jvp", target=None,
    abstract_eval=lambda q, *operands, **params: _fwd_abstract_eval(
        q, *operands[:_FORWARD_OPERANDS - 1], **params),
    reference=_jvp_reference, composite=_jvp_with_fused_kernel,
    # Folding the primals too keeps the fused kernel's batch rule on its batched path.
    batch_rule=_fwd_batch_rule)

attention_bwd_p = FfiPrimitive(
    name="jaxops_attention_bwd", target="jaxops_attention_bwd",
    abstract_eval=_bwd_abstract_eval, reference=_bwd_reference,
    batch_rule=_bwd_batch_rule,
    sharding=_sharding(["q", "bnt", "q", "bnt"], ["q", "kv", "kv", "bnts"], "backward"),
    reference_params=("context_parallel",))


def transpose_by(backward):
  """The transpose rule that runs ``backward`` (attention_bwd_p's operands and
  results: the backward kernel here, the backward ring in ring_attention);
  dbias (an extra pass) only when the bias is differentiated."""

  def transpose(cotangents, saved, wanted, **params):
    dout, dlse = cotangents
    operands, (out, lse) = saved[:_FORWARD_OPERANDS], saved[_FORWARD_OPERANDS:]
    with_dbias = wanted[3] is not None
    dq, dk, dv, dbias = backward(
        *operands, out, lse,
        jnp.zeros_like(out) if dout is None else dout, absent(_F32) if dlse is None else dlse,
        with_dbias=with_dbias, **params)
    return dq, dk, dv, dbias if with_dbias else None

  return transpose


Differentiable(
    forward=attention_fwd_p, tangent=attention_jvp_p, fused=attention_fwd_jvp_p,
    transpose=transpose_by(attention_bwd_p), tangent_inputs=(0, 1, 2, 3),
    saved_inputs=tuple(range(_FORWARD_OPERANDS)),
    saved_outputs=(0, 1), checkpoint_name="jaxops.attention")


# -- public function ------------------------------------------------------------------


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              return_residual=False, query_offset=0, logits_soft_cap=None,
              query_segment_ids=None, key_value_segment_ids=None, sinks=None, precision=None,
              implementation=None, context_parallel=None, context_parallel_layout="contiguous"):
  """Scaled dot-product attention, a drop-in for ``jax.nn.dot_product_attention``.

  ``softmax(scale * query @ key^T + bias, masked) @ value`` per head, computed
  by a fused flash-attention kernel (no [T, S] matrix is ever stored), with
  the soft cap (Gemma), segment ids (packed sequences), sinks (gpt-oss) and a
  value head dim of its own (MLA) of current models. Each logit is computed
  in this order, on every path:

  1. ``s = scale * q . k`` (float32 accumulation);
  2. with ``logits_soft_cap``: ``s = cap * tanh(s / cap)``;
  3. ``s + bias``;
  4. the masks, all and-ed: ``is_causal`` and ``local_window_size`` on
     positions ``t + query_offset`` and ``j``; the sequence lengths; equal
     segment ids; ``mask``;
  5. a softmax over the kept keys plus, with ``sinks``, one extra logit
     ``sinks[n]`` whose value vector is zero;
  6. ``out = P @ value``, of the value's head dim.

  Same arguments and values as jax.nn's for float32, bfloat16 and float16.
  Differences: ``return_residual``'s log-sum-exp is differentiable (jax.nn
  stops its gradient), a row with no attended key gives 0 (below), and the
  extra ``query_offset``, ``logits_soft_cap``, segment ids, ``sinks`` and
  ``precision``. float64 and complex inputs run the jnp reference and match
  ``flax.linen.dot_product_attention`` (the complex softmax
  ``exp(z) / sum(exp(z))``); jax.nn's casts the logits to float32 there,
  dropping their imaginary part and float64 precision.

  Args:
    query: [B, T, N, H] (or [T, N, H]): float32, bfloat16 or float16 (the
      kernel), or float64 or complex (the jnp reference).
    key: [B, S, K, H] (or [S, K, H]) with N a multiple of K (grouped-query and
      multi-query attention), the query's dtype (as jax.nn requires).
    value: [B, S, K, Hv] (or [S, K, Hv]), the key's dtype; Hv may differ from
      H (multi-head latent attention: H = 192, Hv = 128).
    bias: optional float array added to the logits after the soft cap,
      broadcastable to [B, N, T, S] (rank <= 4; missing leading axes are added,
      as jax.nn does); complex only for complex inputs.
    mask: optional boolean array broadcastable to [B, N, T, S]; True attends.
    scale: logit scale; default 1 / sqrt(H) (1 for H = 0, whose logits are 0).
    is_causal: query row t attends keys j <= t + query_offset.
    query_seq_lengths: optional int32 [B]: rows t >= query_seq_lengths[b]
      output 0.
    key_value_seq_lengths: optional int32 [B]: keys j >= key_value_seq_lengths[b]
      are masked.
    local_window_size: optional int or (left, right): row t attends keys with
      t + query_offset - left <= j <= t + query_offset + right.
    return_residual: also return the log-sum-exp of the logits (the sink's
      term included), [B, T, N] (or [T, N]) in the query's dtype; differentiable.
    query_offset: absolute position of query row 0 for the causal and window
      masks (decoding T new tokens against S cached ones: S - T). A Python int
      or an int32 scalar array, which may be traced.
    logits_soft_cap: optional Python float > 0: each scaled product becomes
      ``cap * tanh(s / cap)`` before the bias and the masks (Gemma 2 uses 50).
      Differentiable in query, key, value and bias.
    query_segment_ids: optional integer [B, T] (or [T]), with
      ``key_value_segment_ids`` [B, S] (or [S]): both or neither, any int32
      values, may be traced. Query t attends key j only where the two ids are
      equal (packed sequences: one id per document). Causal and windows still
      use the row's positions. A key tile that no query of a tile can attend
      is skipped whole, so packed attention costs about the sum of its
      documents'. Not differentiable.
    key_value_segment_ids: see ``query_segment_ids``.
    sinks: optional float [N] (float32 or the query's dtype): one logit per
      query head added to every row's softmax denominator with a zero value
      vector (gpt-oss's attention sinks). Differentiable; a NaN sink makes its
      head's rows NaN.
    precision: the float32 products' precision, as ``lax.dot``'s argument;
      None follows ``jax.default_matmul_precision``. As XLA's GPU dots, the
      CUDA kernels (forward, backward and JVP) may use TF32 tensor cores at the
      default and ``"high"`` precisions and compute in full float32 at
      ``"highest"``/``"float32"``; the CPU kernel, and the CUDA forward of
      decoding (few query rows per kv head, no bias or mask: the split-K
      decode kernels, bound by memory), are full float32 at every setting
      (docs/precision.md).
    implementation: None (the fused kernel where one exists, else the jnp
      reference), "ffi" (the kernel, or an error) or "xla" (the reference).
      The CPU and CUDA kernels take every argument (CUDA: head dims up to
      256; beyond, None runs the reference and "ffi" raises).
    context_parallel: None (the default) or ``"ring"``: how a sequence axis
      sharded under ``jax.jit`` (a NamedSharding splitting T and S over mesh
      axes) is partitioned. None: as for every op, the kernel needs the
      sequence whole and XLA all-gathers it (memory O(S) per device).
      ``"ring"``: the op's partitioning rule keeps the sequence sharded and
      each device runs :func:`jaxops.ring_attention`'s ring on its blocks
      (K/V passed around with ``ppermute``, memory O(S/P); forward, ``grad``
      and ``jvp``; a device's queries, keys and bias rows are its shard of
      the sequence axis). Needs T == S; on the kernel path only (the jnp
      reference, e.g. float64 or ``implementation="xla"``, is partitioned by
      XLA); unsharded, the result is the same as None's. Inside
      ``jax.shard_map``, call :func:`jaxops.ring_attention` instead
      (docs/sharding.md, "Ring attention").
    context_parallel_layout: with ``context_parallel="ring"``, the order of
      the sharded sequence: ``"contiguous"`` (natural order, shard d holds
      [d T/P, (d+1) T/P)) or ``"zigzag"`` (the arrays are in
      :func:`jaxops.zigzag_permute` order for P = the number of shards of
      the sequence axis, the bias's query rows too: the causal work is
      balanced; put the output back with :func:`jaxops.zigzag_unpermute`).

  Returns:
    The attention output [B, T, N, Hv] (or [T, N, Hv]) in the query's dtype,
    and the log-sum-exp when ``return_residual``. A row with no attended key
    returns 0 (jax.nn returns the mean of V there, an artifact of its
    large-negative fill) and log-sum-exp -inf (or its sink), with zero
    gradients.

  Raises:
    TypeError: an argument of the wrong type or dtype (a traced
      ``logits_soft_cap``, non-integer segment ids, non-float sinks).
    ValueError: a wrong shape or value (key/value axes that do not match the
      query's, segment ids of the wrong shape or only one of them, sinks of a
      length other than N, ``logits_soft_cap`` <= 0 or NaN); a
      ``context_parallel`` or ``context_parallel_layout`` not listed above,
      ``"zigzag"`` without ``"ring"``, ``"ring"`` with T != S.

  Example:
    >>> import jax.numpy as jnp, jaxops
    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> ids = jnp.array([[0, 0, 1, 1]])
    >>> out = jaxops.attention(q, k, v, is_causal=True, logits_soft_cap=50.0,
    ...                        query_segment_ids=ids, key_value_segment_ids=ids)
    >>> out.shape
    (1, 4, 2, 8)
  """
  op = "jaxops.attention"
  query = validation.float_array(op, "query", query, complex=True)
  key = validation.float_array(op, "key", key, complex=True)
  value = validation.float_array(op, "value", value, complex=True)
  validation.rank(op, "query", query, low=3, high=4, labels="[B, T, N, H] or [T, N, H]")
  unbatched = query.ndim == 3
  for name, x in (("key", key), ("value", value)):
    validation.rank(op, name, x, low=query.ndim, high=query.ndim, labels="the rank of query")
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  Hv = value.shape[3]
  if key.shape[0] != B or key.shape[3] != H:
    raise validation.value_error(
        op, "key", f"share query's batch ({B}) and head dim ({H}) in [B, S, K, H]",
        f"shape {key.shape} for query {query.shape}")
  if value.shape[:3] != key.shape[:3]:
    raise validation.value_error(
        op, "value", f"share key's batch, sequence and heads {key.shape[:3]} in [B, S, K, Hv]",
        f"shape {value.shape}")
  if key.dtype != query.dtype:
    raise validation.type_error(op, "key", f"have the dtype of query ({query.dtype})",
                                str(key.dtype))
  if value.dtype != key.dtype:
    raise validation.type_error(op, "value", f"have the dtype of key ({key.dtype})",
                                str(value.dtype))
  if K == 0 or N % K != 0:
    raise validation.value_error(
        op, "key", f"have a number of heads K that divides query's N = {N}", f"K = {K}")
  full = (B, N, T, S)
  if bias is not None:
    # A complex bias only with complex inputs: the kernels' bias is float32.
    bias = validation.float_array(op, "bias", bias, complex=jnp.iscomplexobj(query))
    bias = _broadcast_operand(op, "bias", bias, full, unbatched)
  if mask is not None:
    mask = _broadcast_operand(op, "mask", validation.bool_array(op, "mask", mask), full,
                              unbatched)
  q_lengths = _check_lengths(op, "query_seq_lengths", query_seq_lengths, B, unbatched)
  kv_lengths = _check_lengths(op, "key_value_seq_lengths", key_value_seq_lengths, B, unbatched)
  q_segments, kv_segments = _check_segment_ids(op, query_segment_ids, key_value_segment_ids,
                                               B, T, S, unbatched)
  window = _check_window(op, local_window_size)
  if scale is None:
    # An empty head vector's logits are 0 at any scale: 1 stands in for 1 / sqrt(0).
    scale = 1.0 / math.sqrt(H) if H > 0 else 1.0
  else:
    scale = validation.static_float(op, "scale", scale)
  soft_cap = (None if logits_soft_cap is None else validation.static_float(
      op, "logits_soft_cap", logits_soft_cap, low=0.0, low_open=True))
  sinks = check_sinks(op, sinks, N, query.dtype)
  is_causal = validation.static_bool(op, "is_causal", is_causal)
  return_residual = validation.static_bool(op, "return_residual", return_residual)
  partitioning = _check_context_parallel(op, context_parallel, context_parallel_layout, T, S,
                                         query_offset)
  query_offset = validation.int_scalar(op, "query_offset", query_offset)
  allow_tf32 = matmul_precision.allow_tf32(op, precision)

  if _use_kernel(op, implementation, query.dtype, H, Hv):
    window_left, window_right = window if window else (-1, -1)
    out, lse = attention_fwd_p(
        query, key, value,
        absent(_F32) if bias is None else bias.astype(_F32),
        absent(jnp.bool_) if mask is None else mask,
        absent(_I32) if q_lengths is None else q_lengths,
        absent(_I32) if kv_lengths is None else kv_lengths,
        absent(_I32) if q_segments is None else q_segments,
        absent(_I32) if kv_segments is None else kv_segments,
        query_offset, scale=scale, is_causal=is_causal, window_left=window_left,
        window_right=window_right, logits_soft_cap=soft_cap or 0.0, allow_tf32=allow_tf32,
        **partitioning)
    if sinks is not None:
      out, lse = merge_sinks(out, lse, sinks)
  else:
    out, lse = reference.attention_with_logsumexp(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        local_window_size=window, query_offset=query_offset, precision=precision,
        logits_soft_cap=soft_cap, query_segment_ids=q_segments,
        key_value_segment_ids=kv_segments, sinks=sinks)
  if unbatched:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  return out, jnp.swapaxes(lse, -1, -2).astype(query.dtype)


def merge_sinks(out, lse, sinks):
  """The results with each head's sink logit in the softmax: its zero value
  vector adds exp(sink) to the denominator only, so the output rescales by
  exp(lse - lse') with lse' = logaddexp(lse, sink). This is the exact merge of
  two partial softmaxes (as split-K decoding and ring attention combine
  blocks), done once, after the kernel: one elementwise pass that XLA fuses,
  on every backend and kernel (forward, backward through JAX's own rules for
  these few operations, forward mode), and differentiable in the sinks.
  """
  sink = sinks.astype(_F32)[None, :, None]
  merged = jnp.logaddexp(lse, sink)
  # A row with no attended key (lse -inf) keeps output 0, whatever its sink.
  attended = lse != -jnp.inf
  weight = jnp.where(attended, jnp.exp(jnp.where(attended, lse, 0.0) - merged), 0.0)
  # The rows' weights broadcast along the head dim as an outer product with
  # ones, not by broadcast_in_dim: the two are the same values, but the
  # transpose of a broadcast is a reduce over the head dim, which XLA's CPU
  # backend fuses with the product before it into a loop of 64-element rows
  # (30 ms at 1 x 4096 x 8 x 64, float32: 10% of a forward+backward), while
  # the outer product transposes to a dot with the ones vector (1.6 ms), a
  # dot with no batch dims, which every sharding of the rows keeps local
  # (batch dims made the partitioner gather the heads under explicit
  # axes). HIGHEST: a GPU's default float32 dot would round the weights to
  # TF32.
  ones = jnp.ones((out.shape[-1],), out.dtype)
  out = out * jnp.einsum("btn,h->btnh", jnp.swapaxes(weight, 1, 2).astype(out.dtype), ones,
                         precision=jax.lax.Precision.HIGHEST)
  return out, merged


# -- argument checks ---------------------------------------------------------------------


def _use_kernel(op, implementation, dtype, head_dim, value_head_dim):
  """primitive.use_kernel, and the platform's module must have the attention targets
  (the CPU one has; a CUDA build without them takes the reference) for these
  head dims (the CUDA kernels keep whole head vectors in shared memory). Every
  other argument runs on the kernels of both platforms."""
  if not primitive.use_kernel(op, implementation, {"query": dtype}):
    return False
  if head_dim != value_head_dim and min(head_dim, value_head_dim) == 0:
    # An empty head dim on one side only: the reference's (rare) case.
    if implementation == "ffi":
      raise ValueError(f"{op}: implementation='ffi': the kernels need head dims both > 0 "
                       f"when they differ, got H = {head_dim}, Hv = {value_head_dim}")
    return False
  platform = primitive.current_platform()
  if platform == "cuda" and max(head_dim, value_head_dim) > _CUDA_MAX_HEAD_DIM:
    if implementation == "ffi":
      raise ValueError(f"{op}: implementation='ffi': the CUDA attention kernel supports head "
                       f"dims up to {_CUDA_MAX_HEAD_DIM}, got {max(head_dim, value_head_dim)}")
    return False
  if attention_fwd_p.target in ffi_targets.targets(platform):
    return True
  if implementation == "ffi":
    raise ValueError(f"{op}: implementation='ffi': jaxops has no attention kernel for the "
                     f"{platform!r} backend")
  return False


def _check_segment_ids(op, query_ids, key_value_ids, batch, q_len, kv_len, unbatched):
  """Both or neither; integer [B, T] and [B, S] ([T] and [S] unbatched), as int32."""
  if query_ids is None and key_value_ids is None:
    return None, None
  if query_ids is None or key_value_ids is None:
    given, missing = (("query_segment_ids", "key_value_segment_ids") if key_value_ids is None
                      else ("key_value_segment_ids", "query_segment_ids"))
    raise validation.value_error(op, missing, f"be given with {given} (both or neither)",
                                 "None")
  checked = []
  for name, ids, length, axis in (("query_segment_ids", query_ids, q_len, "T"),
                                  ("key_value_segment_ids", key_value_ids, kv_len, "S")):
    ids = validation.integer_array(op, name, ids)
    if unbatched:
      validation.shape(op, name, ids, (length,), of=f"[{axis}]")
      ids = ids[None]
    else:
      validation.shape(op, name, ids, (batch, length), of=f"[B, {axis}]")
    checked.append(ids.astype(_I32))
  return tuple(checked)


def check_sinks(op, sinks, num_heads, query_dtype):
  """None, or a float [N] array of float32 or the query's dtype."""
  if sinks is None:
    return None
  if jnp.iscomplexobj(jnp.zeros((), query_dtype)):
    raise validation.type_error(op, "sinks", "be None with complex inputs",
                                validation.describe(sinks))
  sinks = validation.float_array(op, "sinks", sinks)
  if sinks.dtype not in (jnp.dtype(_F32), jnp.dtype(query_dtype)):
    raise validation.type_error(op, "sinks", f"have dtype float32 or the query's ({query_dtype})",
                                str(sinks.dtype))
  validation.shape(op, "sinks", sinks, (num_heads,), of="[N] (one per query head)")
  return sinks


def _broadcast_operand(op, name, x, full, unbatched):
  """bias or mask, broadcastable to [B, N, T, S] ([N, T, S] for unbatched
  inputs) and returned with rank 4: missing leading axes are added, as jax.nn does."""
  expected = full[1:] if unbatched else full
  validation.broadcastable(op, name, x, expected,
                           of="[N, T, S]" if unbatched else "[B, N, T, S]")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_lengths(op, name, x, batch, unbatched):
  if x is None:
    return None
  x = validation.integer_array(op, name, x)
  if unbatched and x.ndim == 0:
    x = x[None]
  validation.shape(op, name, x, (batch,), of="[B]")
  return x.astype(_I32)


def _check_context_parallel(op, strategy, layout, q_len, kv_len, query_offset) -> dict:
  """The primitives' ``context_parallel`` parameter ((strategy, layout, query_offset
  when a Python int), only when opted in, so that the default program is unchanged)."""
  strategy = validation.choice(op, "context_parallel", strategy, (None, "ring"))
  layout = validation.choice(op, "context_parallel_layout", layout, ("contiguous", "zigzag"))
  if strategy is None:
    if layout != "contiguous":
      raise validation.value_error(op, "context_parallel_layout",
                                   "be 'contiguous' without context_parallel='ring'", repr(layout))
    return {}
  if q_len != kv_len:
    raise validation.value_error(
        op, "context_parallel", "be None when the query and key sequences differ in length "
        "(the ring partitions them as one sequence axis; use jaxops.ring_attention inside "
        "jax.shard_map)", f"'ring' with T = {q_len}, S = {kv_len}")
  known = (int(query_offset) if isinstance(query_offset, (int, np.integer))
           and not isinstance(query_offset, bool) else None)
  return {"context_parallel": (strategy, layout, known)}


def _check_window(op, window):
  """None, a non-negative int, or a pair of them: (left, right) or None."""
  if window is None:
    return None
  if not isinstance(window, (tuple, list)):
    window = (window, window)
  elif len(window) != 2:
    raise validation.type_error(op, "local_window_size", "be None, an int or a pair of ints",
                                f"{len(window)} values")
  return (validation.non_negative_int(op, "local_window_size", window[0]),
          validation.non_negative_int(op, "local_window_size", window[1]))
