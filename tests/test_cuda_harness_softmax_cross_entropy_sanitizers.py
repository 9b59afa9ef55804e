"""The CUDA softmax and cross-entropy kernels under AddressSanitizer and
ThreadSanitizer, run by the CPU harness (see test_cuda_harness_checks.py for
the harness's own checks and the norm kernels).

tests/cuda_harness/softmax_cross_entropy_driver.cc runs every kernel against a
double-precision reference, with a broadcast mask and bias, a causal limit,
ignored and out-of-range labels and the in-place forward-grad, on small shapes:
one-warp rows, block rows, rows longer than a block's registers hold on the
element-by-element path (4099) and the 16-byte path (8200: the forward-grad
re-reads its first chunk in place).
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["3x5", "8x64", "13x1", "2x1000", "1x4099", "1x8200"]
TSAN_SHAPES = ["2x5", "2x300"]
DRIVER = "softmax_cross_entropy_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_kernels_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_kernels_under_thread_sanitizer():
  check_driver(TSAN)
