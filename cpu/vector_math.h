// Float32 exp, logistic sigmoid, Gaussian CDF and sin/cos written so that a loop calling
// them under `#pragma omp simd` vectorises: straight-line arithmetic, integer bit
// tricks through memcpy, selects instead of branches, no libm calls. libm's
// expf per element would make the activations compute-bound; these keep them
// at the speed of memory while staying within a few float32 ulps.
//
// Special values: NaN propagates; exp(+large) = inf, exp(-large) = 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "params/rope_math.h"

namespace jaxops::cpu::vector_math {

inline float bits_to_float(int32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline int32_t float_to_bits(float f) {
  int32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// condition ? a : b with both arms already computed, as bit operations. A
// float `c ? 1 - s : e * s` leaves the arms' arithmetic under the condition,
// and with trapping math (GCC's default) if-conversion will not hoist an
// operation that could trap out of its arm: on AVX-512 the loop still
// vectorises (masked operations), on AVX2 and SSE it does not ("control flow
// in loop"), and the activations' backward ran scalar there, 10x slower than
// its forward (gelu float32 8192 x 4096, avx2 variant: 390 ms against XLA's
// 52). The mask makes both arms plain data.
inline float select(bool condition, float a, float b) {
  const int32_t mask = -static_cast<int32_t>(condition);
  return bits_to_float((float_to_bits(a) & mask) | (float_to_bits(b) & ~mask));
}

// An order-preserving map from float bits to int32 (and its own inverse):
// negative floats have their magnitude bits flipped, so that comparing keys as
// integers compares the floats.
inline int32_t ordered_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

// min(max(x, lo), hi), NaN passing through. Written as integer min/max on
// ordered keys: GCC turns a float `x > hi ? hi : x` into control flow whose
// constant arm it then specialises (jump threading, PRE), and the vectorised
// loop ends up running several predicated copies of everything downstream of
// the clamp (four divisions instead of one in the GELU backward). Integer
// min/max and a select between two variables stay single instructions.
inline float clamp(float x, float lo, float hi) {
  const int32_t bits = float_to_bits(x);
  int32_t key = ordered_key(bits);
  const int32_t lo_key = ordered_key(float_to_bits(lo));
  const int32_t hi_key = ordered_key(float_to_bits(hi));
  key = key < lo_key ? lo_key : key;
  key = key > hi_key ? hi_key : key;
  const bool is_nan = (bits & 0x7fffffff) > 0x7f800000;
  return bits_to_float(is_nan ? bits : ordered_key(key));
}

// 2^n for an integer n in [-126, 127], built from the exponent bits.
inline float exp2_int(int32_t n) { return bits_to_float((n + 127) << 23); }

// e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln(2) / 2. ln 2 is split in a
// high part with trailing zero bits (n * kLn2Hi is exact) and a low part, so r
// is accurate; e^r is its degree-7 Taylor polynomial (truncation < 1e-8
// relative). 2^n is applied in two halves so that results down in the
// subnormal range (n < -126) come out right instead of flushing to zero early.
inline float exp(float x) {
  constexpr float kLog2e = 1.442695041e+00f;
  constexpr float kLn2Hi = 6.931152344e-01f;
  constexpr float kLn2Lo = 3.194618495e-05f;
  // Past these bounds the result is inf or 0 anyway; clamping keeps n in the
  // range exp2_int accepts. NaN passes through.
  x = clamp(x, -104.0f, 89.0f);
  // Round to nearest by adding 1.5 * 2^23: the integer lands in the low
  // mantissa bits, so n can be read from the bits without a conversion.
  constexpr float kShifter = 12582912.0f;
  const float shifted = x * kLog2e + kShifter;
  const float n = shifted - kShifter;
  const int32_t n_int = float_to_bits(shifted) - float_to_bits(kShifter);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t half = n_int >> 1;
  return p * exp2_int(half) * exp2_int(n_int - half);
}

// e^x = 2^n e^r for x in [-88, 88.37] (or NaN), n = round(x / ln 2) by the
// 1.5 * 2^23 shifter (floorf does not vectorise under -ftrapping-math), read
// from the low mantissa bits; ln 2 split so that x - n ln 2 is exact; e^r by
// Cephes' expf polynomial (relative error ~1.2e-7). 2^n is one exponent field:
// n = -127 (x near -88) gives 0, not a subnormal.
inline float exp_cephes(float x) {
  constexpr float kShifter = 12582912.0f;
  const float shifted = x * 1.44269504088896341f + kShifter;
  const float n = shifted - kShifter;
  const int32_t n_int = float_to_bits(shifted) - float_to_bits(kShifter);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * exp2_int(n_int);
}

// exp(-a) for a >= 0 or NaN (NaN stays NaN). Past a = 88 it is exactly 0:
// there the 2^n of the reduction is 2^-127, whose exponent bits are 0 (the
// subnormal values of exp(-87.3..-88) are flushed by XLA's CPU runtime anyway).
// Cheaper than exp(): one integer min instead of a two-sided clamp on ordered
// keys, no two-step scaling into the subnormals (exp_cephes, as
// vexp_nonpositive).
inline float exp_of_minus(float a) {
  // For a >= 0 integer order is float order; a NaN (bits above inf's) is
  // clamped too and put back at the end.
  const int32_t bits = float_to_bits(a);
  const int32_t limit = float_to_bits(88.0f);
  const float x = -bits_to_float(bits < limit ? bits : limit);
  return select(bits > 0x7f800000, a, exp_cephes(x));
}

// sigmoid(x) = 1 / (1 + e^-x) and its complement 1 - sigmoid(x), each accurate
// in relative terms on both tails, from e = exp(-|x|) in [0, 1]: r = 1 / (1 +
// e) is the sigmoid of |x| (in [1/2, 1]) and e r its complement (in [0, 1/2]),
// swapped for x < 0; e never overflows. NaN gives NaN. Against the full-range
// exp() this took the silu forward's vectorised loop from 36 to 28
// instructions a vector, and on cache-resident float32 data from 0.58 to 0.38
// ns an element (avx512; avx2 0.83 to 0.60).
struct Sigmoid {
  float value;
  float complement;
};

inline Sigmoid sigmoid(float x) {
  const float e = exp_of_minus(std::fabs(x));
  const float r = 1.0f / (1.0f + e);
  const float q = e * r;
  const bool positive = x >= 0.0f;
  return {select(positive, r, q), select(positive, q, r)};
}

// x * x - round(x * x), exactly (Dekker's product, no FMA needed): the part of
// x^2 that rounding loses. exp(-x^2 / 2) has relative condition x^2, so for
// |x| ~ 10 the rounding of x^2 alone would cost ~100 ulps.
inline float square_rounding_error(float x, float square) {
  const float high = bits_to_float(float_to_bits(x) & static_cast<int32_t>(0xfffff000u));
  const float low = x - high;
  return ((high * high - square) + 2.0f * high * low) + low * low;
}

// exp(-x^2 / 2), with the rounding error of x^2 corrected to first order.
// |x| is clamped to 20 (the result is 0 from 14.5 on) so that x^2 stays finite.
inline float gaussian_kernel(float x) {
  x = clamp(x, -20.0f, 20.0f);
  const float square = x * x;
  const float error = square_rounding_error(x, square);
  return exp(-0.5f * square) * (1.0f - 0.5f * error);
}

// Phi(x) = P(N(0,1) <= x) = (1 + erf(x / sqrt 2)) / 2, given e = exp(-x^2 / 2).
//   |x| < sqrt 2: 1/2 + z P(z^2) / 2, z = x / sqrt 2, with P ~ erf(z) / z;
//   otherwise the tail 1/2 e Q(sqrt 2 / |x|), with Q(u) ~ erfcx(1 / u) (the
//   scaled complementary error function) fitted for |x| / sqrt 2 in [1, 10];
//   the lower tail is that value itself (relative accuracy where Phi is tiny),
//   the upper one 1 minus it.
// P and Q are least-squares polynomial fits in float64 weighted towards the
// minimax relative error (1.2e-9 and 1.4e-8); Phi is within ~10 float32 ulps
// (the worst case is 1/2 + erf/2 cancelling near x = -1.3).
//
// The central part in Real arithmetic: float where the multiply-adds fuse, and
// double where they do not (the generic x86-64-v2 variant): there every
// Horner step rounds twice, which the cancellation magnifies 4.5x near x = -1.3
// (11.7 ulps of Phi, measured).
template <typename Real>
inline Real gaussian_cdf_central(float x) {
  const Real z = static_cast<Real>(x) * static_cast<Real>(0.70710678118654752);
  const Real s = z * z;
  Real p = 7.853830175e-05f;
  p = p * s - 8.010184392e-04f;
  p = p * s + 5.188326817e-03f;
  p = p * s - 2.685381100e-02f;
  p = p * s + 1.128358543e-01f;
  p = p * s - 3.761262596e-01f;
  p = p * s + 1.128379107e+00f;
  return Real(0.5f) + Real(0.5f) * z * p;
}

#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
using GaussianCdfCentralReal = float;
#else
using GaussianCdfCentralReal = double;
#endif

inline float gaussian_cdf(float x, float e) {
  constexpr float kSqrt2 = 1.414213562e+00f;
  const float central = static_cast<float>(gaussian_cdf_central<GaussianCdfCentralReal>(x));

  const float ax = std::fabs(x);
  // u in [0.1, 1]: below 0.1 (|x| > 14) is beyond the fit, where e is 0 in float32.
  const float u = clamp(kSqrt2 / clamp(ax, kSqrt2, 20.0f * kSqrt2), 0.1f, 1.0f);
  float q = -4.826535285e-02f;
  q = q * u + 3.287966847e-01f;
  q = q * u - 9.900751710e-01f;
  q = q * u + 1.713500381e+00f;
  q = q * u - 1.821658015e+00f;
  q = q * u + 1.102893114e+00f;
  q = q * u - 1.627400964e-01f;
  q = q * u - 2.567053437e-01f;
  q = q * u - 2.487078309e-03f;
  q = q * u + 5.643277764e-01f;
  q = q * u - 3.301858442e-06f;
  const float tail = 0.5f * e * q;
  const float outer = select(x > 0.0f, 1.0f - tail, tail);
  return select(ax < kSqrt2, central, outer);
}

// sin and cos of a float32 angle, correctly rounded in all but rare cases, by
// the reduction and polynomials of params/rope_math.h (shared with the CUDA
// kernel, so both build the same tables). Used for rotary embedding tables,
// whose angles (position * frequency) reach 1e5 and beyond.
inline void sincos(float angle, float* sin_out, float* cos_out) {
  // Round to nearest by adding 1.5 * 2^52: k mod 4 is in the low mantissa bits.
  constexpr double kShifter = 6755399441055744.0;
  const double a = angle;
  const double shifted = a * rope_math::kTwoOverPi + kShifter;
  const double k = shifted - kShifter;
  int64_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const int64_t quadrant = shifted_bits & 3;
  const double r = rope_math::reduce_quarter_turns(a, k);
  const double s = rope_math::sin_reduced(r);
  const double c = rope_math::cos_reduced(r);
  // sin(r + q pi/2), cos(r + q pi/2) for the quadrant q: an odd q swaps sin
  // and cos, q = 2, 3 negate sin and q = 1, 2 negate cos. Done on the bits
  // (GCC does not if-convert a double select on an integer condition).
  const int64_t swap_mask = -(quadrant & 1);
  int64_t s_bits, c_bits;
  std::memcpy(&s_bits, &s, sizeof(s_bits));
  std::memcpy(&c_bits, &c, sizeof(c_bits));
  int64_t sin_bits = (s_bits & ~swap_mask) | (c_bits & swap_mask);
  int64_t cos_bits = (c_bits & ~swap_mask) | (s_bits & swap_mask);
  sin_bits ^= (quadrant & 2) << 62;
  cos_bits ^= ((quadrant + 1) & 2) << 62;
  double sin_value, cos_value;
  std::memcpy(&sin_value, &sin_bits, sizeof(sin_value));
  std::memcpy(&cos_value, &cos_bits, sizeof(cos_value));
  *sin_out = static_cast<float>(sin_value);
  *cos_out = static_cast<float>(cos_value);
}

}  // namespace jaxops::cpu::vector_math

namespace jaxops::cpu {

// exp(x) for the x <= 0 (or -inf, or NaN) that softmax and cross-entropy need
// after subtracting the row maximum: results below exp(-87.3) are 0 rather than
// subnormal, which spares the two-step scaling that vector_math::exp needs for
// the full range in the hottest loop of those kernels. Larger x saturate at
// exp(88.37) instead of overflowing. Relative error ~1.2e-7.
inline float vexp_nonpositive(float x) {
  constexpr float kExpLow = -87.3f;   // exp(kExpLow) is still a normal float
  constexpr float kExpHigh = 88.37f;  // 2^n of the reduction stays below 2^128
  // NaN passes the clamp; the polynomial carries it on. (vector_math::clamp,
  // not std::min/max, which GCC turned into branches here.)
  const float clamped = vector_math::clamp(x, kExpLow, kExpHigh);
  const float result = vector_math::exp_cephes(clamped);
  // (A bit select: a float one left the polynomial under a branch that
  // trapping math kept from vectorising off AVX-512; see select.)
  return vector_math::select(x < kExpLow, 0.f, result);
}

}  // namespace jaxops::cpu
