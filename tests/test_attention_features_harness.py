"""The CUDA attention kernels with the arguments of current models, in the
harness (tests/cuda_harness: the unchanged CUDA source on the CPU, mma.sync,
ldmatrix and cp.async emulated with their PTX layouts) against the jnp
reference: the logit soft cap, segment ids (packed documents) and a value
head dim of its own (MLA), alone and together with the other arguments.

float32 runs the SIMT kernels (the suite's "highest" precision) and, in the
TF32 test, the float32 tensor-core kernels; bfloat16 and float16 the
tensor-core kernels. The shapes pick every configuration of the tensor-core
dispatch (padded head dims (64, 64), (128, 128), (256, 256) and MLA's (256,
128)) and the SIMT tile sizes (64x64, 32x32, 16x16), and stay small: the
harness runs every CUDA thread on the CPU. Each case checks the forward
(output and log-sum-exp), the backward (dq, dk, dv and dbias, through
jax.vjp) and the forward mode (the fused JVP kernel, through jax.jvp).
Sinks merge after the kernel in Python (tests/test_attention_features.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops import reference
from jaxops.testing import assert_close, assert_tree_close, random_inputs, random_normal, upcast
from support import backends

pytestmark = pytest.mark.backends(backends.HARNESS)


def documents(lengths, batch=1):
  """Segment ids [batch, sum(lengths)] of packed documents of these lengths."""
  ids = np.concatenate([np.full(n, d, np.int32) for d, n in enumerate(lengths)])
  return np.stack([ids] * batch)


def _vjp(fn, args, cotangent):
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent)


def _finite(tree):
  """-inf log-sum-exps (rows with no key) as 0, so that they compare."""
  return jax.tree.map(lambda x: jnp.where(jnp.isneginf(x), 0.0, x), tree)


def check(shape, dtype, Hv=None, bias=False, seed=0, **kwargs):
  """Forward, vjp and jvp of jaxops.attention against the reference at
  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] (and a [1, N, T, S] bias)."""
  B, T, S, N, K, H = shape
  Hv = H if Hv is None else Hv
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, Hv)] + ([(1, N, T, S)] if bias else [])
  args = list(random_inputs(seed, shapes, dtype))

  def call(fn):
    return lambda *a: fn(*a, return_residual=True, **kwargs)

  f, r = call(jaxops.attention), call(reference.attention)
  reduce_size = 2 * max(S, H, Hv)
  # Forward and backward: a random cotangent of out (the log-sum-exp's too).
  shapes_out = jax.eval_shape(f, *args)
  keys = iter(jax.random.split(jax.random.key(seed + 1), 2))
  cotangent = jax.tree.map(lambda o: random_normal(next(keys), o.shape, o.dtype), shapes_out)
  got = jax.jit(functools.partial(_vjp, f))(args, cotangent)
  want = jax.jit(functools.partial(_vjp, r))(upcast(args), upcast(cotangent))
  (out, lse), grads = got
  assert out.shape == (B, T, N, Hv) and out.dtype == dtype
  assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(want[0][1])))
  assert_tree_close(_finite(got), _finite(want), dtype=dtype, reduce_size=reduce_size)
  # Forward mode: the fused JVP kernel (out and its tangent).
  tangents = list(random_inputs(seed + 2, shapes, dtype))
  out_only = lambda fn: lambda *a: fn(*a)[0]
  got_jvp = jax.jit(lambda p, t: jax.jvp(out_only(f), p, t))(args, tangents)
  want_jvp = jax.jit(lambda p, t: jax.jvp(out_only(r), p, t))(upcast(args), upcast(tangents))
  assert_tree_close(got_jvp, want_jvp, dtype=dtype, reduce_size=reduce_size)
  return got, got_jvp


# -- logits_soft_cap ------------------------------------------------------------------

# (B, T, S, N, K, H), dtype: SIMT float32 (64x64 tiles; 32x32 at H = 128),
# tensor cores at padded head dims 64, 128 and 256.
SOFT_CAP_SHAPES = [
    ((2, 13, 21, 4, 2, 16), jnp.float32),
    ((1, 19, 40, 2, 1, 128), jnp.float32),
    ((2, 13, 21, 4, 2, 32), jnp.bfloat16),
    ((1, 33, 70, 2, 2, 128), jnp.float16),
    ((1, 17, 9, 1, 1, 256), jnp.bfloat16),
]


@pytest.mark.parametrize("shape,dtype", SOFT_CAP_SHAPES, ids=backends.param_id)
def test_soft_cap(backend, shape, dtype):
  """Small caps (0.5 against logits of unit scale) bend most logits."""
  check(shape, dtype, logits_soft_cap=0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=backends.param_id)
def test_soft_cap_with_causal_offset_and_bias(backend, dtype):
  """The cap before the bias: dbias takes dS by the capped logit, dq and dk
  by the uncapped one (the cap's slope), the bias tangent likewise."""
  check((2, 13, 21, 4, 2, 32), dtype, bias=True, logits_soft_cap=1.5, is_causal=True,
        query_offset=5)


# -- segment ids ----------------------------------------------------------------------

# Documents of 1 token, and edges on either side of every CUDA tile (16-row
# warps, 32 and 64 keys, 64-row blocks): 1 + 15 + 2 + 30 + 17 + 1 + 40 + 24.
PACKED = [1, 15, 2, 30, 17, 1, 40, 24]


@pytest.mark.parametrize("H,dtype", [(16, jnp.float32), (64, jnp.bfloat16),
                                     (128, jnp.float16)], ids=backends.param_id)
def test_packed_documents_at_tile_edges(backend, H, dtype):
  ids = documents(PACKED)
  n = ids.shape[1]
  check((1, n, n, 2, 1, H), dtype, is_causal=True, query_segment_ids=ids,
        key_value_segment_ids=ids)


def test_packed_attention_equals_each_documents_own(backend):
  """Causal packed attention is each document's causal attention (bfloat16)."""
  ids = documents(PACKED)
  n = ids.shape[1]
  q, k, v = random_inputs(4, [(1, n, 2, 64), (1, n, 1, 64), (1, n, 1, 64)], jnp.bfloat16)
  packed = jax.jit(lambda q, k, v: jaxops.attention(
      q, k, v, is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids))(q, k, v)
  starts = np.cumsum([0] + PACKED)
  separate = jnp.concatenate([
      reference.attention(*(x[:, a:b] for x in upcast([q, k, v])), is_causal=True)
      for a, b in zip(starts[:-1], starts[1:])], axis=1)
  assert_close(packed, separate, dtype=jnp.bfloat16, reduce_size=max(PACKED))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=backends.param_id)
