"""ring_attention: attention over a sequence split along a mesh axis (context
parallelism), called inside ``jax.shard_map`` on each device's blocks.

Each device holds a block of the queries and a block of the keys and values of
one long sequence. With ``strategy="ring"`` the queries stay where they are and
the K/V blocks travel around the ring of the mesh axis (``jax.lax.ppermute``):
at every step each device runs the fused attention kernel of its queries
against the block it holds, with the global positions of both (so causal masks,
windows and sequence lengths mean what they mean on one device), and merges the
partial result into its running (output, log-sum-exp) by log-sum-exp, always in
the ring's order, so the result is bitwise reproducible. The next block's
transfer is issued before the current block's kernel, so XLA can overlap them.
Memory is O(S/P) per device: one K/V block in use and one in flight.

Three primitives, as for attention (docs/autodiff.md): the forward ring, its
fused forward-mode ring (the attention JVP kernel per block, output and
log-sum-exp tangents merged with the primals) and the backward ring, which
transposes the tangent. The backward passes K/V and the float32 dK/dV
accumulators of the block around the ring and runs attention's backward kernel
per block with the *global* output and log-sum-exp (FlashAttention's
``dS = P * (dP - rowsum(dO * O))`` with ``P = exp(S - lse)`` holds per block
when lse is the whole row's), so nothing per step is saved: ``grad`` keeps q,
k, v, the output and the log-sum-exp, all local. The primitives are
compositions of attention's primitives and collectives (no kernel of their
own); their references run the same ring on the jnp reference of a block,
which is also what other platforms (and ``implementation="xla"``) run and what
second derivatives differentiate.

Sinks are merged once, after the ring (``merge_sinks``), not once per block.

Layouts. ``"contiguous"``: device ``d`` holds positions ``[d * T/P, (d+1) * T/P)``
(what ``P(None, axis)`` on a natural sequence gives). ``"zigzag"``: the
sequence is cut into 2P chunks and device ``d`` holds chunks ``d`` and
``2P-1-d`` (``zigzag_permute`` puts a sequence in that order), so that under a
causal mask every device has the same work. A kernel call's query_offset
describes one contiguous run of positions, so under zigzag with anything that
depends on positions (causal, window, lengths, a bias or mask) each step makes
up to four calls, one per (query chunk, key chunk) pair; without positions the
whole blocks go in one call.

Skipping. A step that the causal mask or the window leaves empty on every device
(known at trace time when ``query_offset`` is a Python int) is not in the
program: its kernel is not called and the K/V block jumps over it (one
ppermute by several hops), so a window visits only its neighbouring blocks.
A pair empty on some devices only is skipped inside the kernel, by its
per-tile position bounds, rather than by a ``lax.cond``: a conditional on the
GPU reads its predicate on the host, a synchronisation per step that would
stall the overlap of transfers and kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import attention as _attention
from jaxops._src import matmul_precision, validation
from jaxops._src.attention import (
    attention, attention_bwd_p, attention_fwd_jvp_p, attention_fwd_p, check_sinks, merge_sinks)
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import FfiPrimitive, absent, is_absent, vary, vma

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "all_gather")

_OP = "jaxops.ring_attention"
_F32 = jnp.float32
_I32 = jnp.int32

# Operands of the forward ring, as attention_fwd_p's: q, k, v, bias, mask,
# q_lengths, kv_lengths, q_segments, kv_segments, query_offset.
_FORWARD_OPERANDS = 10
# The parameters of attention's primitives; the ring's own are axis_name,
# axis_size, layout and known_offset (query_offset when it is a Python int).
_KERNEL_PARAMS = ("scale", "is_causal", "window_left", "window_right", "logits_soft_cap",
                  "allow_tf32")


def _kernel_params(params):
  return {name: params[name] for name in _KERNEL_PARAMS}


# -- the plan: which blocks meet at which step -------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static plan of a ring, the same on every device.

  At step ``s`` device ``i`` holds the K/V block of device ``(i - s) mod P``.
  ``pieces``: the chunks a local block is cut into for the kernel calls (2
  under zigzag when positions matter, else 1), of ``q_chunk`` query rows and
  ``k_chunk`` keys. ``steps``: ``(s, pairs)`` for every step some device has
  work in, in order; ``pairs`` the (query chunk, key chunk) calls of the step.
  """

  axis_name: Any
  size: int
  layout: str
  pieces: int
  q_chunk: int
  k_chunk: int
  steps: tuple

  def chunk(self, device, piece):
    """The global chunk index of a device's local chunk (chunks of the block's size
    for the contiguous layout, of half of it for zigzag)."""
    if self.layout == "contiguous":
      return device
    return device if piece == 0 else 2 * self.size - 1 - device

  def q_start(self, device, piece):
    return self.chunk(device, piece) * self.q_chunk

  def k_start(self, device, piece):
    return self.chunk(device, piece) * self.k_chunk

  def source(self, device, step):
    """The device whose K/V block ``device`` holds at ``step``."""
    return (device + (self.size - step)) % self.size


def _positional(bias, mask, q_lengths, kv_lengths, params) -> bool:
  """Whether anything depends on global positions (else a block is a bag of keys)."""
  return (params["is_causal"] or params["window_left"] >= 0 or not is_absent(bias)
          or not is_absent(mask) or not is_absent(q_lengths) or not is_absent(kv_lengths))


