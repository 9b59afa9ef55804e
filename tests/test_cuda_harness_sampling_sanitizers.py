"""The CUDA sampling kernel under AddressSanitizer and ThreadSanitizer, run by
the CPU harness (see test_cuda_harness_checks.py for the harness's own checks).

tests/cuda_harness/sampling_driver.cc checks every token against a
double-precision oracle (in the kept set, and the inverse-CDF draw at the
row's uniform) with per-row parameters, greedy rows, ties, NaN, +inf and -inf
rows, on small shapes: a vocabulary of 1, one-warp blocks, a row longer than
the block's threads.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["14x1", "14x37", "3x300"]
TSAN_SHAPES = ["7x40"]
DRIVER = "sampling_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_kernels_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_kernels_under_thread_sanitizer():
  check_driver(TSAN)
