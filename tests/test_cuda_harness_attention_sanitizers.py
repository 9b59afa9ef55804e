"""The CUDA attention kernels under AddressSanitizer and ThreadSanitizer, run by
the CPU harness (see test_cuda_harness_checks.py for the harness's own checks).

tests/cuda_harness/attention_driver.cc runs the forward and the backward with a
full bias and its gradient, and the forward mode with a broadcast bias, with
every tangent, with none, and with the subsets that take each variant of the
tangent products (the bias tangent NaN on masked keys), in float32 (the SIMT
kernels, and the tensor-core kernels on emulated TF32 mma.sync with
allow_tf32), bfloat16 and float16 (the tensor-core kernels: mma.sync, ldmatrix
and cp.async emulated), with a broadcast mask that empties a query row,
sequence lengths and the causal mask with an offset, against a
double-precision reference, on tiny shapes: GQA, T != S, lengths that are not
multiples of the tile, head dims that the tensor-core kernels pad to 64, 128
and 256, rows loaded by cp.async and by plain loads (head dims 100 and 20 in
16-bit types: rows that are not whole 16-byte chunks), and the SIMT kernels'
tile configurations (float32 64x64 to 16x16). Under TSan one causal shape
(CI time): three key tiles and a GQA group of two heads take every kernel's
two-stage pipeline through a reuse of each stage: a stage loaded again before
every warp is done with it is a race.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["2x5x9x4x2x8c", "1x17x3x2x1x100", "1x3x5x1x1x200c", "1x33x40x1x1x64c",
               "1x9x4x1x1x20"]
TSAN_SHAPES = ["1x3x150x2x1x64c"]
DRIVER = "attention_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_attention_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_attention_under_thread_sanitizer():
  check_driver(TSAN)