def _pair_attends(q_pos, k_pos, q_rows, k_rows, is_causal, window_left, window_right) -> bool:
  """Whether some query at ``q_pos..q_pos+q_rows`` may attend some key at
  ``k_pos..k_pos+k_rows`` under the causal mask and the window (Python ints)."""
  if q_rows == 0 or k_rows == 0:
    return False
  low, high = k_pos - (q_pos + q_rows - 1), k_pos + k_rows - 1 - q_pos  # key minus query
  if is_causal:
    high = min(high, 0)
  if window_left >= 0:
    low, high = max(low, -window_left), min(high, window_right)
  return low <= high


def _plan(T, S, positional, *, axis_name, axis_size, layout, known_offset, is_causal,
          window_left, window_right, **unused) -> _Ring:
  pieces = 2 if layout == "zigzag" and positional else 1
  ring = _Ring(axis_name, axis_size, layout, pieces, T // pieces, S // pieces, ())
  decidable = known_offset is not None and (is_causal or window_left >= 0)
  if T == 0 or S == 0:  # no query or no key: every row is empty, no step runs
    return ring

  def needed(s, a, b):  # on some device, when that is known at trace time
    return not decidable or any(
        _pair_attends(ring.q_start(i, a) + known_offset, ring.k_start(ring.source(i, s), b),
                      ring.q_chunk, ring.k_chunk, is_causal, window_left, window_right)
        for i in range(axis_size))

  steps = []
  for s in range(axis_size):
    pairs = tuple((a, b) for a in range(pieces) for b in range(pieces) if needed(s, a, b))
    if pairs:
      steps.append((s, pairs))
  return dataclasses.replace(ring, steps=tuple(steps))


def _ring_of(q, k, bias, mask, q_lengths, kv_lengths, params) -> _Ring:
  return _plan(q.shape[1], k.shape[1], _positional(bias, mask, q_lengths, kv_lengths, params),
               **params)


def _shift(ring: _Ring, tree, hops: int):
  """``tree`` sent ``hops`` devices along the ring (device d to d + hops)."""
  hops %= ring.size
  if hops == 0:
    return tree
  perm = [(d, (d + hops) % ring.size) for d in range(ring.size)]
  return lax.ppermute(tree, ring.axis_name, perm)


def _rows(x, piece, size, axis):
  """Chunk ``piece`` (of ``size``) of ``x`` along ``axis``; absent stays absent."""
  if is_absent(x):
    return x
  index = [slice(None)] * x.ndim
  index[axis] = slice(piece * size, (piece + 1) * size)
  return x[tuple(index)]


class _Pair:
  """The operands of one kernel call: query chunk ``a`` of this device against key
  chunk ``b`` of the block it holds at ``step``."""

  def __init__(self, ring: _Ring, device, step, a, b):
    self.ring, self.a, self.b = ring, a, b
    self.split = ring.pieces > 1
    self.q_start = ring.q_start(device, a)
    self.k_start = ring.k_start(ring.source(device, step), b)

  def query_rows(self, x, axis=1):
    """The pair's query rows of a [B, T, ...] (axis 1) or [B, N, T] (axis 2) array."""
    return _rows(x, self.a, self.ring.q_chunk, axis) if self.split else x

  def keys(self, x):
    return _rows(x, self.b, self.ring.k_chunk, 1) if self.split else x

  def bias(self, x):
    """A bias or mask [B|1, N|1, T|1, S_global|1]: the pair's rows and keys."""
    if is_absent(x):
      return x
    if x.shape[2] != 1:
      x = self.query_rows(x, axis=2)
    if x.shape[3] != 1:
      x = lax.dynamic_slice_in_dim(x, self.k_start, self.ring.k_chunk, axis=3)
    return x

  def add_bias_gradient(self, total, grad):
    """``total`` (shaped as the bias) plus a pair's bias gradient at its place."""
    rows = (self.a * self.ring.q_chunk if self.split else 0) if total.shape[2] != 1 else 0
    cols = self.k_start if total.shape[3] != 1 else 0
    start = (0, 0, rows, cols)
    current = lax.dynamic_slice(total, start, grad.shape)
    return lax.dynamic_update_slice(total, current + grad, start)

  def operands(self, q, kv, bias, mask, q_lengths, kv_lengths, q_segments, query_offset):
    """attention_fwd_p's ten operands for this pair; ``kv`` is (k, v, kv_segments)."""
    k, v, kv_segments = kv
    ring = self.ring
    q_len, kv_len = q_lengths, kv_lengths
    if not is_absent(q_lengths):
      q_len = jnp.clip(q_lengths - self.q_start, 0, ring.q_chunk).astype(_I32)
    if not is_absent(kv_lengths):
      kv_len = jnp.clip(kv_lengths - self.k_start, 0, ring.k_chunk).astype(_I32)
    offset = (query_offset + self.q_start - self.k_start).astype(_I32)
    return (self.query_rows(q), self.keys(k), self.keys(v), self.bias(bias), self.bias(mask),
            q_len, kv_len, self.query_rows(q_segments), self.keys(kv_segments), offset)


# -- merging partial results by log-sum-exp ---------------------------------------------------


def _weights(l1, l2):
  """The merged log-sum-exp of two partial softmaxes and each one's weight in it.

  A row empty in both (-inf twice) stays -inf with weights 0; a NaN stays NaN.
  The shift is a constant to differentiation (the result does not depend on
  it), so the reference ring differentiates without NaNs at empty rows."""
  shift = lax.stop_gradient(jnp.maximum(l1, l2))
  shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
  w1, w2 = jnp.exp(l1 - shift), jnp.exp(l2 - shift)
  total = w1 + w2
  attended = total != 0
  safe = jnp.where(attended, total, 1.0)
  merged = jnp.where(attended, shift + jnp.log(safe), -jnp.inf)
  return merged, w1 / safe, w2 / safe


def _per_row(weight):
  """[B, N, T] weights as [B, T, N, 1], to scale outputs [B, T, N, H]."""
  return jnp.swapaxes(weight, 1, 2)[..., None]


def _merge(acc, part):
  """Running (out, lse[, dout, dlse]) merged with a block's (out in the
  accumulator's precision)."""
  o1, l1 = acc[:2]
  o2, l2 = part[0].astype(o1.dtype), part[1]
  merged, w1, w2 = _weights(l1, l2)
  out = o1 * _per_row(w1) + o2 * _per_row(w2)
  if len(acc) == 2:
    return out, merged
  # Tangents: d(w1 o1 + w2 o2) with dw1 = w1 (dl1 - dl), dw2 = w2 (dl2 - dl).
  do1, dl1 = acc[2:]
  do2, dl2 = part[2].astype(o1.dtype), part[3]
  dl = w1 * dl1 + w2 * dl2
  dout = (_per_row(w1) * (do1 + o1 * _per_row(dl1 - dl))
          + _per_row(w2) * (do2 + o2 * _per_row(dl2 - dl)))
  return out, merged, dout, dl


def _accumulator_dtype(dtype):
  """Running outputs and log-sum-exps: float32 (float64 for float64 inputs)."""
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else _F32


def _no_rows_yet(q, v, rows, axes, with_tangents):
  """The running (out, lse[, dout, dlse]) of rows that have attended nothing:
  merging a block into it returns the block's own values exactly."""
  B, _, N, _ = q.shape
  dtype = _accumulator_dtype(q.dtype)
  out = vary(jnp.zeros((B, rows, N, v.shape[3]), dtype), axes)
  lse = vary(jnp.full((B, N, rows), -jnp.inf, dtype), axes)
  return (out, lse, out, jnp.zeros_like(lse)) if with_tangents else (out, lse)


# -- the rings -------------------------------------------------------------------------------


def _travelling(*arrays):
  """The present arrays of a block (absent ones stay home: nothing to send)."""
  return tuple(x for x in arrays if not is_absent(x))


def _unpack(present, like):
  it = iter(present)
  return tuple(x if is_absent(x) else next(it) for x in like)


def _runs(ring: _Ring):
  """The steps grouped for the driver: (first step, count, pairs, hops from the
  previous step (None at the first), hops to the next (None at the last)).
  Consecutive steps alike (the middle of the ring) form one run: a loop."""
  runs = []
  for index, (step, pairs) in enumerate(ring.steps):
    hops_in = None if index == 0 else step - ring.steps[index - 1][0]
    hops_out = None if index + 1 == len(ring.steps) else ring.steps[index + 1][0] - step
    if runs and hops_in == 1 and runs[-1][2:] == (pairs, hops_in, hops_out):
      runs[-1] = (runs[-1][0], runs[-1][1] + 1, *runs[-1][2:])
    else:
      runs.append((step, 1, pairs, hops_in, hops_out))
  return runs


def _drive(ring: _Ring, home, state, compute):
  """Runs ``compute(step, pairs, hops_in, block, state) -> state`` at every step of
  the ring, on the K/V block (``home``: this device's) held at that step.

  Each step first issues the transfer of its block to the next holder (the
  kernels of the step do not depend on it, so XLA can overlap them). The middle
  of the ring, whose steps are alike, is a ``fori_loop``: only the block in use
  and the one in flight are live (an unrolled ring leaves XLA free to start
  every transfer at once and hold all P blocks: O(S) memory, as the CPU
  scheduler does)."""
  runs = _runs(ring)
  if not runs:
    return state
  held = _shift(ring, _travelling(*home), runs[0][0])

  def step(s, pairs, hops_in, hops_out, held, state):
    following = None if hops_out is None else _shift(ring, held, hops_out)
    return following, compute(s, pairs, hops_in, _unpack(held, home), state)

  for first, count, pairs, hops_in, hops_out in runs:
    if count == 1:
      held, state = step(first, pairs, hops_in, hops_out, held, state)
    else:
      held, state = lax.fori_loop(
          first, first + count,
          lambda s, carry, pairs=pairs, hops_in=hops_in, hops_out=hops_out: step(
              s, pairs, hops_in, hops_out, *carry), (held, state))
  return state


def _varying_axes(*arrays):
  return frozenset().union(*(vma(jax.typeof(x)) for x in arrays))


def _forward_ring(block, operands, tangents, params):
  """The forward ring (``tangents`` None) or the forward-mode one (the tangents of
  q, k, v and the bias, absent where zero): each device's (out, lse[, their
  tangents]) over every block, merged in the ring's order.

  ``block(*ten operands[, *four tangents], **kernel params)`` is attention's
  forward (or fused forward-mode) primitive or its reference."""
  q, k, v, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments, query_offset = operands
  with_tangents = tangents is not None
  dq, dk, dv, dbias = tangents if with_tangents else (None,) * 4
  ring = _ring_of(q, k, bias, mask, q_lengths, kv_lengths, params)
  kernel = _kernel_params(params)
  device = lax.axis_index(ring.axis_name)
  home = (k, v, kv_segments) + ((dk, dv) if with_tangents else ())
  rows = ring.q_chunk if ring.pieces > 1 else q.shape[1]
  axes = _varying_axes(q, k, v)

  def compute(step, pairs, hops_in, block_arrays, accumulators):
    accumulators = list(accumulators)
    for a, b in pairs:
      pair = _Pair(ring, device, step, a, b)
      args = pair.operands(q, block_arrays[:3], bias, mask, q_lengths, kv_lengths, q_segments,
                           query_offset)
      if with_tangents:
        args += (pair.query_rows(dq), pair.keys(block_arrays[3]), pair.keys(block_arrays[4]),
                 pair.bias(dbias))
      accumulators[a] = _merge(accumulators[a], tuple(block(*args, **kernel)))
    return tuple(accumulators)

  empty = tuple(_no_rows_yet(q, v, rows, axes, with_tangents) for _ in range(ring.pieces))
  results = _drive(ring, home, empty, compute)
  joined = [jnp.concatenate([r[i] for r in results], axis=1 if i % 2 == 0 else 2)
            for i in range(len(results[0]))]
  return tuple(x.astype(q.dtype) if i % 2 == 0 else x.astype(_accumulator_dtype(q.dtype))
               for i, x in enumerate(joined))


def _backward_ring(operands, out, lse, dout, dlse, *, with_dbias, **params):
  """dq, dk, dv (and dbias) by the ring, in float32.

  The K/V blocks go around as in the forward; each block's dK/dV accumulator
  follows it one step behind: the accumulator a device sends at the start of a
  step holds the gradients of the block it held the step before, so the
  transfer overlaps the step's kernels too, and after the last step one more
  transfer takes each accumulator to its block's owner. Every block's gradients
  come from attention's backward kernel with the global out and lse."""
  q, k, v, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments, query_offset = operands
  ring = _ring_of(q, k, bias, mask, q_lengths, kv_lengths, params)
  kernel = _kernel_params(params)
  device = lax.axis_index(ring.axis_name)
  rows = ring.q_chunk if ring.pieces > 1 else q.shape[1]
  keys = ring.k_chunk if ring.pieces > 1 else k.shape[1]
  axes = _varying_axes(q, k, v)
  zeros = lambda shape: vary(jnp.zeros(shape, _F32), axes)
  no_dkv = tuple(zeros((x.shape[0], keys, *x.shape[2:])) for _ in range(ring.pieces)
                 for x in (k, v))

  def compute(step, pairs, hops_in, block_arrays, state):
    dq, pending, dbias = state
    dq = list(dq)
    # This block's accumulator, sent by its previous holder.
    dkv = list(no_dkv if hops_in is None else _shift(ring, pending, hops_in))
    for a, b in pairs:
      pair = _Pair(ring, device, step, a, b)
      args = pair.operands(q, block_arrays, bias, mask, q_lengths, kv_lengths, q_segments,
                           query_offset)
      grads = attention_bwd_p(
          *args, pair.query_rows(out), pair.query_rows(lse, axis=2), pair.query_rows(dout),
          pair.query_rows(dlse, axis=2), with_dbias=with_dbias, **kernel)
      dq[a] = dq[a] + grads[0].astype(_F32)
      dkv[2 * b] = dkv[2 * b] + grads[1].astype(_F32)
      dkv[2 * b + 1] = dkv[2 * b + 1] + grads[2].astype(_F32)
      if with_dbias:
        dbias = pair.add_bias_gradient(dbias, grads[3])
    return tuple(dq), tuple(dkv), dbias

  state = (tuple(zeros((q.shape[0], rows, *q.shape[2:])) for _ in range(ring.pieces)), no_dkv,
           zeros(bias.shape) if with_dbias else None)
  dq, dkv, dbias = _drive(ring, (k, v, kv_segments), state, compute)
  if ring.steps:
    dkv = _shift(ring, dkv, -ring.steps[-1][0])  # home, to the block's owner
  dk, dv = jnp.concatenate(dkv[0::2], axis=1), jnp.concatenate(dkv[1::2], axis=1)
  return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          dbias if with_dbias else absent(_F32))


