// The decode core's few-rows kernels (cpu/kv_decode_few_rows.h) for AVX2 and
// FMA (the avx2 variant, x86-64-v3): the same passes, operands and results as
// the AVX-512 kernels there, laid out for 8-lane vectors, 16 YMM registers and
// the two FMA pipes of the AVX2 cores (Zen 2/3, Haswell to the client cores
// of today), not the AVX-512 code at half width.
//
// - Rows in 8-element chunks converted in registers: float32 as they lie,
//   bfloat16 by a 16-bit shift (vpmovzxwd + vpslld), float16 by vcvtph2ps
//   (F16C is part of x86-64-v3), int8 by vpmovsxbd + vcvtdq2ps with the
//   row's scale applied to the score and to the probability, as with
//   AVX-512.
// - Scores: R rows x kScoreKeys<R> keys = 8 accumulators (R = 3: 6), eight
//   independent FMA chains, which is what two pipes of 4-cycle FMAs need; with
//   the R query chunks and one key chunk they fit the 16 registers (R = 8:
//   8 + 8 + 1 = 17, so with one key per group the query chunks are read by
//   the FMAs from L1, each used once anyway). The 8 sums of a group are
//   transposed into one vector by a tree of vhaddps (sum_each, cpu/kv_decode_few_rows.h): once
//   per group of 8 accumulators and head_dim, not per (row, key).
// - Values: the output rows of kValueChunksAvx2<R> head-dim chunks stay in
//   registers over a slice of keys, beside the R broadcast probabilities and
//   one value chunk (R * C + R + 1 <= 16).
// - The next tile's rows are asked for a cache line at a time between the
//   products (the passes' prefetches of cpu/kv_decode_few_rows.h).
//
// Numerics: float32 products and accumulation, as the general path; the
// order of the sums differs from the AVX-512 kernels' (8 lanes, not 16).
//
// Included by cpu/kv_decode_few_rows.h (which defines TileRows and the
// prefetch helpers) in an AVX2 build only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace jaxops::cpu::kv_decode {

