// The decode core's int8 kernels in 16-bit fixed point for AVX2 (the avx2
// variant, x86-64-v3): the operands, roundings and exact int32 sums of
// FixedPointInt8 in cpu/kv_decode_pairs.h (that file's numerics section holds
// here word for word), on vpmaddwd + vpaddd in place of AVX512_VNNI's
// vpdpwssd.
//
// Why: the float32 few-rows kernels (cpu/kv_decode_few_rows_avx2.h) spend,
// per 8 int8 elements, a sign extension (vpmovsxbd) and a vcvtdq2ps, then an
// FMA per row, all but the extension on the two FMA ports. Here 16 elements
// take one vpmovsxbw and each row a vpmaddwd (FMA ports) and a vpaddd (any
// vector port): for 4 rows 8 FMA-port uops per 16 elements of a key, where the
// float kernels took 20. Measured (paged int8, 32/8 heads, hd 128, S = 4096,
// 2 threads, alternated runs against the float32 kernels): B = 8 13.6-14.4
// -> 10.5-11.8 ms, B = 1 1.80-1.83 -> 1.44-1.53 ms.
//
// - Scores: score_groups (cpu/kv_decode_few_rows_avx2.h) on FixedPointInt8's
//   operands: 16-element key chunks sign-extended to 16 bits against the rows'
//   fixed-point queries, kScoreKeys<R> keys x R rows = 8 int32 accumulators,
//   summed across their lanes together by the vphaddd tree.
// - Values: keys 2m and 2m + 1 interleaved byte by byte (vpunpcklbw of 8
//   elements of each) and sign-extended (vpmovsxbw), so that int32 lane h of
//   the vpmaddwd against the broadcast probability pair is element h of both
//   keys' weighted sum: the accumulators are in element order, with no
//   permute at the end (the AVX-512 kernels' vpunpck{l,h}wd need one).
//
// Included by cpu/kv_decode_pairs.h in an AVX2 build only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace jaxops::cpu::kv_decode {

// int8 rows against 16-bit fixed-point queries and probabilities.
struct FixedPointInt8 {
  using Element = int8_t;
  using Query = uint16_t;  // int16 fixed point
  using Sum = __m256i;
  static constexpr int kChunk = 16;
  static Sum zero() { return _mm256_setzero_si256(); }
  static __m256i query(const uint16_t* q) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  }
  // |q| <= 32767 and |k| <= 128: neither a product nor a pair's sum wraps.
  static Sum dot(Sum acc, __m256i q, __m256i k) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, k));
  }
  // 16 elements as 16-bit lanes.
  static __m256i chunk(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Lane c: the exact sum of acc[c]'s lanes, as float.
  static __m256 sum_each(const Sum* acc) {
    const auto as_int = [](__m256 x) { return _mm256_castps_si256(x); };
    return _mm256_cvtepi32_ps(_mm256_castps_si256(transposed_sums_avx2(
        reinterpret_cast<const __m256*>(acc),
        [&](__m256 a, __m256 b) {
          return _mm256_castsi256_ps(_mm256_hadd_epi32(as_int(a), as_int(b)));
        },
        [&](__m256 a, __m256 b) {
          return _mm256_castsi256_ps(_mm256_add_epi32(as_int(a), as_int(b)));
        })));
  }
};

// Whether the pair kernels of Kind cover this shape: head dims of whole
// 32-element pairs (score chunks are 16 elements here, but the shapes that take
// fixed point are the AVX-512 kernels' on every variant: a program's numerics
// do not depend on which x86 variant runs it), within the exact sums' bound.
template <typename Kind>
inline bool pair_kernels_fit(int64_t rows, int64_t head_dim) {
  static_assert(std::is_same_v<Kind, FixedPointInt8>, "AVX2 has int8 pair kernels only");
  return few_rows_fit(rows, head_dim) && head_dim % 32 == 0 && head_dim <= kPairMaxHeadDim;
}