# -- primitives ------------------------------------------------------------------------------


def _reference_forward(*operands, **params):
  """The ring on the jnp reference of a block: the primitives' specification."""
  return _forward_ring(_attention._fwd_reference, operands, None, params)


def _kernel_forward(*operands, **params):
  return _forward_ring(attention_fwd_p, operands, None, params)


def _kernel_forward_jvp(*args, **params):
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS:]
  return _forward_ring(attention_fwd_jvp_p, operands, tangents, params)


def _reference_forward_jvp(*args, **params):
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS:]

  def forward(q, k, v, bias):
    return _reference_forward(q, k, v, bias, *operands[4:], **params)

  primals = operands[:4]
  tangents = tuple(jnp.zeros_like(p) if is_absent(t) else t for p, t in zip(primals, tangents))
  (out, lse), (dout, dlse) = jax.jvp(forward, primals, tangents)
  return out, lse, dout, dlse


def _reference_tangent(*args, **params):
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS + 2:]
  return _reference_forward_jvp(*operands, *tangents, **params)[2:]


def _kernel_tangent(*args, **params):
  """The tangents alone (a linearized ring evaluated): the forward-mode ring, its
  primal results dropped."""
  operands, tangents = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS + 2:]
  return _kernel_forward_jvp(*operands, *tangents, **params)[2:]


