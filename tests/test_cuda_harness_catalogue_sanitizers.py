"""The catalogue CUDA kernels (activations, rope, embedding, adamw) under
AddressSanitizer and ThreadSanitizer, run by the CPU harness (see
test_cuda_harness_checks.py for the harness's own checks and the norm kernels,
the op test files (backend cuda_harness) for these kernels through the JAX primitives).

tests/cuda_harness/catalogue_driver.cc launches each kernel through its host
launcher in cuda/*.h, in float32, bfloat16 and float16, against a
double-precision reference, on tiny shapes: sizes that are odd or not a multiple
of anything, one block and several (kThreads is 256), partial rotary and
per-batch positions, the 16-byte and the element-by-element paths (rope's
neox and gptj units, activations on misaligned buffers), out-of-range ids, more
tokens than a warp and than one shared-memory tile of the gradient's sort
(2100 tokens: two tiles and a global step), aliased outputs, AdamW's 16-byte
packs (a full 2048-element tile) and more leaves than one launch's table holds.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

ASAN_CASES = ["act=1", "act=37", "act=600", "rope=2x3x3x10x6/2", "rope=1x5x2x8x8/1",
              "rope=3x2x1x6x2/1", "rope=2x3x2x32x16/2", "emb=7x5x37", "emb=1500x1x70",
              "emb=4x3x0", "emb=50x1x2100", "adamw=1", "adamw=37", "adamw=2049",
              "adamw_leaves=385"]
# Every CUDA thread is an OS thread under TSan, so a launch costs ~0.1 s: the
# elementwise kernels run in float32 only (their dtypes differ only in the
# conversions ASan has covered), the embedding gradient in two dtypes.
TSAN_CASES = ["types=float32", "act=5", "rope=2x2x1x6x4/2", "adamw=5", "emb=5x3x37",
              "types=bfloat16", "emb=5x3x37"]
DRIVER = "catalogue_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_CASES, seed=5)
TSAN = driver_job(DRIVER, "tsan", *TSAN_CASES)


@prestart(ASAN)
def test_catalogue_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_catalogue_under_thread_sanitizer():
  check_driver(TSAN)
