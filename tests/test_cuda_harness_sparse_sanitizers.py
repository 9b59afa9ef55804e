"""The 2:4 sparse linear CUDA kernels (cuda/sparse.cu) under AddressSanitizer and
ThreadSanitizer, run by the CPU harness.

tests/cuda_harness/sparse_driver.cc runs the forward (with and without bias),
dx and the sampled dvalues kernels against a double-precision reference in
every dtype, on small shapes: one row and one group, an odd number of groups
(the metadata's half-used last byte), more rows than a warp's block of 8, more
groups than a warp's lanes. The bfloat16/float16 forward is the sparse
tensor-core kernel (mma.sp, emulated): `in` not a multiple of its 32-wide step,
`out` not a multiple of its 16 outputs, rows not a multiple of its 8, two warps
of a block at work; metadata with descending and repeated positions. Then the
forward and dx again with NaN, +inf or -inf in every third row of x and dy:
the forward's NaN pass (outputs that prune a non-finite column), over more
groups than its shared-memory list holds at the widest shape.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_SHAPES = ["1x4x1", "3x12x5", "9x36x7", "2x260x3", "0x8x2", "17x68x19", "4x4104x3"]
TSAN_SHAPES = ["2x12x17", "9x68x2"]
DRIVER = "sparse_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=7)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


@prestart(ASAN)
def test_kernels_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_kernels_under_thread_sanitizer():
  check_driver(TSAN)