def _reference_backward(*args, with_dbias, **params):
  operands, (out, lse, dout, dlse) = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS:]
  del out, lse  # recomputed, so that the reference differentiates exactly

  def forward(q, k, v, bias):
    return _reference_forward(q, k, v, bias, *operands[4:], **params)

  (_, lse_ref), vjp = jax.vjp(forward, *operands[:4])
  dlse = jnp.zeros_like(lse_ref) if is_absent(dlse) else dlse
  dq, dk, dv, dbias = vjp((dout, dlse))
  return dq, dk, dv, dbias if with_dbias else absent(_F32)


def _kernel_backward(*args, **params):
  operands, (out, lse, dout, dlse) = args[:_FORWARD_OPERANDS], args[_FORWARD_OPERANDS:]
  return _backward_ring(operands, out, lse, dout, dlse, **params)


ring_attention_fwd_p = FfiPrimitive(
    name="jaxops_ring_attention_fwd", target=None, composite=_kernel_forward,
    abstract_eval=_attention._fwd_abstract_eval, reference=_reference_forward)

ring_attention_fwd_jvp_p = FfiPrimitive(
    name="jaxops_ring_attention_fwd_jvp", target=None, composite=_kernel_forward_jvp,
    abstract_eval=_attention._fwd_jvp_abstract_eval, reference=_reference_forward_jvp)

