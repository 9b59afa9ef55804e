// exp written as branch-free float arithmetic, so that loops calling it inside
// `#pragma omp simd` vectorise (libm's expf does not, without -ffast-math).
// Relative error ~1.2e-7; results below exp(-87.3) flush to 0 (so
// exp(-inf) == 0) and NaN propagates.
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

namespace vector_math_internal {

constexpr float kExpLow = -87.3f;    // exp(kExpLow) is still a normal float
constexpr float kExpHigh = 88.37f;   // 2^n of the reduction stays below 2^128

// exp of x in [kExpLow, kExpHigh] (NaN passes through to the result).
inline float exp_in_range(float x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2) / 2; ln 2 split in
  // two parts so that x - n * ln 2 is exact (Cody-Waite). Adding and
  // subtracting 1.5 * 2^23 rounds to the nearest integer; floorf would too, but
  // GCC does not vectorise it under the default -ftrapping-math.
  constexpr float kRound = 12582912.f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;  // Cephes' expf polynomial
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace vector_math_internal

// exp(x) for the x <= 0 (or -inf, or NaN) that softmax and cross-entropy
// need after subtracting the row maximum. Larger x saturate at exp(88.37)
// instead of overflowing to inf, which spares the select that would handle it.
inline float vexp_nonpositive(float x) {
  using namespace vector_math_internal;
  // std::max/min keep NaN (their first argument), which the polynomial then
  // carries to the result.
  const float result = exp_in_range(std::min(std::max(x, kExpLow), kExpHigh));
  return x < kExpLow ? 0.f : result;
}

}  // namespace jaxops::cpu
