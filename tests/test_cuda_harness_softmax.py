"""The CUDA softmax kernels (cuda/softmax.cu) executed on the CPU by the harness.

tests/cuda_harness compiles the unchanged kernels and CUDA FFI handlers with g++
and lowers the production primitives to them (see its __init__.py). The tests
are test_softmax.py's, run again here; every test asserts that kernels ran in
the harness.
"""

import jax.numpy as jnp
import pytest

from cuda_harness.fixtures import harness, kernels_ran  # noqa: F401  (autouse fixtures)
import test_softmax as softmax_tests
from jaxops.testing import FLOAT_DTYPES

MASKED, MASKED_IDS = softmax_tests.MASKED, softmax_tests.MASKED_IDS
DTYPE_IDS = lambda d: jnp.dtype(d).name
# One-warp blocks (cols <= 256), wider blocks, cols = 1, primes, rows longer
# than a block's threads * 8.
FORWARD_SHAPES = [(1,), (3, 1), (2, 3, 5), (13, 127), (3, 700), (2, 4099)]


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", FORWARD_SHAPES, ids=str)
def test_forward(name, fn, ref, dtype, shape):
  softmax_tests.test_forward_matches_reference(name, fn, ref, dtype, shape)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("query_offset", [0, 2, -1])
def test_causal_forward(dtype, query_offset):
  softmax_tests.test_causal_forward_matches_reference(dtype, (3, 7, 7), query_offset)
  softmax_tests.test_causal_forward_matches_reference(dtype, (4, 129), query_offset)


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
@pytest.mark.parametrize("x_shape,where_shape,bias_shape,axis", softmax_tests.BROADCASTS, ids=str)
def test_where_and_bias_broadcast(name, fn, ref, x_shape, where_shape, bias_shape, axis):
  softmax_tests.test_where_and_bias_broadcast(name, fn, ref, x_shape, where_shape, bias_shape,
                                              axis)


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (11, 257), (2, 1030)], ids=str)
def test_vjp(name, fn, ref, dtype, shape):
  softmax_tests.test_derivatives_match_reference(name, fn, ref, dtype, shape, "vjp")


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (11, 257), (2, 1030)], ids=str)
def test_jvp(name, fn, ref, dtype, shape):
  """Forward mode (masked, with a bias tangent): the CUDA linear-map kernel."""
  softmax_tests.test_derivatives_match_reference(name, fn, ref, dtype, shape, "jvp")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_causal_jvp(dtype):
  softmax_tests.test_causal_derivatives_match_reference(dtype, "jvp")


def test_causal_vjp():
  softmax_tests.test_causal_derivatives_match_reference(jnp.float32, "vjp")


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_vmap_in_axes(name, fn, ref):
  softmax_tests.test_vmap_in_axes(name, fn, ref)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_fully_masked_rows_and_nan(dtype):
  softmax_tests.test_fully_masked_rows_are_zero_not_nan(dtype)
  softmax_tests.test_nan_in_a_visible_column_poisons_the_row()
  softmax_tests.test_causal_offsets_beyond_the_keys()


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_random_thread_order(harness, seed, name, fn, ref):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  harness.configure("fibers", seed=seed)
  try:
    softmax_tests.test_derivatives_match_reference(name, fn, ref, jnp.float32, (6, 700), "vjp")
  finally:
    harness.configure()


def test_os_thread_mode(harness):
  harness.configure("threads")
  try:
    for name, fn, ref in MASKED:
      softmax_tests.test_derivatives_match_reference(name, fn, ref, jnp.float16, (3, 96), "vjp")
  finally:
    harness.configure()