ring_attention_jvp_p = FfiPrimitive(
    name="jaxops_ring_attention_jvp", target=None, composite=_kernel_tangent,
    abstract_eval=lambda q, *operands, **params: _attention._fwd_abstract_eval(
        q, *operands[:_FORWARD_OPERANDS - 1], **params),
    reference=_reference_tangent)

ring_attention_bwd_p = FfiPrimitive(
    name="jaxops_ring_attention_bwd", target=None, composite=_kernel_backward,
    abstract_eval=_attention._bwd_abstract_eval, reference=_reference_backward)


Differentiable(
    forward=ring_attention_fwd_p, tangent=ring_attention_jvp_p, fused=ring_attention_fwd_jvp_p,
    transpose=_attention.transpose_by(ring_attention_bwd_p), tangent_inputs=(0, 1, 2, 3),
    saved_inputs=tuple(range(_FORWARD_OPERANDS)),
    saved_outputs=(0, 1), checkpoint_name="jaxops.ring_attention")


# -- under jit: attention's partitioning rule runs these rings ------------------------------


def partitioned(kind, params):
  """What attention's primitives run on each shard when ``jaxops.attention(...,
  context_parallel="ring")`` meets a sharded sequence under ``jax.jit``.

  ``kind``: ``"forward"``, ``"forward_jvp"`` or ``"backward"``, the primitive
  (attention_fwd_p, attention_fwd_jvp_p, attention_bwd_p) whose
  ``custom_partitioning`` asks; ``params`` its parameters, whose
  ``context_parallel`` is (strategy, layout, query_offset if static). Returns
  ``build(axes, mesh)`` for :class:`jaxops._src.sharding.Factors`: None when
  the sequence factor got no mesh axis (the kernel runs on local shapes), else
  the ring of this module over those axes: the same functions as
  ``ring_attention``'s primitives, on the shards' blocks (the partitioning
  traces them with the mesh's axis names bound, so ppermute runs over them)."""
  _, layout, known_offset = params["context_parallel"]
  kernel = _kernel_params(params)

  def build(axes, mesh):
    names = axes.get("seq")
    if not names:
      return None
    ring = dict(axis_name=names[0] if len(names) == 1 else tuple(names),
                axis_size=int(np.prod([mesh.shape[a] for a in names])), layout=layout,
                known_offset=known_offset, **kernel)
    if kind == "forward":
      run = lambda *operands: _kernel_forward(*operands, **ring)
    elif kind == "forward_jvp":
      run = lambda *args: _kernel_forward_jvp(*args, **ring)
    else:
      run = lambda *args: _kernel_backward(*args, with_dbias=params["with_dbias"], **ring)

    def lower(*local_operands):
      if layout == "zigzag" and local_operands[0].shape[1] % 2:
        raise validation.value_error(
            "jaxops.attention", "context_parallel_layout", "be 'contiguous' when a shard of "
            "the sequence has an odd length (zigzag: two chunks per shard, a length "
            "divisible by 2P)", f"'zigzag' with local length {local_operands[0].shape[1]}")
      return tuple(run(*local_operands))

    return lower

  return build


