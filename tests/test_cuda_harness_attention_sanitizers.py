"""The CUDA attention kernels under AddressSanitizer and ThreadSanitizer, run by
the CPU harness (see test_cuda_harness_checks.py for the harness's own checks).

tests/cuda_harness/attention_driver.cc runs the forward and the backward with a
full bias and its gradient, and the forward mode (cuda/attention_jvp.cu) with
a broadcast bias, with every tangent, with none, and with the subsets that take
each variant of the tangent products (the bias tangent NaN on masked keys), in
float32 (SIMT path, and TF32 wmma path with allow_tf32), bfloat16 and float16
(wmma path), with a broadcast mask
that empties a query row, sequence lengths and the causal mask with an offset,
against a double-precision reference, on tiny shapes: GQA, T != S, lengths
that are not multiples of the tile, head dims padded to 16, two query and key
tiles, and every tile configuration of the forward mode (float32 64x64, 32x32
at H = 64 and 16x16 at H = 200; bfloat16/float16 64x64 and 32x32 at H = 200).
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["2x5x9x4x2x8c", "1x17x3x2x1x20", "1x3x5x1x1x200c", "1x33x40x1x1x64c"]
TSAN_SHAPES = ["1x3x5x2x1x8c", "1x3x40x1x1x64c"]
DRIVER = "attention_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_attention_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_attention_under_thread_sanitizer():
  check_driver(TSAN)
