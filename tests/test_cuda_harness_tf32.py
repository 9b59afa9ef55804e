"""The harness's ``nvcuda::wmma::__float_to_tf32`` (tests/cuda_harness/include/
cuda_on_cpu.h) against the definition of the instruction it stands for,
cvt.rna.tf32.f32: round to 10 explicit mantissa bits, to nearest with ties
away from zero, the 13 dropped bits zero; NaN and infinities kept. The CUDA
kernels round every float32 operand of a TF32 tensor-core product with it
(cuda/attention_tiles.cuh), and tests/test_matmul_precision_kernels.py checks
those products against float64.
"""

import numpy as np

from support import backends


def _tf32_by_definition(bits):
  """cvt.rna.tf32.f32 from its definition, in float64: |x| rounded to a multiple
  of tf32's spacing at x (2^(e - 11) for |x| in [2^(e-1), 2^e), the
  subnormals' 2^-136 below 2^-126), halves away from zero; past float32's range
  an infinity; NaN and infinities unchanged."""
  with np.errstate(invalid="ignore", over="ignore"):  # signalling NaNs; rounding past the range
    x = bits.view(np.float32).astype(np.float64)
    finite = np.isfinite(x)
    _, exponent = np.frexp(np.where(finite, x, 1.0))
    spacing = np.exp2(np.maximum(exponent - 11, -136).astype(np.float64))
    rounded = np.copysign(np.floor(np.abs(x) / spacing + 0.5) * spacing, x)
    return np.where(finite, rounded, x).astype(np.float32)


def _special_bits():
  """Ties (the dropped bits exactly 0x1000, after an even kept mantissa, where
  ties-to-even would round down, and after an odd one), carries into the
  exponent, the largest finite values (one ties into infinity), subnormals,
  zero, infinity and NaNs of several payloads (0x7fffffff + 0x1000 would wrap to
  -0), with both signs."""
  positive = [0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001, 0x3fffffff, 0x3fffefff,
              0x7f7fe000, 0x7f7fefff, 0x7f7ff000, 0x7f7fffff, 0x00000001, 0x00001000,
              0x00001001, 0x007fffff, 0x00800000, 0x00000000, 0x7f800000, 0x7f800001,
              0x7fc00000, 0x7fffffff, 0x7f801000]
  return np.array(positive + [b | 0x80000000 for b in positive], np.uint32)


def test_float_to_tf32_matches_its_definition():
  harness = backends.harness()
  bits = np.concatenate([_special_bits(),
                         np.random.default_rng(7).integers(0, 2**32, 20000, dtype=np.uint32)])
  got = np.array([harness.float_to_tf32(x) for x in bits.view(np.float32).tolist()], np.float32)
  want = _tf32_by_definition(bits)
  nan = np.isnan(want)
  assert np.array_equal(np.isnan(got), nan)
  got_bits, want_bits = got.view(np.uint32)[~nan], want.view(np.uint32)[~nan]
  wrong = np.flatnonzero(got_bits != want_bits)[:8]
  assert wrong.size == 0, [(hex(b), hex(g), hex(w)) for b, g, w in
                           zip(bits[~nan][wrong], got_bits[wrong], want_bits[wrong])]
  assert not (got_bits & 0x1fff).any()
