"""The CUDA patch-embedding kernels under AddressSanitizer and ThreadSanitizer,
run by the CPU harness (see test_cuda_harness_checks.py for the harness's own
checks).

tests/cuda_harness/patch_embed_driver.cc runs the forward (every optional
operand, and none) and the backward (every gradient) against a
double-precision reference on small shapes: one pixel, more patch rows than a
64-row tile, a patch longer than a 64-column tile, D past one tile.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["1x1x1x1x1x1", "2x21x15x1x3x7", "1x6x3x8x3x67"]
TSAN_SHAPES = ["1x4x6x3x2x5"]
DRIVER = "patch_embed_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_kernels_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_kernels_under_thread_sanitizer():
  check_driver(TSAN)
