"""The CUDA router kernels under AddressSanitizer and ThreadSanitizer, run by
the CPU harness (see test_cuda_harness_checks.py for the harness's own checks).

tests/cuda_harness/routing_driver.cc runs the forward, JVP and backward
kernels against a double-precision reference, for both scores, with and
without renormalisation and bias, with out-of-range expert ids for the
derivatives, on small shapes: one expert, k = experts, more experts than a
warp's lanes, group-limited routing with several groups per lane.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["1x1/1", "3x7/7", "2x40/5", "2x64/6/8/3", "1x128/8/4/2"]
TSAN_SHAPES = ["2x33/3", "1x32/4/4/2"]
DRIVER = "routing_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_kernels_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_kernels_under_thread_sanitizer():
  check_driver(TSAN)
