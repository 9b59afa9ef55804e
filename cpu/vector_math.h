// exp and log written as branch-free float arithmetic, so that loops calling
// them inside `#pragma omp simd` vectorise (libm's expf/logf do not, without
// -ffast-math). Accurate to ~2 ulp over the float range; exp flushes to 0 below
// -87.3 (so exp(-inf) == 0), overflows to +inf above 88.37, and both propagate NaN.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace jaxops::cpu {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float vexp(float x) {
  constexpr float kLow = -87.3f, kHigh = 88.37f;
  // x < kLow and x > kHigh are false for NaN, which then flows through the
  // polynomial and comes out as NaN.
  const float clamped = std::min(std::max(x, kLow), kHigh);
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2) / 2; ln 2 split in
  // two parts so that x - n * ln 2 is exact (Cody-Waite).
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer (|t| < 2^22);
  // floorf would be exact too but GCC does not vectorise it under trapping math.
  constexpr float kRound = 12582912.f;
  const float n = (clamped * 1.44269504088896341f + kRound) - kRound;
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const float scale = bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  const float result = p * scale;
  const float high = x > kHigh ? std::numeric_limits<float>::infinity() : result;
  return x < kLow ? 0.f : high;
}

}  // namespace jaxops::cpu
