// The 2:4 sparse linear layer's GEMV for 1 or 2 rows of x on AVX2 (the avx2
// variant; cpu/sparse.cc takes it there, and its row-lane GEMV from 3 rows
// on). Bound by reading the packed weight (in / 2 values and in / 8 metadata
// bytes per output), which it streams once, output after output.
//
// A vector step is 8 kept values: 4 groups, 16 input columns (two vectors of
// x), 2 metadata bytes. The metadata word is broadcast and shifted per lane
// (vpsrlvd) to the 2-bit positions, plus each lane's group start: the
// columns, 0..15, relative to the step's first. Lanes 0-3 (groups 0 and 1)
// take x from columns 0..7, lanes 4-7 from 8..15; vpermps reads the low 3
// bits of each index, so one permute of each x vector and a blend put the
// kept columns of x under the values: 3 shuffles and one FMA per 8 values and
// row of x, against a gather (vgatherdps) that costs more than those on Zen
// and Intel cores alike. The values are converted in registers (bfloat16: a
// 16-bit shift, float16: vcvtph2ps).
//
// Numerics: float32 products and accumulation (4 or 2 partial sums of 8
// lanes per row of x, added at the end of the row).
#pragma once

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/float_convert.h"
#include "params/sparse.h"

namespace jaxops::cpu::sparse_avx2 {

using ::jaxops::params::sparse_column;
using ::jaxops::params::sparse_metadata_cols;
using ::jaxops::params::sparse_values_cols;
using ::jaxops::params::SparseLinearShape;

// Kept values per vector step.
inline constexpr int64_t kStep = 8;

// The columns of values k .. k + 7 of a packed row (k a multiple of 8)
// relative to their first group's first column, 4 * (k / 2): 0..15.
inline __m256i step_columns(const uint8_t* meta_row, int64_t k) {
  uint16_t word;
  std::memcpy(&word, meta_row + k / 4, sizeof(word));
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i group_starts = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
  const __m256i positions = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(3));
  return _mm256_add_epi32(positions, group_starts);
}

// x at the step's kept columns (x at the step's first column).
inline __m256 kept_columns(const float* x, __m256i columns) {
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x), columns);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 8), columns);
  return _mm256_blend_ps(lo, hi, 0xF0);
}

// 8 values as float32.
inline __m256 load_values(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_values(const bfloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load_values(const float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sums[r] = the products of one packed row's first steps * 8 values (v, its
// metadata meta) with rows r < R of x (row stride ldx). kChains partial sums
// per row keep kChains * R FMA chains apart (4-cycle FMAs, two pipes).
template <int R, typename T>
inline void packed_row_dot(const float* x, int64_t ldx, const T* v, const uint8_t* meta,
                           int64_t steps, float* sums) {
  constexpr int kChains = R == 1 ? 4 : 2;
  __m256 acc[kChains][R];
#pragma GCC unroll 4
  for (int u = 0; u < kChains; ++u) {
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) acc[u][r] = _mm256_setzero_ps();
  }
  int64_t step = 0;
  for (; step + kChains <= steps; step += kChains) {
#pragma GCC unroll 4
    for (int u = 0; u < kChains; ++u) {
      const int64_t k = (step + u) * kStep;
      const __m256i columns = step_columns(meta, k);
      const __m256 values = load_values(v + k);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        acc[u][r] = _mm256_fmadd_ps(values, kept_columns(x + r * ldx + 2 * k, columns), acc[u][r]);
      }
    }
  }
  for (; step < steps; ++step) {
    const int64_t k = step * kStep;
    const __m256i columns = step_columns(meta, k);
    const __m256 values = load_values(v + k);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm256_fmadd_ps(values, kept_columns(x + r * ldx + 2 * k, columns), acc[0][r]);
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    __m256 total = acc[0][r];
#pragma GCC unroll 4
    for (int u = 1; u < kChains; ++u) total = _mm256_add_ps(total, acc[u][r]);
    sums[r] = sum_lanes(total);
  }
}

// y = x W^T + bias for x (float32) of 1 or 2 rows; each thread streams a
// contiguous range of packed rows (static schedule), which the hardware
// prefetchers follow.
template <typename T>
void sparse_gemv(const float* xf, const T* values, const uint8_t* metadata, const T* bias, T* y,
                 SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t steps = half / kStep;
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < s.out; ++o) {
    const T* v = values + o * half;
    const uint8_t* meta = metadata + o * mcols;
    float sums[2];
    if (s.rows == 1) {
      packed_row_dot<1>(xf, s.in, v, meta, steps, sums);
    } else {
      packed_row_dot<2>(xf, s.in, v, meta, steps, sums);
    }
    const float b = bias ? to_float(bias[o]) : 0.f;
    for (int64_t r = 0; r < s.rows; ++r) {
      float sum = sums[r];
      // The values past the last whole step (in not a multiple of 16).
      for (int64_t k = steps * kStep; k < half; ++k) {
        sum += to_float(v[k]) * xf[r * s.in + sparse_column(meta, k)];
      }
      y[r * s.out + o] = from_float<T>(sum + b);
    }
  }
}

}  // namespace jaxops::cpu::sparse_avx2

#endif
