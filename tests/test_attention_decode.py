"""jaxops.attention's decode paths: few query rows per kv head, no bias or mask.

On the CPU, the decode core (cpu/kv_decode.h) at the shapes that pick its
branches (T * G < the vector lanes): one group (batch 1, one kv head) with a
long cache, whose keys are split across threads and the partial results
merged; a traced query_offset; the bfloat16 dot-product path (head dim a
multiple of 32) and the converted-rows path (odd head dim).
tests/cpp/kv_decode_test.cc tests the core's other row sources (paged, int8,
soft cap).

On CUDA (in the harness), the split-K decode kernels (cuda/attention_decode.cu
on cuda/kv_decode.cuh, chosen by the forward's handler where T * G rows fit
one tile): 16-byte and element loads, key splits merged by the second kernel,
a full tile of 16 rows, head dims above 128 (8 rows, 8 elements per lane),
causal and two-sided windows, sequence lengths and a traced offset, and the
backward reading the decode's log-sum-exp.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops import reference
from jaxops.testing import FLOAT_DTYPES, assert_close, random_inputs, vjp_against_reference
from support import backends
from support.lowering import contract_workspace, custom_calls


def qkv(seed, B, T, S, N, K, H, dtype):
  return random_inputs(seed, [(B, T, N, H), (B, S, K, H), (B, S, K, H)], dtype)


# (B, T, S, N, K, H): one group with a long cache (split keys), GQA with a
# prime cache length and odd head dim, T = 3 x G = 2 rows with a 64 head dim.
SHAPES = [(1, 1, 1031, 4, 1, 128), (3, 1, 97, 6, 2, 17), (2, 3, 300, 4, 2, 64)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_against_reference(shape, dtype):
  B, T, S, N, K, H = shape
  q, k, v = qkv(1, *shape, dtype)
  kwargs = dict(is_causal=True, local_window_size=(S // 2, 0),
                key_value_seq_lengths=jnp.asarray(np.linspace(S, 1, B), jnp.int32))
  offset = jnp.int32(S - T - 2)  # causal: no row sees the last two keys
  f = jax.jit(lambda q, k, v, o: jaxops.attention(q, k, v, query_offset=o, **kwargs))
  r = lambda q, k, v, o: reference.attention(q, k, v, query_offset=o, **kwargs)
  out = f(q, k, v, offset)
  assert out.dtype == dtype
  assert_close(out, r(*(x.astype(jnp.float32) for x in (q, k, v)), offset).astype(dtype),
               dtype=dtype, reduce_size=S)
  # Split keys merge in a fixed order: the same inputs give the same bits.
  np.testing.assert_array_equal(np.asarray(f(q, k, v, offset)), np.asarray(out))
  # The backward reads the forward's logsumexp.
  vjp_against_reference(functools.partial(f, o=offset), functools.partial(r, o=offset),
                        (q, k, v), dtype=dtype, reduce_size=S)


def test_rows_past_query_lengths_and_empty_caches_are_zero():
  q, k, v = qkv(2, 2, 2, 40, 4, 2, 32, jnp.float32)
  kwargs = dict(query_seq_lengths=jnp.array([1, 0], jnp.int32),
                key_value_seq_lengths=jnp.array([0, 40], jnp.int32))
  out = jaxops.attention(q, k, v, **kwargs)
  assert_close(out, reference.attention(q, k, v, **kwargs), reduce_size=40)
  assert not np.any(np.asarray(out))


# (B, T, S, N, K, H), dtype, the masks, whether the plan splits the keys (the
# decode kernel and the merge launch), and whether to check the backward.
CAUSAL = dict(is_causal=True, window=lambda S: (S // 2, 0))
TWO_SIDED = dict(is_causal=False, window=lambda S: (5, 3))
CUDA_CASES = [
    ((1, 1, 600, 4, 1, 16), jnp.float32, CAUSAL, True, False),   # 64-byte rows, 3 splits
    ((3, 1, 97, 6, 2, 17), jnp.bfloat16, CAUSAL, False, False),  # 34-byte rows: element loads
    ((2, 3, 300, 4, 2, 64), jnp.float16, CAUSAL, True, False),   # T = 3 x G = 2 rows, 2 splits
    ((2, 2, 50, 16, 2, 32), jnp.float32, TWO_SIDED, False, True),  # a full tile: 16 rows
    ((1, 1, 40, 8, 1, 136), jnp.bfloat16, CAUSAL, False, False),  # head dim above 128
]


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("shape,dtype,masks,split,backward", CUDA_CASES,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}" for c in CUDA_CASES])
def test_cuda_decode_kernels(backend, shape, dtype, masks, split, backward):
  B, T, S, N, K, H = shape
  q, k, v = qkv(5, *shape, dtype)
  kwargs = dict(is_causal=masks["is_causal"], local_window_size=masks["window"](S),
                key_value_seq_lengths=jnp.asarray(np.linspace(S, 1, B), jnp.int32),
                query_seq_lengths=jnp.asarray(np.linspace(T, 1, B), jnp.int32))
  offset = jnp.int32(S - T - 1)
  f = jax.jit(lambda q, k, v, o: jaxops.attention(q, k, v, query_offset=o, return_residual=True,
                                                  **kwargs))
  r = lambda q, k, v, o: reference.attention(q, k, v, query_offset=o, return_residual=True,
                                             **kwargs)
  harness = backends.harness()
  mmas = lambda: sum(harness.wmma_mmas(kind) for kind in ("half", "bfloat16", "tf32"))
  launches, products = harness.launches(), mmas()
  out, lse = f(q, k, v, offset)
  # The decode kernel (and the merge where the keys split), not the tiled
  # forward: no tensor-core products.
  assert harness.launches() - launches == (2 if split else 1)
  assert mmas() == products
  expected_out, expected_lse = r(*(x.astype(jnp.float32) for x in (q, k, v)), offset)
  assert_close(out, expected_out.astype(dtype), dtype=dtype, reduce_size=S)
  assert_close(lse.astype(jnp.float32), expected_lse.astype(dtype).astype(jnp.float32),
               dtype=dtype, reduce_size=S)
  if backward:
    vjp_against_reference(lambda q, k, v: f(q, k, v, offset), lambda q, k, v: r(q, k, v, offset),
                          (q, k, v), dtype=dtype, reduce_size=S)


def _forward_workspace(q_shape, kv_shape, platform="cuda", **kwargs):
  """The workspace result of jaxops.attention's forward lowered for ``platform``."""
  q, kv = jnp.ones(q_shape), jnp.ones(kv_shape)
  f = lambda q, k, v: jaxops.attention(q, k, v, implementation="ffi", **kwargs)
  (call,) = custom_calls(f, q, kv, kv, platform=platform)
  assert call.target == "jaxops_attention_fwd"
  assert call.results[-1] == contract_workspace(call, platform)
  return call.results[-1]