def test_rows_with_no_key_of_their_document(backend, dtype):
  """Rows whose document has no key (ids 5 and 7), with GQA and sequence
  lengths: output 0, log-sum-exp -inf, zero gradients for them."""
  q_ids = np.array([[0] * 4 + [5] * 3 + [1] * 4 + [7] * 2, [2] * 13], np.int32)
  kv_ids = np.array([[0] * 7 + [1] * 9 + [3] * 5, [2] * 10 + [4] * 11], np.int32)
  (out, lse), grads = check((2, 13, 21, 4, 2, 32), dtype, query_segment_ids=q_ids,
                            key_value_segment_ids=kv_ids,
                            key_value_seq_lengths=np.array([21, 15], np.int32))[0]
  empty = np.zeros((2, 13), bool)
  empty[0, 4:7] = empty[0, 11:] = True
  assert np.all(np.asarray(out)[empty] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[empty]))
  assert np.all(np.asarray(grads[0])[empty] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=backends.param_id)
def test_segments_with_window_offset_lengths_and_mask(backend, dtype):
  """Unsorted ids (a document split in two runs), windows on global positions,
  sequence lengths and a boolean mask, all ANDed."""
  q_ids = np.array([[0] * 5 + [1] * 6 + [0] * 2, [3] * 13], np.int32)
  kv_ids = np.array([[0] * 7 + [1] * 9 + [0] * 5, [3] * 10 + [4] * 11], np.int32)
  mask = jax.random.bernoulli(jax.random.key(9), 0.8, (2, 4, 13, 21))
  check((2, 13, 21, 4, 2, 16), dtype, is_causal=True, local_window_size=(6, 0), query_offset=3,
        query_segment_ids=q_ids, key_value_segment_ids=kv_ids, mask=mask,
        query_seq_lengths=np.array([13, 11], np.int32))


# -- a value head dim of its own ------------------------------------------------------