// A tile's probabilities times the value scales, p' = p * s_v(j), rounded per
// row to 16-bit fixed point: p_pairs[r][m] holds keys 2m (low half) and
// 2m + 1 of row r (0 past the tile), unit[r] what one step of them is worth.
// Returns false (a scaled probability not finite) where the float32 kernel
// must take the tile.
inline bool probability_pairs(const TileRows<int8_t>& tile, const float* p, int64_t ld, int R,
                              int32_t (*p_pairs)[kDecodeKeyTile / 2], float* unit) {
  static_assert(kDecodeKeyTile == 32, "a tile's probabilities are four vectors");
  const int64_t jn = tile.n;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i keys[4];
  __m256 v_scale[4];
  for (int c = 0; c < 4; ++c) {
    // Lanes of keys below jn: all bits set (a masked load reads nothing else).
    keys[c] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(jn - 8 * c)), lane);
    v_scale[c] = _mm256_maskload_ps(tile.v_scale + 8 * c, keys[c]);
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 largest_finite = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int r = 0; r < R; ++r) {
    __m256 x[4];
    __m256 largest = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      x[c] = _mm256_mul_ps(_mm256_maskload_ps(p + r * ld + 8 * c, keys[c]), v_scale[c]);
      const __m256 magnitude = _mm256_and_ps(x[c], abs_mask);
      // A NaN compares false: not finite.
      if (_mm256_movemask_ps(_mm256_cmp_ps(magnitude, largest_finite, _CMP_LE_OQ)) != 0xFF) {
        return false;
      }
      largest = _mm256_max_ps(largest, magnitude);
    }
    // The row's largest magnitude in every lane.
    largest = _mm256_max_ps(largest, _mm256_permute2f128_ps(largest, largest, 0x01));
    largest = _mm256_max_ps(largest, _mm256_shuffle_ps(largest, largest, 0x4E));
    largest = _mm256_max_ps(largest, _mm256_shuffle_ps(largest, largest, 0xB1));
    const float row_largest = _mm256_cvtss_f32(largest);
    const __m256 to_fixed = _mm256_set1_ps(row_largest > 0.0f ? kFixedOne / row_largest : 0.0f);
    unit[r] = row_largest / kFixedOne;
    // Round to nearest even (the default rounding), saturate to 16 bits;
    // vpackssdw packs within 128-bit lanes, vpermq puts the keys in order.
    for (int c = 0; c < 2; ++c) {
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(x[2 * c], to_fixed));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(x[2 * c + 1], to_fixed));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&p_pairs[r][8 * c]),
                         _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
  }
  return true;
}

// 8 elements of value rows a and b as int16 pairs (a[h], b[h]) in int32 lane h.
inline __m256i interleaved_pairs(const int8_t* a, const int8_t* b) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
}

// o[r * ldo + h] += sum_j p[r * ld + j] * s_v(j) * v_j[h] over the tile's
// keys j; asks for the next tile's value rows as it goes.
template <int R, typename Kind>
void pair_values(const TileRows<int8_t>& tile, float* p, int64_t ld, int64_t H, float* o,
                 int64_t ldo, const TileRows<int8_t>& next) {
  static_assert(std::is_same_v<Kind, FixedPointInt8>, "AVX2 has int8 pair kernels only");
  const int64_t jn = tile.n, pairs = (jn + 1) / 2;
  alignas(32) int32_t p_pairs[R][kDecodeKeyTile / 2];
  float unit[R];
  if (!probability_pairs(tile, p, ld, R, p_pairs, unit)) {
    return few_rows_values<R>(tile, p, ld, H, o, ldo, next);
  }
  // 8-element chunks, one int32 accumulator per row and chunk, as many as the
  // float32 kernels keep (R * C + R broadcasts + the operands in 16 registers);
  // the head dim in blocks as even as they come. A block reads the whole
  // tile's rows (32 keys x H bytes, 4 KiB at H = 128: in L1).
  constexpr int kChunks = kValueChunksAvx2<R>;
  const int64_t total = H / 8, blocks = (total + kChunks - 1) / kChunks;
  const int64_t per_block = (total + blocks - 1) / blocks;
  for (int64_t h0 = 0; h0 < H; h0 += 8 * per_block) {
    const int chunks = static_cast<int>(std::min<int64_t>(per_block, (H - h0) / 8));
    __m256i acc[R][kChunks];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm256_setzero_si256();
    }
    for (int64_t m = 0; m < pairs; ++m) {
      const int8_t* row0 = tile.v[2 * m] + h0;
      // An odd tile's last key pairs with itself: its probability there is 0.
      const int8_t* row1 = tile.v[std::min<int64_t>(2 * m + 1, jn - 1)] + h0;
      // The later rows' lines under this block, one per 64 bytes.
      for (int64_t t = 0; t < 2; ++t) {
        const char* later = next.value_or_null(2 * m + t);
        if (!later) continue;
        later += h0;
        for (int64_t b = 0; b < 8 * chunks; b += 64) simd::prefetch<1>(later + b);
      }
      __m256i pv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) pv[r] = _mm256_set1_epi32(p_pairs[r][m]);
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) {
        if (c < chunks) {
          const __m256i v = interleaved_pairs(row0 + 8 * c, row1 + 8 * c);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(v, pv[r]));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 u = _mm256_set1_ps(unit[r]);
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) {
        if (c < chunks) {
          float* out = o + r * ldo + h0 + 8 * c;
          _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), u,
                                                _mm256_loadu_ps(out)));
        }
      }
    }
  }
}

}  // namespace jaxops::cpu::kv_decode
