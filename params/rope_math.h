// The math of rotary embedding tables that the CPU kernel (cpu/vector_math.h:
// sincos) and the CUDA kernel (cuda/rope.cu) share, so that both platforms
// build the same cos/sin table: sin and cos of a float32 angle in double
// precision, the angle reduced by k pi/2 with pi/2 split in three parts (the
// first two have 28 significant bits, so k * part is exact for the |k| < 2^25
// of any float32 angle below 5e7), and sin/cos of the remainder |r| <= pi/4 as
// Taylor polynomials accurate to 1e-14. How k is rounded and how the quadrant
// picks and signs the results is each platform's own (branch-free bit
// operations that vectorise on the CPU, selects on the GPU).
#pragma once

#include "params/host_device.h"

namespace jaxops::rope_math {

// 2 / pi: k = round(angle * kTwoOverPi) quarter turns.
inline constexpr double kTwoOverPi = 0.6366197723675814;

// The remainder angle - k pi/2, |r| <= pi/4, for an integer k.
JAXOPS_HOST_DEVICE double reduce_quarter_turns(double angle, double k) {
  constexpr double kPiOver2Part1 = 1.570796325802803;
  constexpr double kPiOver2Part2 = 9.920935808982456e-10;
  constexpr double kPiOver2Part3 = -1.2177051777973966e-18;
  return ((angle - k * kPiOver2Part1) - k * kPiOver2Part2) - k * kPiOver2Part3;
}

// sin(r) for |r| <= pi/4.
JAXOPS_HOST_DEVICE double sin_reduced(double r) {
  const double r2 = r * r;
  double s = 1.0 / 6227020800.0;
  s = s * r2 - 1.0 / 39916800.0;
  s = s * r2 + 1.0 / 362880.0;
  s = s * r2 - 1.0 / 5040.0;
  s = s * r2 + 1.0 / 120.0;
  s = s * r2 - 1.0 / 6.0;
  return r + r * r2 * s;
}

// cos(r) for |r| <= pi/4.
JAXOPS_HOST_DEVICE double cos_reduced(double r) {
  const double r2 = r * r;
  double c = -1.0 / 87178291200.0;
  c = c * r2 + 1.0 / 479001600.0;
  c = c * r2 - 1.0 / 3628800.0;
  c = c * r2 + 1.0 / 40320.0;
  c = c * r2 - 1.0 / 720.0;
  c = c * r2 + 1.0 / 24.0;
  c = c * r2 - 0.5;
  return 1.0 + r2 * c;
}

}  // namespace jaxops::rope_math
