"""The CUDA harness itself: emulated semantics, planted bugs, and the CUDA norm
kernels under AddressSanitizer and ThreadSanitizer.

Each check runs a harness-built executable in a subprocess (a sanitizer report
or a planted deadlock must not take pytest down): tests/cuda_harness/
harness_cases.cu holds the small kernels, norms_driver.cc runs cuda/norms.cu
against a double-precision reference on small shapes.
"""

import re

import pytest

from support.background import prestart
from support.sanitizers import (LAUNCH_FAILED, RIGHT, WRONG, check_driver, driver_job,
                                 executable, run)

# Shapes for the sanitizers: one-warp rows (several per block), block rows with
# shared-memory reductions, scalar and vector paths, rows longer than a chunk,
# and weight-gradient groups.
# Parts of several rows (each row's x and dy loaded while the previous one
# reduces): 2 parts of 20 one-warp rows, 3 parts of 4 block rows (ROWSxCOLS/GROUPS/PARTS).
ASAN_SHAPES = ["3x5", "8x64/2", "13x1", "2x1000", "1x9001", "2x8200/2", "40x40/1/2",
               "12x600/1/3"]
TSAN_SHAPES = ["2x5", "2x40/2", "1x1000"]


@pytest.fixture(scope="module")
def cases():
  return executable("harness_cases.cu", "plain")


@pytest.mark.parametrize("case", ["block_sum", "dynamic_shared", "shuffles", "wmma"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulated_semantics(cases, case, seed):
  result = run(cases, case, seed=seed)
  assert result.returncode == RIGHT, result.stderr


@pytest.mark.parametrize("case", ["block_sum", "shuffles", "wmma"])
def test_os_thread_mode(cases, case):
  result = run(cases, case, JAXOPS_HARNESS_MODE="threads")
  assert result.returncode == RIGHT, result.stderr


def test_missing_barrier_gives_a_wrong_result(cases):
  # Shared memory is poisoned before each block: reads the barrier should have
  # waited for see NaN, whatever the order.
  for seed in (0, 1, 2):
    result = run(cases, "missing_barrier", seed=seed)
    assert result.returncode == WRONG, result.stderr


@pytest.mark.parametrize("case,report", [
    ("divergent_barrier", r"barrier divergence: .* waits at __syncthreads at .*harness_cases.cu:\d+ "
                          r"while .* waits at __syncthreads at .*harness_cases.cu:\d+"),
    ("barrier_after_exit", r"barrier divergence: thread \(5,0,0\) .*exited while .* wait at "
                           r"__syncthreads"),
    ("shuffle_with_exited_lane", r"(exited while lanes .* wait for it at __shfl_down_sync|"
                                 r"the mask names lanes .* that have exited)"),
    ("warp_waits_for_block", r"deadlock: .*31 thread\(s\) at __syncthreads .* 1 thread\(s\) at "
                             r"__syncwarp"),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_misuse_is_reported_not_hung(cases, case, report, seed):
  result = run(cases, case, seed=seed)
  assert result.returncode == LAUNCH_FAILED, result.stderr
  assert "cudaErrorLaunchFailure" in result.stderr
  assert re.search(report, result.stderr), result.stderr


def test_misuse_is_reported_in_os_thread_mode(cases):
  for case in ("divergent_barrier", "warp_waits_for_block"):
    result = run(cases, case, JAXOPS_HARNESS_MODE="threads")
    assert result.returncode == LAUNCH_FAILED, result.stderr


@pytest.mark.parametrize("case,kind", [
    ("read_past_global", "heap-buffer-overflow"),
    ("read_past_shared", "global-buffer-overflow"),
    ("read_past_dynamic_shared", "heap-buffer-overflow"),
])
def test_address_sanitizer_catches_out_of_bounds_reads(case, kind):
  result = run(executable("harness_cases.cu", "asan"), case)
  assert f"AddressSanitizer: {kind}" in result.stderr, result.stderr
  assert "harness_cases.cu" in result.stderr
  assert result.returncode not in (RIGHT, WRONG, LAUNCH_FAILED)


@pytest.mark.parametrize("mode", ["fibers", "threads"])
def test_thread_sanitizer_catches_the_missing_barrier(mode):
  # The drivers run under TSan as fibers; the OS threads mode must find races too.
  tsan_cases = executable("harness_cases.cu", "tsan")
  result = run(tsan_cases, "missing_barrier", JAXOPS_HARNESS_MODE=mode)
  assert "ThreadSanitizer: data race" in result.stderr
  assert "block_sum<false>" in result.stderr
  correct = run(tsan_cases, "block_sum", JAXOPS_HARNESS_MODE=mode)
  assert correct.returncode == RIGHT, correct.stderr


NORMS_ASAN = driver_job("norms_driver.cc", "asan", *ASAN_SHAPES, seed=5)
NORMS_TSAN = driver_job("norms_driver.cc", "tsan", *TSAN_SHAPES)


@prestart(NORMS_ASAN)
def test_norm_kernels_under_address_sanitizer():
  check_driver(NORMS_ASAN)


@prestart(NORMS_TSAN)
def test_norm_kernels_under_thread_sanitizer():
  check_driver(NORMS_TSAN)