# -- the zigzag layout -------------------------------------------------------------------


def _zigzag_order(axis_size):
  return [c for d in range(axis_size) for c in (d, 2 * axis_size - 1 - d)]


def _reorder_chunks(op, x, axis_size, axis, order):
  x = jnp.asarray(x)
  axis_size = validation.positive_int(op, "axis_size", axis_size)
  axis = validation.axis(op, "axis", axis, x.ndim)
  length = x.shape[axis]
  chunks = 2 * axis_size
  if length % chunks:
    raise validation.value_error(
        op, "x", f"have a length along axis {axis} divisible by 2 * axis_size = {chunks}",
        f"shape {x.shape}")
  split = x.reshape(*x.shape[:axis], chunks, length // chunks, *x.shape[axis + 1:])
  return jnp.take(split, jnp.asarray(order), axis=axis).reshape(x.shape)


def zigzag_permute(x, axis_size, axis=1):
  """A sequence reordered into the zigzag layout of ``ring_attention``.

  The axis is cut into ``2 * axis_size`` equal chunks and reordered as chunks
  ``0, 2P-1, 1, 2P-2, ..., P-1, P``: split contiguously over ``axis_size``
  devices (``PartitionSpec(None, axis_name)``), device ``d`` then holds chunks
  ``d`` and ``2P-1-d``, so that a causal mask gives every device the same work.
  Apply it to the queries, keys, values and segment ids before sharding them
  (a bias or mask's query rows too; its key axis stays in natural order), and
  :func:`zigzag_unpermute` to the outputs.

  Args:
    x: an array whose ``axis`` is the whole sequence, of a length divisible by
      ``2 * axis_size``.
    axis_size: P, the number of devices of the ring.
    axis: the sequence axis (1 for [B, S, ...]).

  Returns:
    ``x`` with the chunks of ``axis`` in zigzag order.

  Raises:
    ValueError: the length is not divisible by ``2 * axis_size``.

  Example:
    >>> jaxops.zigzag_permute(jnp.arange(8), axis_size=2, axis=0)
    Array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
  """
  return _reorder_chunks("jaxops.zigzag_permute", x, axis_size, axis, _zigzag_order(axis_size))


def zigzag_unpermute(x, axis_size, axis=1):
  """The inverse of :func:`zigzag_permute`: a zigzag-ordered sequence in natural order.

  Args:
    x: an array whose ``axis`` is a whole sequence in zigzag order.
    axis_size: P, the number of devices of the ring.
    axis: the sequence axis.

  Returns:
    ``x`` with the chunks of ``axis`` in natural order.

  Raises:
    ValueError: the length is not divisible by ``2 * axis_size``.

  Example:
    >>> x = jnp.arange(8)
    >>> jaxops.zigzag_unpermute(jaxops.zigzag_permute(x, 2, axis=0), 2, axis=0)
    Array([0, 1, 2, 3, 4, 5, 6, 7], dtype=int32)
  """
  order = _zigzag_order(validation.positive_int("jaxops.zigzag_unpermute", "axis_size",
                                                axis_size))
  inverse = sorted(range(len(order)), key=order.__getitem__)
  return _reorder_chunks("jaxops.zigzag_unpermute", x, axis_size, axis, inverse)


# -- the all-gather strategy ----------------------------------------------------------------


def _all_gather_attention(query, key, value, bias, mask, q_lengths, kv_lengths, q_segments,
                          kv_segments, query_offset, *, axis_name, axis_size, layout, sinks,
                          implementation, precision, attention_kwargs):
  """K/V (and their segment ids) gathered once, in natural order; the local queries
  in one call per contiguous run of positions (two under zigzag)."""

  def gathered(x):
    if x is None:
      return None
    whole = lax.all_gather(x, axis_name, axis=1, tiled=True)
    return zigzag_unpermute(whole, axis_size, axis=1) if layout == "zigzag" else whole

  key, value, kv_segments = gathered(key), gathered(value), gathered(kv_segments)
  device = lax.axis_index(axis_name)
  pieces = 2 if layout == "zigzag" else 1
  rows = query.shape[1] // pieces

  def query_rows(x, piece, axis=1):
    if x is None or pieces == 1 or x.shape[axis] == 1:  # absent, whole, or broadcast rows
      return x
    return _rows(x, piece, rows, axis)

  outs, lses = [], []
  for piece in range(pieces):
    start = (device if piece == 0 else 2 * axis_size - 1 - device) * rows
    q_len = None if q_lengths is None else jnp.clip(q_lengths - start, 0, rows).astype(_I32)
    out, lse = attention(
        query_rows(query, piece), key, value, query_rows(bias, piece, 2),
        query_rows(mask, piece, 2), query_seq_lengths=q_len, key_value_seq_lengths=kv_lengths,
        query_offset=query_offset + start, query_segment_ids=query_rows(q_segments, piece),
        key_value_segment_ids=kv_segments, sinks=sinks, precision=precision,
        implementation=implementation, return_residual=True, **attention_kwargs)
    outs.append(out)
    lses.append(lse)
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


# -- public function -------------------------------------------------------------------------


def _axis_size(axis_name) -> int:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise validation.type_error(_OP, "axis_name", "be a mesh axis name (str) or a tuple of them",
                                validation.describe(axis_name))
  try:
    return int(lax.axis_size(axis_name))
  except NameError:
    raise validation.value_error(
        _OP, "axis_name", "name an axis of the enclosing jax.shard_map's mesh (call "
        "ring_attention inside jax.shard_map, on each device's sequence blocks)",
        repr(axis_name)) from None


def ring_attention(query, key, value, bias=None, mask=None, *, axis_name, layout="contiguous",
                   strategy="ring", scale=None, is_causal=False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None, return_residual=False,
                   query_offset=0, logits_soft_cap=None, query_segment_ids=None,
                   key_value_segment_ids=None, sinks=None, precision=None, implementation=None):
  """Attention over a sequence split along a mesh axis (context parallelism),
  called inside ``jax.shard_map`` with each device's blocks of the sequence.

  The result on each device is the rows of ``jaxops.attention`` on the whole
  sequence for that device's queries: same arguments, same formula (see
  :func:`jaxops.attention`), with causal masks, windows and sequence lengths on
  global positions. ``jax.grad``, ``jax.jvp`` and ``jax.vmap`` work, and the
  memory per device is O(S/P) in every mode with ``strategy="ring"``:
  docs/sharding.md ("Ring attention") explains the design and when each
  strategy wins.

  Args:
    query: this device's queries [B, T/P, N, H] (or [T/P, N, H]): float32,
      bfloat16 or float16 (the kernels), or float64 (the jnp reference).
    key: this device's keys [B, S/P, K, H] (N a multiple of K), the query's dtype.
    value: this device's values [B, S/P, K, Hv], the key's dtype.
    bias: optional float bias broadcastable to [B, N, T/P, S]: this device's
      query rows (in the layout's order) against every key, in natural order.
    mask: optional boolean mask broadcastable to [B, N, T/P, S], as the bias.
    axis_name: the mesh axis (or tuple of axes) the sequence is split over; P
      is its size.
    layout: ``"contiguous"``: device d holds positions [d * T/P, (d+1) * T/P)
      of the queries (and likewise of the keys); ``"zigzag"``: the sequence in
      2P chunks, device d holding chunks d and 2P-1-d (see
      :func:`zigzag_permute`), which balances causal work; the local lengths
      must then be even.
    strategy: ``"ring"``: K/V blocks go around the ring, one kernel call per
      block (memory O(S/P)); ``"all_gather"``: K/V gathered once and the local
      queries attend them in one call (memory O(S); fewer, larger transfers,
      for short sequences).
    scale: the logit scale, as :func:`jaxops.attention`'s.
    is_causal: query t attends keys j <= t + query_offset, global positions.
    local_window_size: as :func:`jaxops.attention`'s, on global positions.
    query_seq_lengths: optional int32 [B]: global rows t >= length output 0.
    key_value_seq_lengths: optional int32 [B]: global keys j >= length are masked.
    return_residual: also return the log-sum-exp [B, T/P, N] (sinks included).
    query_offset: the global position of the sequence's query row 0 (a Python
      int, or an int32 scalar, which may be traced: then no step is skipped at
      trace time).
    query_segment_ids: optional integer [B, T/P], this device's queries' ids,
      with ``key_value_segment_ids`` [B, S/P], its keys' (which travel with
      the keys): both or neither.
    key_value_segment_ids: see ``query_segment_ids``.
    logits_soft_cap: as :func:`jaxops.attention`'s.
    sinks: optional float [N] sink logits, merged once after the ring.
    precision: as :func:`jaxops.attention`'s.
    implementation: None (the kernels where they exist, else the ring on the
      jnp reference of a block), "ffi" or "xla", as :func:`jaxops.attention`'s.

  Returns:
    The output [B, T/P, N, Hv] for this device's queries, and with
    ``return_residual`` the log-sum-exp [B, T/P, N], both in the query's dtype.

  Raises:
    TypeError: as :func:`jaxops.attention`, and a complex input, or an
      ``axis_name`` that is not a string or tuple of strings.
    ValueError: as :func:`jaxops.attention`; an ``axis_name`` that is not an
      axis of the enclosing ``shard_map`` (or no ``shard_map``); a ``layout``
      or ``strategy`` not in the lists above; an odd local length under
      ``layout="zigzag"``; a query that does not vary over ``axis_name``.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = k = v = jnp.ones((1, 8, 2, 16))
    >>> ring = jax.shard_map(
    ...     lambda q, k, v: jaxops.ring_attention(q, k, v, axis_name="seq", is_causal=True),
    ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> jax.jit(ring)(q, k, v).shape
    (1, 8, 2, 16)
  """
  layout = validation.choice(_OP, "layout", layout, LAYOUTS)
  strategy = validation.choice(_OP, "strategy", strategy, STRATEGIES)
  axis_size = _axis_size(axis_name)
  query = validation.float_array(_OP, "query", query)
  key = validation.float_array(_OP, "key", key)
  value = validation.float_array(_OP, "value", value)
  validation.rank(_OP, "query", query, low=3, high=4, labels="[B, T/P, N, H] or [T/P, N, H]")
  unbatched = query.ndim == 3
  for name, x in (("key", key), ("value", value)):
    validation.rank(_OP, name, x, low=query.ndim, high=query.ndim, labels="the rank of query")
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  Hv = value.shape[3]
  if key.shape[0] != B or key.shape[3] != H:
    raise validation.value_error(
        _OP, "key", f"share query's batch ({B}) and head dim ({H}) in [B, S/P, K, H]",
        f"shape {key.shape} for query {query.shape}")
  if value.shape[:3] != key.shape[:3]:
    raise validation.value_error(
        _OP, "value", f"share key's batch, sequence and heads {key.shape[:3]} in "
        "[B, S/P, K, Hv]", f"shape {value.shape}")
  if key.dtype != query.dtype:
    raise validation.type_error(_OP, "key", f"have the dtype of query ({query.dtype})",
                                str(key.dtype))
  if value.dtype != key.dtype:
    raise validation.type_error(_OP, "value", f"have the dtype of key ({key.dtype})",
                                str(value.dtype))
  if K == 0 or N % K != 0:
    raise validation.value_error(
        _OP, "key", f"have a number of heads K that divides query's N = {N}", f"K = {K}")
  if layout == "zigzag":
    for name, length in (("query", T), ("key", S)):
      if length % 2:
        raise validation.value_error(
            _OP, name, "have an even local sequence length under layout='zigzag' (each device "
            "holds two chunks of the sequence; its length must divide by 2P)",
            f"local length {length}")
  names = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}
  if _varying_axes(query, key, value):  # shard_map types them (check_vma=True)
    for name, x in (("query", query), ("key", key), ("value", value)):
      if not names <= vma(jax.typeof(x)):
        raise validation.value_error(
            _OP, name, f"be this device's block of a sequence split over {axis_name!r} (vary "
            "over it: shard_map in_specs naming it on the sequence axis)",
            f"one varying over {sorted(vma(jax.typeof(x)))}")
  full = (B, N, T, S * axis_size)
  if bias is not None:
    bias = validation.float_array(_OP, "bias", bias)
    bias = _attention._broadcast_operand(_OP, "bias", bias, full, unbatched)
  if mask is not None:
    mask = _attention._broadcast_operand(_OP, "mask", validation.bool_array(_OP, "mask", mask),
                                         full, unbatched)
  q_lengths = _attention._check_lengths(_OP, "query_seq_lengths", query_seq_lengths, B,
                                        unbatched)
  kv_lengths = _attention._check_lengths(_OP, "key_value_seq_lengths", key_value_seq_lengths, B,
                                         unbatched)
  q_segments, kv_segments = _attention._check_segment_ids(
      _OP, query_segment_ids, key_value_segment_ids, B, T, S, unbatched)
  window = _attention._check_window(_OP, local_window_size)
  if scale is None:
    scale = 1.0 / H ** 0.5 if H > 0 else 1.0
  else:
    scale = validation.static_float(_OP, "scale", scale)
  soft_cap = (None if logits_soft_cap is None else validation.static_float(
      _OP, "logits_soft_cap", logits_soft_cap, low=0.0, low_open=True))
  sinks = check_sinks(_OP, sinks, N, query.dtype)
  is_causal = validation.static_bool(_OP, "is_causal", is_causal)
  return_residual = validation.static_bool(_OP, "return_residual", return_residual)
  known_offset = (int(query_offset) if isinstance(query_offset, (int, np.integer))
                  and not isinstance(query_offset, bool) else None)
  query_offset = validation.int_scalar(_OP, "query_offset", query_offset)
  allow_tf32 = matmul_precision.allow_tf32(_OP, precision)

  if strategy == "all_gather":
    out, lse = _all_gather_attention(
        query, key, value, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments,
        query_offset, axis_name=axis_name, axis_size=axis_size, layout=layout, sinks=sinks,
        implementation=implementation, precision=precision,
        attention_kwargs=dict(scale=scale, is_causal=is_causal, local_window_size=window,
                              logits_soft_cap=soft_cap))
  else:
    window_left, window_right = window if window else (-1, -1)
    params = dict(axis_name=axis_name, axis_size=axis_size, layout=layout,
                  known_offset=known_offset, scale=scale, is_causal=is_causal,
                  window_left=window_left, window_right=window_right,
                  logits_soft_cap=soft_cap or 0.0, allow_tf32=allow_tf32)
    use_kernel = _attention._use_kernel(_OP, implementation, query.dtype, H, Hv)
    operands = (
        query, key, value,
        absent(_F32) if bias is None else (bias.astype(_F32) if use_kernel else bias),
        absent(jnp.bool_) if mask is None else mask,
        absent(_I32) if q_lengths is None else q_lengths,
        absent(_I32) if kv_lengths is None else kv_lengths,
        absent(_I32) if q_segments is None else q_segments,
        absent(_I32) if kv_segments is None else kv_segments,
        query_offset)
    if use_kernel:
      out, lse = ring_attention_fwd_p(*operands, **params)
    else:
      out, lse = _reference_forward(*operands, **params)
    if sinks is not None:
      out, lse = merge_sinks(out, lse, sinks)
    lse = jnp.swapaxes(lse, -1, -2).astype(query.dtype)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
