// Conversions between the storage types of jaxops tensors (float, bfloat16,
// float16) and the float32 the kernels compute in: the one conversion layer of
// cpu/ (cpu/row_buffer.h builds the kernels' row buffers on it). Rows are
// converted into a float buffer once so that every later pass over the row
// runs on contiguous float32 and vectorises.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace jaxops::cpu {

using bfloat16 = Eigen::bfloat16;
using float16 = Eigen::half;

inline float to_float(float v) { return v; }
inline float to_float(bfloat16 v) { return static_cast<float>(v); }
inline float to_float(float16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

// Row conversions, one per storage type, used by every kernel: on long rows
// (the norms, softmax, cross-entropy) and on the short rows of attention (a
// head's H values, converted in inner loops, often inlined into OpenMP
// regions, where GCC's auto-vectoriser gives up on plain loops). So they are
// `#pragma omp simd` loops or explicit vectors (the float copy: 16 floats, one
// AVX-512 register, at a time rather than a memcpy call on short rows), never
// left to the auto-vectoriser. The bfloat16 widening as an `omp simd` loop
// measured 2-3x faster than as 16-element generic vectors (rows of 64 and
// 4096; a noisy machine).
namespace convert_detail {
inline constexpr int64_t kChunk = 16;
typedef float FloatChunk __attribute__((vector_size(kChunk * sizeof(float))));
}  // namespace convert_detail

inline void load_row(const float* src, float* dst, int64_t n) {
  using convert_detail::FloatChunk, convert_detail::kChunk;
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    FloatChunk v;
    std::memcpy(&v, src + i, sizeof(v));
    std::memcpy(dst + i, &v, sizeof(v));
  }
  for (; i < n; ++i) dst[i] = src[i];
}

inline void store_row(const float* src, float* dst, int64_t n) { load_row(src, dst, n); }

// bfloat16 -> float is exact: the bits shifted into the high half.
inline void load_row(const bfloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    dst[i] = value;
  }
}

// float -> bfloat16 with integer ops the compiler vectorises (Eigen's scalar
// conversion has a NaN branch that blocks it). Round to nearest even; NaN
// stays a quiet NaN.
inline uint16_t bfloat16_bits(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 floats rounded to bfloat16, each in the low half of its 32-bit lane: the
// scalar rounding above on one register, with the NaN test done by one float
// compare rather than the mask-and-compare GCC derives from it.
inline __m256i bfloat16_lanes_avx2(__m256 value) {
  const __m256i u = _mm256_castps_si256(value);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}
#endif

inline void store_row(const float* src, bfloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 16 at a time, packed once: GCC's vectorisation of the loop below packs
  // the result and the NaN mask separately (3 vpackusdw + 3 vpermq and 33
  // instructions per 16 elements, against 21 here). The lanes hold values
  // below 2^16, so the unsigned saturating pack is exact; it interleaves the
  // 128-bit halves, which vpermq puts back in order.
  for (; i + 16 <= n; i += 16) {
    const __m256i low = bfloat16_lanes_avx2(_mm256_loadu_ps(src + i));
    const __m256i high = bfloat16_lanes_avx2(_mm256_loadu_ps(src + i + 8));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + i), packed);
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) bits[j] = bfloat16_bits(src[j]);
}

// float16 <-> float: 8 at a time with the F16C instructions when the build
// targets them, or NEON's FCVTL/FCVTN on aarch64 (base ARMv8-A; Eigen's scalar
// conversion uses them only from ARMv8.2-A's FP16 on, and is bit arithmetic
// with branches before that); GCC does not vectorise the scalar conversions,
// which made float16 kernels ~3x slower than bfloat16 ones. Round to nearest
// even, as Eigen's scalar conversion (the tail, and the x86 path without F16C)
// does. Not the 16-wide AVX-512 form: GCC 12 warns of an undefined
// pass-through operand inside its intrinsic in every kernel it is inlined into.
inline void load_row(const float16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
  }
#elif defined(__aarch64__)
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (; i + 8 <= n; i += 8) {
    const float16x8_t half = vreinterpretq_f16_u16(vld1q_u16(bits + i));
    vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(half)));
    vst1q_f32(dst + i + 4, vcvt_high_f32_f16(half));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void store_row(const float* src, float16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i half =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), half);
  }
#elif defined(__aarch64__)
  // FCVTN rounds as FPCR says: to nearest even, Linux's default.
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (; i + 8 <= n; i += 8) {
    const float16x8_t half =
        vcvt_high_f16_f32(vcvt_f16_f32(vld1q_f32(src + i)), vld1q_f32(src + i + 4));
    vst1q_u16(bits + i, vreinterpretq_u16_f16(half));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float16>(src[i]);
}

}  // namespace jaxops::cpu
