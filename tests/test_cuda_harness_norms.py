"""The CUDA norm kernels (cuda/norms.cu) executed on the CPU by the harness.

tests/cuda_harness compiles the unchanged kernels and CUDA FFI handlers with g++
and lowers the production primitives to them (see its __init__.py): the same
public functions, custom VJPs and batching rules as on a GPU, with the CUDA-sized
weight-gradient workspace. The tests are test_norms.py's, run again here; every
test asserts that kernels ran in the harness.
"""

import jax.numpy as jnp
import pytest

from cuda_harness.fixtures import harness, kernels_ran  # noqa: F401  (autouse fixtures)
import test_norms as norms_tests
from jaxops.testing import FLOAT_DTYPES

OPS = norms_tests.OPS
OP_IDS = norms_tests.OP_IDS
DTYPE_IDS = lambda d: jnp.dtype(d).name
# Rows of one warp and of a block, cols = 1, primes, rows longer than one chunk
# of a block's registers (8192 elements vectorised, 4096 scalar).
FORWARD_SHAPES = [(1,), (3, 1), (2, 3, 5), (13, 127), (5, 4099), (2, 64), (2, 8200), (2, 9001)]
VJP_SHAPES = [(1, 1), (3, 5), (11, 257), (2, 1000), (2, 9001)]


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", FORWARD_SHAPES, ids=str)
def test_forward(name, fn, ref, make_args, dtype, shape):
  norms_tests.test_forward_matches_reference(name, fn, ref, make_args, dtype, shape)


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", VJP_SHAPES, ids=str)
def test_vjp(name, fn, ref, make_args, dtype, shape):
  norms_tests.test_derivatives_match_reference(name, fn, ref, make_args, dtype, shape, "vjp")


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (11, 257), (2, 9001)], ids=str)
def test_jvp(name, fn, ref, make_args, dtype, shape):
  """Forward mode: the CUDA JVP kernel (one-warp rows, block rows, rows longer
  than a block's registers)."""
  norms_tests.test_derivatives_match_reference(name, fn, ref, make_args, dtype, shape, "jvp")


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_optional_parameters(name, fn, ref, make_args):
  norms_tests.test_optional_parameters(name, fn, ref, make_args)


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_vmap_in_axes(name, fn, ref, make_args):
  norms_tests.test_vmap_in_axes(name, fn, ref, make_args)


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_per_example_gradients_use_groups(name, fn, ref, make_args):
  norms_tests.test_vmap_of_grad_and_grad_of_vmap(name, fn, ref, make_args)


def test_donated_residual_and_large_means():
  norms_tests.test_add_rms_norm_with_donated_residual()
  norms_tests.test_large_mean_rows_keep_precision()


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_random_thread_order(harness, seed, name, fn, ref, make_args):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  harness.configure("fibers", seed=seed)
  try:
    for mode in ("vjp", "jvp"):
      norms_tests.test_derivatives_match_reference(name, fn, ref, make_args, jnp.float32, (6, 70),
                                                   mode)
      norms_tests.test_derivatives_match_reference(name, fn, ref, make_args, jnp.bfloat16,
                                                   (9, 1030), mode)
  finally:
    harness.configure()


def test_os_thread_mode(harness):
  harness.configure("threads")
  try:
    for name, fn, ref, make_args in OPS:
      norms_tests.test_derivatives_match_reference(name, fn, ref, make_args, jnp.float16, (3, 96),
                                                   "vjp")
  finally:
    harness.configure()
