"""The CUDA attention kernels under AddressSanitizer and ThreadSanitizer, run by
the CPU harness (see test_cuda_harness_checks.py for the harness's own checks).

tests/cuda_harness/attention_driver.cc runs the forward and the backward in
float32 (SIMT path), bfloat16 and float16 (wmma path) with a full bias and its
gradient, a broadcast mask, sequence lengths and the causal mask with an
offset, against a double-precision reference, on tiny shapes: GQA, T != S,
lengths that are not multiples of the tile, head dims padded to 16 and the
head dim that selects the smallest tiles.
"""

from test_cuda_harness_checks import RIGHT, _executable, _run

ASAN_SHAPES = ["2x5x9x4x2x8c", "1x17x3x2x1x20", "1x3x5x1x1x200c"]
TSAN_SHAPES = ["1x3x5x2x1x8c"]
DRIVER = "attention_driver.cc"


def test_attention_under_address_sanitizer():
  result = _run(_executable(DRIVER, "asan", with_kernels=True), *ASAN_SHAPES, seed=5)
  assert result.returncode == RIGHT, result.stdout + result.stderr
  assert "AddressSanitizer" not in result.stderr


def test_attention_under_thread_sanitizer():
  result = _run(_executable(DRIVER, "tsan", with_kernels=True), *TSAN_SHAPES)
  assert result.returncode == RIGHT, result.stdout + result.stderr
  assert "ThreadSanitizer" not in result.stderr
