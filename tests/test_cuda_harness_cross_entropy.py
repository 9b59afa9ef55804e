"""The CUDA cross-entropy kernels (cuda/cross_entropy.cu) executed on the CPU by
the harness, through cross_entropy and linear_cross_entropy (whose blocks use
the in-place forward-grad and backward kernels).

tests/cuda_harness compiles the unchanged kernels and CUDA FFI handlers with g++
and lowers the production primitives to them (see its __init__.py). The tests
are test_cross_entropy.py's, run again here; every test asserts that kernels ran
in the harness.
"""

import jax.numpy as jnp
import pytest

from cuda_harness.fixtures import harness, kernels_ran  # noqa: F401  (autouse fixtures)
import test_cross_entropy as ce_tests
from jaxops.testing import FLOAT_DTYPES

DTYPE_IDS = lambda d: jnp.dtype(d).name
# One-warp blocks, wider blocks, vocab = 1, primes, a vocabulary longer than a
# block's threads * 8.
FORWARD_SHAPES = [(1,), (1, 1), (7, 13), (13, 127), (3, 4099)]


@pytest.fixture
def small_blocks(monkeypatch):
  def use(tokens_per_block, vocab):
    monkeypatch.setattr(ce_tests.cross_entropy_src, "_LOGITS_BLOCK_BYTES",
                        4 * vocab * tokens_per_block)
  return use


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", FORWARD_SHAPES, ids=str)
def test_forward(dtype, shape):
  ce_tests.test_forward_matches_reference(dtype, shape)


@pytest.mark.parametrize("options", ce_tests.OPTIONS, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options_vjp(options, reduction):
  ce_tests.test_options_vjp_matches_reference(options, reduction)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,reduction", [((5, 3), "none"), ((11, 257), "mean"),
                                             ((2, 1030), "none")], ids=str)
def test_vjp(dtype, shape, reduction):
  ce_tests.test_vjp_matches_reference(dtype, shape, reduction)


@pytest.mark.parametrize("options", ce_tests.OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_jvp(options, dtype):
  ce_tests.test_jvp_matches_reference(options, dtype)


def test_vmap_and_labels():
  ce_tests.test_vmap_in_axes()
  ce_tests.test_out_of_range_labels_give_nan_loss_and_no_gradient()
  ce_tests.test_all_ignored_mean_is_zero_not_nan()


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("tokens,hidden,vocab,per_block,bias", [
    ((13,), 8, 37, 4, False), ((2, 7), 16, 101, 5, True)], ids=str)
def test_linear_vjp(small_blocks, reduction, tokens, hidden, vocab, per_block, bias):
  ce_tests.test_linear_vjp_matches_reference(small_blocks, reduction, tokens, hidden, vocab,
                                             per_block, bias)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_linear_dtypes(small_blocks, dtype):
  ce_tests.test_linear_dtypes(small_blocks, dtype)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_thread_order(harness, seed):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  harness.configure("fibers", seed=seed)
  try:
    ce_tests.test_vjp_matches_reference(jnp.float32, (6, 700), "none")
  finally:
    harness.configure()


def test_os_thread_mode(harness, small_blocks):
  harness.configure("threads")
  try:
    ce_tests.test_vjp_matches_reference(jnp.float16, (3, 96), "mean")
    ce_tests.test_linear_vjp_matches_reference(small_blocks, "mean", (5,), 4, 40, 2, True)
  finally:
    harness.configure()