def test_decode_lowers_with_the_planned_workspace():
  """The CUDA forward's hidden workspace: the decode plan's split-K partials
  (params/attention_decode.h) where T * G rows fit a tile and there is no bias
  or mask; [0] elsewhere and on the CPU."""
  # One group of 4 rows over 1024 keys: 4 splits of 256, (H + 2) floats per row.
  assert _forward_workspace((1, 1, 4, 16), (1, 1024, 1, 16)) == ((4 * 4 * 18 * 4,), "ui8")
  assert _forward_workspace((1, 1, 4, 16), (1, 1024, 1, 16), platform="cpu") == ((0,), "ui8")
  assert _forward_workspace((1, 1, 4, 16), (1, 200, 1, 16)) == ((0,), "ui8")  # one split
  bias = jnp.zeros((1, 4, 1, 1024))
  assert _forward_workspace((1, 1, 4, 16), (1, 1024, 1, 16), bias=bias) == ((0,), "ui8")
  assert _forward_workspace((1, 5, 4, 16), (1, 1024, 1, 16)) == ((0,), "ui8")  # 20 rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "float64", jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_no_keys_at_all_give_zeros(dtype, implementation):
  """S = 0: every row attends no key, so the output is 0 (as jax.nn's) on the
  kernel and on the reference, float64 and complex included, with gradients."""
  with jax.enable_x64(dtype == "float64"):
    q = jnp.ones((2, 3, 4, 8), dtype)
    k = v = jnp.ones((2, 0, 2, 8), dtype)
    attend = lambda q, k, v: jaxops.attention(q, k, v, implementation=implementation)
    out = attend(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and not np.any(np.asarray(out))
    if not jnp.issubdtype(q.dtype, jnp.complexfloating):
      grads = jax.grad(lambda *a: attend(*a).sum(), argnums=(0, 1, 2))(q, k, v)
      assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
      assert not np.any(np.asarray(grads[0]))
