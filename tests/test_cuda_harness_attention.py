"""The CUDA attention kernels (cuda/attention.cu) executed on the CPU by the harness.

tests/cuda_harness compiles the unchanged kernels and CUDA FFI handlers with g++
and lowers the production primitives to them (see its __init__.py), so
jaxops.attention, its custom VJP and batching rules run the CUDA forward and
backward here. float32 takes the SIMT path; bfloat16 and float16 the
tensor-core path (nvcuda::wmma, emulated: the harness reports an sm_80). The
tests are mostly test_attention.py's, on small shapes; every test asserts that
kernels ran in the harness.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_harness.fixtures import harness, kernels_ran  # noqa: F401  (autouse fixtures)
import test_attention as attention_tests
import jaxops
from jaxops import reference
from jaxops.testing import FLOAT_DTYPES, vjp_against_reference

DTYPE_IDS = lambda d: jnp.dtype(d).name


@pytest.mark.parametrize("case", ["none", "causal", "window", "window_int_causal", "seq_lengths",
                                  "mask_full", "mask_rank2", "bias_keys", "all"])
def test_forward_matches_jax_nn(case):
  attention_tests.test_matches_jax_nn(case)


@pytest.mark.parametrize("case", ["causal", "seq_lengths", "bias_heads", "bias_keys", "all"])
def test_grad_matches_reference(case):
  """dq, dk, dv and dbias (full and broadcast biases), GQA (N=4, K=2)."""
  attention_tests.test_grad_matches_reference(case)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ["causal", "all"])
def test_dtypes_forward_and_vjp(dtype, case):
  attention_tests.test_dtypes_forward_and_vjp(dtype, case)


# (B, T, S, N, K, H, is_causal): decode with GQA, T != S with S not a multiple of
# the tile, head dims padded to 16 (80, 7), and the head dims that select the
# smaller tiles (128: 32x32 backward; 256: 32x32 forward, 16x16 backward).
SHAPES = [
    (1, 1, 67, 8, 2, 64, False),
    (2, 70, 33, 6, 3, 32, True),
    (1, 67, 131, 2, 1, 80, True),
    (1, 33, 70, 1, 1, 128, False),
    (1, 20, 45, 1, 1, 256, True),
    (2, 5, 9, 3, 3, 7, False),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(shape):
  attention_tests.test_shapes(shape)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1, 40, 4, 2, 64, True), (1, 70, 33, 2, 1, 80, True),
                                   (1, 33, 20, 1, 1, 128, False), (1, 17, 9, 1, 1, 256, False)],
                         ids=str)
def test_tensor_core_shapes(dtype, shape):
  *shape, is_causal = shape
  args = attention_tests.qkv(4, *shape, dtype)
  f = functools.partial(jaxops.attention, is_causal=is_causal)
  r = functools.partial(reference.attention, is_causal=is_causal)
  vjp_against_reference(jax.jit(f), r, args, dtype=dtype, reduce_size=max(shape[2], shape[5]))


def test_rows_without_keys():
  attention_tests.test_rows_without_keys_give_zero_and_finite_gradients()


def test_traced_query_offset_in_a_decode_loop():
  attention_tests.test_traced_query_offset_in_a_decode_loop()


def test_return_residual_is_differentiable():
  """The logsumexp cotangent reaches the backward kernel."""
  attention_tests.test_return_residual_is_differentiable()


def test_vmap_of_grad_and_grad_of_vmap():
  attention_tests.test_vmap_of_grad_and_grad_of_vmap()


def test_vmap_of_batched_bias_mask_and_lengths():
  attention_tests.test_vmap_of_batched_bias_mask_and_lengths()


def _gradients(dtype):
  q, k, v = attention_tests.qkv(21, 1, 37, 29, 4, 2, 16, dtype)
  bias = jax.random.normal(jax.random.key(22), (1, 4, 37, 29), jnp.float32)
  loss = lambda *a: jnp.sum(jnp.sin(jaxops.attention(*a, is_causal=True, query_offset=-3)))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)


@pytest.mark.parametrize("mode,seed", [("fibers", 3), ("threads", 0)])
def test_thread_order_does_not_change_gradients(harness, mode, seed):
  """Random thread and block orders, and OS threads: dq, dk, dv and a full
  bias's gradient are bitwise the same (no atomics on them; a race would show)."""
  expected = _gradients(jnp.float32)
  harness.configure(mode, seed=seed)
  try:
    for got, want in zip(_gradients(jnp.float32), expected):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  finally:
    harness.configure()