// 8 elements of a cache row as float (int8: unscaled).
inline __m256 load_chunk(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_chunk(const bfloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load_chunk(const float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_chunk(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Keys per score group: R rows x kScoreKeys keys fill at most 8 accumulators.
template <int R>
inline constexpr int kScoreKeys = 8 / R;

// The float32 kernels' operands: rows in 8-element chunks converted to
// float, float queries, FMAs. (The fixed-point kind of
// cpu/kv_decode_pairs_avx2.h has the same members.)
template <typename E>
struct FloatLanes {
  using Element = E;
  using Query = float;
  using Sum = __m256;
  static constexpr int kChunk = 8;
  static Sum zero() { return _mm256_setzero_ps(); }
  static __m256 query(const float* q) { return _mm256_loadu_ps(q); }
  static __m256 chunk(const E* p) { return load_chunk(p); }
  static Sum dot(Sum acc, __m256 q, __m256 k) { return _mm256_fmadd_ps(k, q, acc); }
  static __m256 sum_each(const Sum* acc) { return sum_each_avx2(acc); }
};

// scores[r * ld + j] = q_r . k_j for the tile's keys j, in Kind's operands (q:
// R rows of H at stride ldq, times q_scale[r] where q_scale is given; int8
// rows: times the key's scale); asks for the next tile's key rows.
template <int R, typename Kind>
void score_groups(const TileRows<typename Kind::Element>& tile, const typename Kind::Query* q,
                  int64_t ldq, int64_t H, const float* q_scale, float* scores, int64_t ld,
                  const TileRows<typename Kind::Element>& next) {
  using Element = typename Kind::Element;
  constexpr int kKeys = kScoreKeys<R>;
  const int64_t jn = tile.n;
  for (int64_t j = 0; j < jn; j += kKeys) {
    const Element* rows[kKeys];
    const char* later[kKeys];
#pragma GCC unroll 8
    for (int kk = 0; kk < kKeys; ++kk) {
      // Keys past the tile repeat its last one (their sums are not stored).
      rows[kk] = tile.k[std::min<int64_t>(j + kk, jn - 1)];
      later[kk] = next.key_or_null(j + kk);
    }
    // acc[r * kKeys + kk]; the lanes past R * kKeys (R = 3, 5, 6, 7) stay 0.
    typename Kind::Sum acc[8];
#pragma GCC unroll 8
    for (int a = 0; a < 8; ++a) acc[a] = Kind::zero();
    for (int64_t h = 0; h < H; h += Kind::kChunk) {
      // One line of each later row per 64 bytes of this chunk's rows.
      if ((h * static_cast<int64_t>(sizeof(Element))) % 64 == 0) {
#pragma GCC unroll 8
        for (int kk = 0; kk < kKeys; ++kk) {
          if (later[kk]) simd::prefetch<1>(later[kk] + h * sizeof(Element));
        }
      }
      decltype(Kind::query(q)) qv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) qv[r] = Kind::query(q + r * ldq + h);
#pragma GCC unroll 8
      for (int kk = 0; kk < kKeys; ++kk) {
        const auto kv = Kind::chunk(rows[kk] + h);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r * kKeys + kk] = Kind::dot(acc[r * kKeys + kk], qv[r], kv);
        }
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, Kind::sum_each(acc));
    const int keys = static_cast<int>(std::min<int64_t>(kKeys, jn - j));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float row_scale = q_scale ? q_scale[r] : 1.0f;
      for (int kk = 0; kk < keys; ++kk) {
        float s = sums[r * kKeys + kk] * row_scale;
        if constexpr (std::is_same_v<Element, int8_t>) s *= tile.k_scale[j + kk];
        scores[r * ld + j + kk] = s;
      }
    }
  }
}

// The float32 kernels' scores pass (the driver's name for it on every ISA).
template <int R, typename Element>
void few_rows_scores(const TileRows<Element>& tile, const float* q, int64_t ldq, int64_t H,
                     float* scores, int64_t ld, const TileRows<Element>& next) {
  score_groups<R, FloatLanes<Element>>(tile, q, ldq, H, nullptr, scores, ld, next);
}

// Head-dim chunks whose R output rows stay in registers during the values
// pass: R * C accumulators, R probability broadcasts and a value chunk in the
// 16 registers (R = 1: 8, 2: 6, 3: 4, 4 and 5: 2, more: 1).
template <int R>
inline constexpr int kValueChunksAvx2 = std::max(1, std::min(8, (15 - R) / R));

// o[r * ldo + h] += sum_j p[r * ld + j] * v_j[h] over the tile's keys j (p:
// probabilities; for int8 rows the value scale is folded into them here, in
// place); asks for the next tile's value rows.
template <int R, typename Element>
void few_rows_values(const TileRows<Element>& tile, float* p, int64_t ld, int64_t H, float* o,
                     int64_t ldo, const TileRows<Element>& next) {
  const int64_t jn = tile.n;
  constexpr int kChunks = kValueChunksAvx2<R>;
  if constexpr (std::is_same_v<Element, int8_t>) {
    for (int64_t j = 0; j < jn; ++j) {
      const float scale = tile.v_scale[j];
      for (int r = 0; r < R; ++r) p[r * ld + j] *= scale;
    }
  }
  // The head dim in blocks of at most kChunks chunks, as even as they come.
  const int64_t total = H / 8, blocks = (total + kChunks - 1) / kChunks;
  const int64_t per_block = (total + blocks - 1) / blocks;
  // Keys in slices of kValueKeys, the head-dim blocks within a slice: the
  // slice's rows stay in L1 while every block reads them (as with AVX-512).
  constexpr int64_t kValueKeys = 8;
  for (int64_t s0 = 0; s0 < jn; s0 += kValueKeys) {
    const int64_t s_end = std::min(jn, s0 + kValueKeys);
    for (int64_t h0 = 0; h0 < H; h0 += 8 * per_block) {
      const int chunks = static_cast<int>(std::min<int64_t>(per_block, (H - h0) / 8));
      __m256 acc[R][kChunks];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          acc[r][c] = c < chunks ? _mm256_loadu_ps(o + r * ldo + h0 + 8 * c) : _mm256_setzero_ps();
        }
      }
      for (int64_t j = s0; j < s_end; ++j) {
        const Element* row = tile.v[j] + h0;
        const char* later = next.value_or_null(j);
        if (later) later += h0 * sizeof(Element);
        __m256 pv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pv[r] = _mm256_broadcast_ss(p + r * ld + j);
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) {
            if (later && ((h0 + 8 * c) * sizeof(Element)) % 64 == 0) {
              simd::prefetch<1>(later + 8 * c * sizeof(Element));
            }
            const __m256 v = load_chunk(row + 8 * c);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(pv[r], v, acc[r][c]);
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) _mm256_storeu_ps(o + r * ldo + h0 + 8 * c, acc[r][c]);
        }
      }
    }
  }
}

}  // namespace jaxops::cpu::kv_decode
