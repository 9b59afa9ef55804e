"""The CUDA attention kernels (cuda/attention.cu) executed on the CPU by the harness.

tests/cuda_harness compiles the unchanged kernels and CUDA FFI handlers with g++
and lowers the production primitives to them (see its __init__.py), so
jaxops.attention, its custom VJP and batching rules run the CUDA forward and
backward here. float32 takes the SIMT path; bfloat16 and float16 the
tensor-core path (nvcuda::wmma, emulated: the harness reports an sm_80). Each
case compares the output (and log-sum-exp) and the gradients of q, k, v and
the bias, for a random cotangent, with the jnp reference run in float32, both
under one jit each (the harness runs the kernels in a few milliseconds; the
cost of these tests is compiling the references). Every test asserts that
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
from jaxops.testing import assert_tree_close, random_inputs, random_normal, upcast

DTYPE_IDS = lambda d: jnp.dtype(d).name
MASK_CASES = attention_tests.MASK_CASES
B, T, S, N, K = attention_tests.B, attention_tests.T, attention_tests.S, attention_tests.N, \
    attention_tests.K


def _vjp(fn, args, cotangent):
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent)


def check_vjp(fn, ref, args, *, dtype=jnp.float32, reduce_size, seed=0):
  """fn's outputs and input gradients against ref's on float32 copies."""
  shapes = jax.eval_shape(fn, *args)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))
  cotangent = jax.tree.map(lambda o: random_normal(next(keys), o.shape, o.dtype), shapes)
  got = jax.jit(functools.partial(_vjp, fn))(args, cotangent)
  want = jax.jit(functools.partial(_vjp, ref))(upcast(list(args)), upcast(cotangent))
  assert_tree_close(got, want, dtype=dtype, reduce_size=reduce_size)
  return got


def check_case(case, dtype=jnp.float32, H=16, residual=False, **extra):
  """MASK_CASES[case] (GQA: N=4, K=2; T=13, S=21, not multiples of any tile)."""
  q, k, v = attention_tests.qkv(2, B, T, S, N, K, H, dtype)
  bias, mask, kwargs = attention_tests._split_arrays({**MASK_CASES[case], **extra})
  args = [q, k, v] + ([bias.astype(dtype)] if bias is not None else [])

  def call(fn):
    return lambda q, k, v, *b: fn(q, k, v, *(b or (None,)), mask, **kwargs)

  f = call(functools.partial(jaxops.attention, return_residual=True)) if residual else \
      call(jaxops.attention)
  r = call(functools.partial(reference.attention_with_logsumexp)) if residual else \
      call(reference.attention)
  if residual:
    r_inner = r
    r = lambda *a: (lambda o: (o[0], jnp.swapaxes(o[1], -1, -2)))(r_inner(*a))
  out = check_vjp(f, r, args, dtype=dtype, reduce_size=2 * S)[0]
  assert jax.tree.leaves(out)[0].dtype == dtype


@pytest.mark.parametrize("case", ["causal", "window", "seq_lengths", "mask_full", "bias_heads",
                                  "bias_keys", "all"])
def test_float32(case):
  """The SIMT path: every mask kind, dbias of full and broadcast biases."""
  check_case(case)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=DTYPE_IDS)
def test_tensor_cores_all_masks(dtype):
  check_case("all", dtype, H=32)


def test_logsumexp_output_and_cotangent():
  """return_residual: the log-sum-exp output and its cotangent (dlogsumexp)."""
  check_case("bias_heads", residual=True, is_causal=True, query_offset=jnp.int32(8))


# (B, T, S, N, K, H, is_causal, dtype): decode (T = 1) with GQA; T > S; head
# dims padded to 16 (80, 7); the head dims that select smaller tiles (128:
# 32x32 for the float32 forward and the backward; 256: 32x32 forward, 16x16
# backward).
SHAPES = [
    (1, 1, 67, 8, 2, 64, True, jnp.float32),
    (2, 70, 33, 3, 3, 7, True, jnp.float32),
    (1, 20, 45, 1, 1, 256, True, jnp.float32),
    (1, 67, 40, 2, 1, 80, True, jnp.bfloat16),
    (1, 33, 70, 2, 2, 128, False, jnp.float16),
    (1, 17, 9, 1, 1, 256, False, jnp.bfloat16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(shape):
  *shape, is_causal, dtype = shape
  args = attention_tests.qkv(3, *shape, dtype)
  f = functools.partial(jaxops.attention, is_causal=is_causal)
  r = functools.partial(reference.attention, is_causal=is_causal)
  check_vjp(f, r, args, dtype=dtype, reduce_size=max(shape[2], shape[5]))


def test_rows_without_keys():
  """Causal rows before the first key, a row emptied by the mask, a batch with
  no keys: output 0, log-sum-exp -inf, finite gradients equal to the reference's."""
  attention_tests.test_rows_without_keys_give_zero_and_finite_gradients()


def test_traced_query_offset_in_a_decode_loop():
  attention_tests.test_traced_query_offset_in_a_decode_loop()


def test_vmap():
  attention_tests.test_vmap((2, 0, 0))


@functools.lru_cache(maxsize=None)
def _gradients_fn():
  loss = lambda *a: jnp.sum(jnp.sin(jaxops.attention(*a, is_causal=True, query_offset=-3)))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _gradients():
  q, k, v = attention_tests.qkv(21, 1, 37, 29, 4, 2, 16)
  bias = random_inputs(22, [(1, 4, 37, 29)])[0]
  return _gradients_fn()(q, k, v, bias)


@pytest.mark.parametrize("mode,seed", [("fibers", 3), ("threads", 0)])
def test_thread_order_does_not_change_gradients(harness, mode, seed):
  """Random thread and block orders, and OS threads: dq, dk, dv and a full
  bias's gradient are bitwise the same (no atomics on them; a race would show)."""
  expected = _gradients()
  harness.configure(mode, seed=seed)
  try:
    for got, want in zip(_gradients(), expected):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  finally:
    harness.configure()


@pytest.mark.parametrize("case", ["causal", "all", "bias_keys", "mask_full"])
def test_jvp_through_the_public_function(case):
  """jax.jvp of jaxops.attention runs the CUDA forward-mode kernel (one launch)."""
  attention_tests.test_jvp_matches_reference(case)


def test_jvp_dtypes_and_partial_tangents():
  for dtype in (jnp.bfloat16, jnp.float16):
    attention_tests.test_dtypes_forward_and_derivatives(dtype, "all", "jvp")
  attention_tests.test_jvp_of_some_inputs((0, 3))