# (B, T, S, N, K, H, Hv), dtype: MLA's 192 / 128 (the tensor cores' (256, 128)
# configuration; SIMT 32x32 forward, 16x16 backward); small odd pairs in one
# padded dim (64), across two (128 and 64: the (128, 128) configuration) and
# into the (256, 256) one.
VALUE_HEAD_DIMS = [
    ((1, 37, 37, 2, 1, 192, 128), jnp.bfloat16),
    ((1, 37, 37, 2, 1, 192, 128), jnp.float16),
    ((1, 21, 19, 2, 1, 192, 128), jnp.float32),
    ((2, 13, 21, 4, 2, 7, 13), jnp.float32),
    ((2, 13, 21, 4, 2, 24, 40), jnp.bfloat16),
    ((1, 19, 23, 2, 1, 100, 24), jnp.float16),
    ((1, 11, 9, 1, 1, 40, 200), jnp.bfloat16),
]


@pytest.mark.parametrize("shape,dtype", VALUE_HEAD_DIMS, ids=backends.param_id)
def test_value_head_dim(backend, shape, dtype):
  *shape, Hv = shape
  check(tuple(shape), dtype, Hv=Hv, is_causal=True)


# -- everything at once ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=backends.param_id)
def test_all_features_with_every_mask(backend, dtype):
  q_ids = np.array([[0] * 5 + [1] * 6 + [2] * 2, [3] * 13], np.int32)
  kv_ids = np.array([[0] * 7 + [1] * 9 + [2] * 5, [3] * 10 + [4] * 11], np.int32)
  check((2, 13, 21, 4, 2, 24), dtype, Hv=8, bias=True, logits_soft_cap=3.0, is_causal=True,
        query_segment_ids=q_ids, key_value_segment_ids=kv_ids,
        key_value_seq_lengths=np.array([20, 21], np.int32),
        query_seq_lengths=np.array([13, 11], np.int32))


def test_mla_with_soft_cap_and_packing(backend):
  """H = 192, Hv = 128 with a cap and packed documents on the tensor cores."""
  ids = documents([20, 1, 30, 13])
  check((1, 64, 64, 2, 1, 192), jnp.bfloat16, Hv=128, logits_soft_cap=2.0, is_causal=True,
        query_segment_ids=ids, key_value_segment_ids=ids)


def test_float32_tensor_cores(backend):
  """float32 at the default precision: the TF32 tensor-core kernels, every
  feature, against the reference within TF32's error (8 unit roundoffs of
  the largest element, tests/test_matmul_precision_kernels.py)."""
  ids = documents([7, 20, 13])
  kwargs = dict(logits_soft_cap=2.0, is_causal=True, query_segment_ids=ids,
                key_value_segment_ids=ids, return_residual=True)
  for H, Hv in ((48, 24), (192, 128)):
    q, k, v = random_inputs(5, [(1, 40, 2, H), (1, 40, 1, H), (1, 40, 1, Hv)])
    f = lambda q, k, v: jaxops.attention(q, k, v, implementation="ffi", **kwargs)[0]
    r = lambda q, k, v: reference.attention(q, k, v, **kwargs)[0]
    with jax.default_matmul_precision("default"):
      got = jax.jit(lambda *a: _vjp(f, a, jnp.ones((1, 40, 2, Hv))))(q, k, v)
      got_jvp = jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), (k[:, :, [0, 0]], k, v))
    want = jax.jit(lambda *a: _vjp(r, a, jnp.ones((1, 40, 2, Hv))))(q, k, v)
    want_jvp = jax.jit(lambda p, t: jax.jvp(r, p, t))((q, k, v), (k[:, :, [0, 0]], k, v))
    for a, b in zip(jax.tree.leaves((got, got_jvp)), jax.tree.leaves((want, want_jvp))):
      scale = float(np.abs(np.asarray(b)).max())
      assert_close(a, b, atol=8 * 2.0 ** -11 * scale, rtol=0.0)


# -- decoding shapes ------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    dict(logits_soft_cap=2.5, is_causal=True),  # the split-K decode kernels
    dict(query_segment_ids=np.array([[1], [0]]), key_value_segment_ids=np.array(
        [[1] * 30 + [2] * 35 + [1] * 2, [0] * 67])),  # the tiled forward (the handler's choice)
    dict(Hv=40, is_causal=True),  # the MLA decode kernel (a value head dim of its own)
], ids=["soft_cap", "segments", "value_head_dim"])
def test_decoding_shapes(backend, case):
  """One query row of 4 heads per kv head: the CUDA forward's decode path
  where it applies."""
  case = dict(case)
  Hv = case.pop("Hv", None)
  check((2, 1, 67, 8, 2, 64), jnp.float32, Hv=Hv, query_offset=66, **case)
