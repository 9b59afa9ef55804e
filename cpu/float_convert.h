// Conversions between the storage types of jaxops tensors (float, bfloat16,
// float16) and the float32 the kernels compute in. Rows are converted into a
// float buffer once so that every later pass over the row runs on contiguous
// float32 and vectorises.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <cstring>

namespace jaxops::cpu {

using bfloat16 = Eigen::bfloat16;
using float16 = Eigen::half;

inline float to_float(float v) { return v; }
inline float to_float(bfloat16 v) { return static_cast<float>(v); }
inline float to_float(float16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

// bfloat16 <-> float written with integer ops the compiler vectorises (Eigen's
// scalar conversion has a NaN branch that blocks it). Round to nearest even;
// NaN stays a quiet NaN.
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

inline void load_row(const float16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void store_row(const float* src, float16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float16>(src[i]);
}

inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}

inline void store_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}

}  // namespace jaxops::cpu
