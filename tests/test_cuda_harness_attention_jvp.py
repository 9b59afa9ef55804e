"""The CUDA forward-mode attention kernel (cuda/attention_jvp.cu) run on the CPU by the harness.

tests/cuda_harness compiles the unchanged kernel and its CUDA FFI handler with
g++; each test calls the handler's harness target (jaxops_harness_attention_fwd_jvp,
the CUDA handler of jaxops_attention_fwd_jvp) with ``jax.ffi.ffi_call``, under
jit with the query offset traced, and compares out, logsumexp and their
tangents with ``jax.jvp`` of the jnp reference (attention_with_logsumexp) run
in float32: every mask kind, full and broadcast biases with their tangents,
each tangent absent or present, GQA/MQA, T = 1, T != S, rows with no key.
float32 takes the SIMT path; bfloat16 and float16 the tensor-core path
(nvcuda::wmma, emulated: the harness reports an sm_80). The head dims cover
every tile configuration the dispatch selects: 64x64, 32x32 and, float32
only, 16x16. Every test asserts that kernels ran in the harness.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_harness
from cuda_harness.fixtures import harness, kernels_ran  # noqa: F401  (autouse fixtures)
import test_attention as attention_tests
import test_cuda_harness_attention as harness_attention_tests
from jaxops import reference
from jaxops.testing import assert_tree_close, random_inputs, upcast

TARGET = "jaxops_attention_fwd_jvp"
TANGENTS = ("query", "key", "value", "bias")
DTYPE_IDS = lambda d: jnp.dtype(d).name


def _absent(dtype):
  return jnp.zeros((0,), dtype)


def _four_d(x):
  return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "window"))
def kernel_jvp(primals, tangents, mask, q_lengths, kv_lengths, query_offset, *, scale, is_causal,
               window):
  """(out, logsumexp), (dout, dlogsumexp) from the harness target; a None tangent is absent."""
  q, k, v, bias = primals
  batch, q_len, heads, _ = q.shape
  absent = lambda x, dtype: _absent(dtype) if x is None else x
  stats = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
  rows = jax.ShapeDtypeStruct(q.shape, q.dtype)
  call = jax.ffi.ffi_call(cuda_harness.harness_target(TARGET), (rows, stats, rows, stats))
  window_left, window_right = window or (-1, -1)
  out, lse, dout, dlse = call(
      q, k, v, absent(bias, jnp.float32), absent(mask, jnp.bool_), absent(q_lengths, jnp.int32),
      absent(kv_lengths, jnp.int32), query_offset,
      *(absent(t, x.dtype if x is not None else jnp.float32) for t, x in zip(tangents, primals)),
      scale=np.float32(scale), is_causal=np.bool_(is_causal), window_left=np.int64(window_left),
      window_right=np.int64(window_right))
  return (out, lse), (dout, dlse)


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "window"))
def reference_jvp(primals, tangents, mask, q_lengths, kv_lengths, query_offset, *, scale,
                  is_causal, window):
  """jax.jvp of the reference in float32; absent tangents are zeros."""
  primals, tangents = upcast((primals, tangents))
  tangents = tuple(jnp.zeros_like(x) if t is None and x is not None else t
                   for t, x in zip(tangents, primals))

  def forward(q, k, v, bias):
    return reference.attention_with_logsumexp(
        q, k, v, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths, local_window_size=window, query_offset=query_offset)

  present = [i for i, x in enumerate(primals) if x is not None]
  fn = lambda *xs: forward(*[xs[present.index(i)] if i in present else None for i in range(4)])
  return jax.jvp(fn, [primals[i] for i in present], [tangents[i] for i in present])


def run_case(shape, dtype=jnp.float32, *, tangents=TANGENTS, bias=None, mask=None,
             is_causal=False, local_window_size=None, query_seq_lengths=None,
             key_value_seq_lengths=None, query_offset=0, seed=0):
  """The kernel's results against the reference's on random primals and tangents."""
  batch, q_len, kv_len, heads, kv_heads, head_dim = shape
  shapes = [(batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
            (batch, kv_len, kv_heads, head_dim)]
  bias = _four_d(bias)
  primals = (*random_inputs(seed, shapes, dtype), bias)
  directions = (*random_inputs(seed + 1, shapes, dtype),
                None if bias is None else random_inputs(seed + 2, [bias.shape])[0])
  chosen = tuple(d if name in tangents else None for name, d in zip(TANGENTS, directions))
  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)
  kwargs = dict(scale=1.0 / np.sqrt(head_dim), is_causal=is_causal, window=local_window_size)
  arrays = (_four_d(mask), query_seq_lengths, key_value_seq_lengths, jnp.int32(query_offset))
  got = kernel_jvp(primals, chosen, *arrays, **kwargs)
  want = reference_jvp(primals, chosen, *arrays, **kwargs)
  assert_tree_close(got, want, dtype=dtype, reduce_size=max(2 * kv_len, head_dim))
  assert got[0][0].dtype == dtype and got[1][0].dtype == dtype
  return got


def mask_cases(batch, q_len, kv_len, heads):
  """attention_tests.MASK_CASES's kinds at another shape (lengths and windows
  scaled to it), so that rows span several query and key tiles."""
  random_mask = attention_tests.random_mask
  random_bias = lambda seed, shape: random_inputs(seed, [shape])[0]
  diagonal = jnp.arange(q_len)
  return {
      "causal": dict(is_causal=True),
      "window": dict(local_window_size=(37, 21)),
      "window_int_causal": dict(local_window_size=70, is_causal=True),
      "seq_lengths": dict(query_seq_lengths=np.array([q_len, q_len // 2], np.int32),
                          key_value_seq_lengths=np.array([kv_len // 3, kv_len], np.int32)),
      "mask_full": dict(mask=random_mask(1, (batch, heads, q_len, kv_len))),
      "mask_keys": dict(mask=random_mask(2, (batch, 1, 1, kv_len)).at[..., 0].set(True)),
      "mask_rank2": dict(mask=random_mask(3, (q_len, kv_len)).at[:, 0].set(True)),
      "bias_heads": dict(bias=random_bias(4, (1, heads, q_len, kv_len))),
      "bias_keys": dict(bias=random_bias(5, (batch, 1, 1, kv_len))),
      "bias_rank2": dict(bias=random_bias(6, (q_len, kv_len))),
      "all": dict(is_causal=True, local_window_size=(50, 3), query_offset=kv_len - q_len,
                  bias=random_bias(7, (1, heads, q_len, kv_len)),
                  mask=random_mask(8, (batch, heads, q_len, kv_len)).at[
                      :, :, diagonal, diagonal + kv_len - q_len].set(True),
                  query_seq_lengths=np.array([q_len - 5, q_len], np.int32),
                  key_value_seq_lengths=np.array([kv_len, kv_len - 40], np.int32)),
  }


# Two query tiles and three key tiles of the 64x64 configuration, GQA; the
# online softmax rescales the accumulators between key tiles.
TILED = (2, 70, 150, 4, 2)
TILED_CASES = mask_cases(2, 70, 150, 4)


@pytest.mark.parametrize("case", list(TILED_CASES))
def test_float32_masks_and_biases(case):
  """The SIMT path: every mask kind, full and broadcast biases with their tangents, GQA."""
  run_case((*TILED, 16), **TILED_CASES[case])


@pytest.mark.parametrize("tangents", [(), ("query",), ("key",), ("value",), ("bias",),
                                      ("query", "key"), ("key", "value"),
                                      ("query", "value", "bias")], ids=str)
def test_each_tangent_absent_or_present(tangents):
  """Absent tangents are zero and their products are skipped (no tangents: zero tangents)."""
  got = run_case((*TILED, 16), tangents=tangents, is_causal=True, query_offset=80,
                 **TILED_CASES["bias_heads"])
  if not tangents:
    assert not np.any(np.asarray(got[1][0])) and not np.any(np.asarray(got[1][1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=DTYPE_IDS)
def test_tensor_cores_all_masks(dtype):
  run_case((*TILED, 32), dtype, **TILED_CASES["all"])


# (B, T, S, N, K, H, is_causal, dtype): the forward and backward tests' shapes,
# which also select every tile configuration of this kernel's dispatch
# (float32: 64x64 up to H = 48, 32x32 up to 176, 16x16 above; bfloat16/float16:
# 64x64 up to 96, 32x32 above), with decode (T = 1) and GQA, MQA, T > S, T < S
# and head dims padded to 16 (7, 80); and more head dims in each configuration.
SHAPES = harness_attention_tests.SHAPES + [
    (1, 9, 40, 2, 1, 32, False, jnp.float32),
    (1, 19, 24, 2, 2, 128, True, jnp.float32),
    (1, 23, 16, 4, 1, 16, True, jnp.bfloat16),
    (1, 1, 37, 4, 2, 64, True, jnp.float16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tile_configurations(shape):
  *shape, is_causal, dtype = shape
  offset = shape[2] - shape[1] if is_causal else 0
  run_case(tuple(shape), dtype, is_causal=is_causal, query_offset=offset, seed=3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=DTYPE_IDS)
def test_tangent_accuracy_with_a_large_key_mean(dtype):
  """Keys with a large common part (as real models' keys often have) give the
  logit tangents a large mean along each row, which the kernel's shift removes
  before rounding e (ds - c) to the dtype: dout stays within twice the error
  of the reference run in that dtype (unshifted: about 7 times)."""
  shapes = [(1, 64, 2, 64), (1, 256, 2, 64), (1, 256, 2, 64)]
  q, k, v = random_inputs(0, shapes, dtype)
  k = (k.astype(jnp.float32) + 10.0).astype(dtype)
  tangents = (*random_inputs(1, shapes, dtype), None)
  arrays = (None, None, None, jnp.int32(0))
  options = dict(scale=0.125, is_causal=False, window=None)
  got = kernel_jvp((q, k, v, None), tangents, *arrays, **options)
  want = reference_jvp((q, k, v, None), tangents, *arrays, **options)
  low_precision = jax.jit(lambda primals, tangents: jax.jvp(
      lambda q, k, v: reference.attention_with_logsumexp(q, k, v, scale=0.125), primals,
      tangents))((q, k, v), tangents[:3])
  error = lambda x: np.max(np.abs(np.asarray(x, np.float32) - np.asarray(want[1][0])))
  kernel_error, reference_error = error(got[1][0]), error(low_precision[1][0])
  assert kernel_error <= 2 * reference_error, (kernel_error, reference_error)


def test_rows_without_keys():
  """Causal rows before the first key, a row emptied by the mask, a batch with
  no keys, and a bias tangent that is infinite or NaN where keys are masked:
  out 0, logsumexp -inf and zero tangents there, the reference elsewhere."""
  batch, q_len, kv_len, heads = 2, 6, 8, 2
  mask = jnp.ones((batch, heads, q_len, kv_len), bool).at[0, 1, 2].set(False)
  kwargs = dict(is_causal=True, query_offset=-2, mask=mask,
                key_value_seq_lengths=np.array([kv_len, 0], np.int32),
                bias=random_inputs(11, [(batch, heads, q_len, kv_len)])[0])
  got = run_case((batch, q_len, kv_len, heads, heads, 8), **kwargs)
  masked = np.zeros((batch, heads, q_len), bool)
  masked[0, :, :2] = True  # causal with offset -2: rows 0, 1 see no key
  masked[0, 1, 2] = True   # the mask empties a row
  masked[1] = True         # no keys at all
  (out, lse), (dout, dlse) = [[np.asarray(x) for x in pair] for pair in got]
  rows = np.transpose(masked, (0, 2, 1))
  assert np.all(out[rows] == 0) and np.all(dout[rows] == 0)
  assert np.all(np.isneginf(lse[masked])) and np.all(dlse[masked] == 0)
  assert np.all(np.isfinite(lse[~masked])) and np.all(np.isfinite(dlse))

  # Non-finite bias tangents on masked keys change nothing.
  q, k, v = random_inputs(0, [(batch, q_len, heads, 8), (batch, kv_len, heads, 8),
                              (batch, kv_len, heads, 8)])
  dq, dk, dv = random_inputs(1, [q.shape, k.shape, v.shape])
  dbias = random_inputs(2, [mask.shape])[0]
  arrays = (mask, None, kwargs["key_value_seq_lengths"], jnp.int32(-2))
  options = dict(scale=1.0 / np.sqrt(8), is_causal=True, window=None)
  allowed = reference.attention_allowed(batch, heads, q_len, kv_len, mask=mask, is_causal=True,
                                        key_value_seq_lengths=arrays[2], query_offset=-2)
  poisoned = jnp.where(allowed, dbias, jnp.inf).at[0, 0, 0, 5].set(jnp.nan)
  clean = kernel_jvp((q, k, v, kwargs["bias"]), (dq, dk, dv, dbias), *arrays, **options)
  dirty = kernel_jvp((q, k, v, kwargs["bias"]), (dq, dk, dv, poisoned), *arrays, **options)
  for a, b in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _thread_order_inputs():
  q, k, v = attention_tests.qkv(21, 1, 37, 29, 4, 2, 16)
  dq, dk, dv = attention_tests.qkv(22, 1, 37, 29, 4, 2, 16)
  bias, dbias = random_inputs(23, [(1, 4, 37, 29), (1, 4, 37, 29)])
  arrays = (None, None, None, jnp.int32(-3))
  return (q, k, v, bias), (dq, dk, dv, dbias), arrays


@pytest.mark.parametrize("mode,seed", [("fibers", 3), ("threads", 0)])
def test_thread_order_does_not_change_results(harness, mode, seed):
  """Random thread and block orders, and OS threads: every result is bitwise the same."""
  primals, tangents, arrays = _thread_order_inputs()
  options = dict(scale=0.25, is_causal=True, window=(9, 2))
  expected = kernel_jvp(primals, tangents, *arrays, **options)
  harness.configure(mode, seed=seed)
  try:
    got = kernel_jvp(primals, tangents, *arrays, **options)
  finally:
    harness.configure()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_invalid_calls_are_errors_not_crashes():
  """The handler validates through check_fwd_jvp and returns an error; the
  harness still runs the next valid call."""
  primals, tangents, arrays = _thread_order_inputs()
  options = dict(scale=0.25, is_causal=False, window=None)
  q, k, v, bias = primals
  dq, dk, dv, dbias = tangents
  with pytest.raises(Exception, match="dquery"):
    kernel_jvp(primals, (dq[:, :5], dk, dv, dbias), *arrays, **options)
  with pytest.raises(Exception, match="bias tangent requires a bias"):
    kernel_jvp((q, k, v, None), (dq, dk, dv, dbias), *arrays, **options)
  wide = random_inputs(0, [(1, 2, 1, 264), (1, 3, 1, 264), (1, 3, 1, 264)])
  with pytest.raises(Exception, match="head_dim <= 256"):
    kernel_jvp((*wide, None), (None,) * 4, *arrays, **options)
  got = kernel_jvp(primals, tangents, *arrays, **options)
  want = reference_jvp(primals, tangents, *arrays, **options)
  assert_tree_close(got, want, reduce_size=2 * 29)
