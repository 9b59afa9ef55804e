// bfloat16 dot-product micro-kernels (AVX512_BF16's vdpbf16ps: 32 products
// per instruction, twice the float32 FMA rate), for the bfloat16 attention
// forward on CPUs that have them, with the packing of their operands.
// Compiled with a target attribute and chosen at run time (cpu_has_bf16_dot),
// so that the avx512 variant (x86-64-v4, which does not include BF16) still
// runs on AVX-512 CPUs without them; the other variants have no such path
// (JAXOPS_BF16_DOT undefined). Operands are pairs of bf16 packed in a 32-bit
// word along the reduction axis; accumulation stays float32.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/gemm_microkernels.h"

namespace jaxops::cpu::microkernels {

#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define JAXOPS_BF16_DOT 1
#define JAXOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

inline bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// C[m, 16 NV] (=, += or scaled +) sum over pairs p of A(m, p) . B(p, :), with
// A(r, p) = a[r * a_rs + p * a_cs] a pair broadcast to every lane and B's rows
// of 16 pairs at b + p * ldb (all in 32-bit words).
template <int MR, int NV, Update U>
JAXOPS_BF16_TARGET inline void dot_block(int64_t pairs, const uint32_t* a, int64_t a_rs,
                                         int64_t a_cs, const uint32_t* b, int64_t ldb, float* c,
                                         int64_t ldc, const float* colscale) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (U == Update::kOverwrite) {
        acc[r][v] = _mm512_setzero_ps();
      } else if constexpr (U == Update::kAdd) {
        acc[r][v] = _mm512_loadu_ps(c + r * ldc + v * 16);
      } else {
        acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(c + r * ldc + v * 16),
                                  _mm512_loadu_ps(colscale + v * 16));
      }
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + v * 16);
    const uint32_t* ap = a + p * a_cs;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r * a_rs]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
  }
}

template <int NV, Update U>
JAXOPS_BF16_TARGET inline void dot_strip(int64_t m, int64_t pairs, const uint32_t* a, int64_t a_rs,
                                  int64_t a_cs, const uint32_t* b, int64_t ldb, float* c,
                                  int64_t ldc, const float* colscale) {
  for_each_row_block<rows_per_block<NV>()>(m, [&](auto rows, int64_t i) {
    dot_block<decltype(rows)::value, NV, U>(pairs, a + i * a_rs, a_rs, a_cs, b, ldb,
                                            c + i * ldc, ldc, colscale);
  });
}

// n (a multiple of 16) columns in strips of up to 4 vectors.
template <Update U>
JAXOPS_BF16_TARGET inline void dot_gemm(int64_t m, int64_t n, int64_t pairs, const uint32_t* a,
                                 int64_t a_rs, int64_t a_cs, const uint32_t* b, int64_t ldb,
                                 float* c, int64_t ldc, const float* colscale = nullptr) {
  for (int64_t j = 0; j < n;) {
    const int64_t vecs = std::min<int64_t>(4, (n - j) / 16);
    const float* cs = colscale ? colscale + j : nullptr;
    switch (vecs) {
      case 4: dot_strip<4, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
      case 3: dot_strip<3, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
      case 2: dot_strip<2, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
      default: dot_strip<1, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
    }
    j += vecs * 16;
  }
}

// Rows j0 .. j0 + jn of one kv head's values as pairs along the keys:
// out[jp * H + h] = (v[2 jp][h], v[2 jp + 1][h]); an odd last row pairs with 0.
JAXOPS_BF16_TARGET inline void pack_value_pairs(const uint16_t* v, int64_t ld, int64_t jn, int64_t H,
                                         uint32_t* out) {
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t jp = 0; jp < (jn + 1) / 2; ++jp) {
    const uint16_t* r0 = v + 2 * jp * ld;
    const uint16_t* r1 = 2 * jp + 1 < jn ? r0 + ld : nullptr;
    uint32_t* dst = out + jp * H;
    int64_t h = 0;
    for (; h + 32 <= H; h += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + h);
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + h) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + h, _mm512_permutex2var_epi16(a, first, b));
      _mm512_storeu_si512(dst + h + 16, _mm512_permutex2var_epi16(a, second, b));
    }
    for (; h < H; ++h) dst[h] = r0[h] | (r1 ? static_cast<uint32_t>(r1[h]) << 16 : 0u);
  }
}

// Probabilities st[j][i] (float, jn rows of width Br) rounded to bf16 and
// paired along the keys: out[jp * Br + i] = (P[2 jp][i], P[2 jp + 1][i]).
JAXOPS_BF16_TARGET inline void pack_probability_pairs(const float* st, int64_t jn, int64_t Br,
                                               uint32_t* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                              25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                              18, 2, 17, 1, 16, 0);
  for (int64_t jp = 0; jp < (jn + 1) / 2; ++jp) {
    const float* r0 = st + 2 * jp * Br;
    const bool has_second = 2 * jp + 1 < jn;
    for (int64_t i = 0; i < Br; i += 16) {
      const __m512 a = _mm512_loadu_ps(r0 + i);
      const __m512 b = has_second ? _mm512_loadu_ps(r0 + Br + i) : _mm512_setzero_ps();
      // cvtne2ps(x, y) puts y's 16 values in the low half, x's in the high half.
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_storeu_si512(out + jp * Br + i, _mm512_permutexvar_epi16(interleave, packed));
    }
  }
}
#endif

}  // namespace jaxops::cpu::microkernels
