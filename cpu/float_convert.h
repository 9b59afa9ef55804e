// Conversions between the storage types of jaxops tensors (float, bfloat16,
// float16) and the float32 the kernels compute in: the one conversion layer of
// cpu/ (cpu/row_buffer.h builds the kernels' row buffers on it). Rows are
// converted into a float buffer once so that every later pass over the row
// runs on contiguous float32 and vectorises.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
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
inline void store_row(const float* src, bfloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &src[i], sizeof(u));
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    bits[i] = static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
  }
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
