// The decode core's few-rows kernels on pair-product instructions, which
// multiply 16-bit operands in pairs and add both products to a 32-bit lane:
// - int8 caches on AVX512_VNNI's vpdpwssd (FixedPointInt8): integer products
//   of the cache's elements (exact in 16 bits) with the queries and
//   probabilities rounded to 16-bit fixed point, int32 sums;
// - bfloat16 caches on AVX512_BF16's vdpbf16ps (Bfloat16Pairs): the
//   elements as they lie, the queries and probabilities rounded to bfloat16
//   (the bfloat16 dot path's numerics, cpu/kv_decode.h), float32 sums;
// - in the avx2 variant, int8 caches on vpmaddwd + vpaddd (the same
//   FixedPointInt8 operands and exact sums, cpu/kv_decode_pairs_avx2.h).
// For 1 to kMaxFewRows query rows (one token of a GQA group: the common
// decode step) and a head_dim of whole 32-element chunks; decode_keys_few_rows
// (cpu/kv_decode.h) takes them in place of the float32 kernels of
// cpu/kv_decode_few_rows.h when the CPU has the instruction.
//
// Why: those float32 kernels convert every element (int8: a sign extension
// and a vcvtdq2ps) and spend a 16-lane FMA per 16 products, and int8 decode
// was bound by that arithmetic, not by the memory: ~90 cycles a key for 4
// rows of head_dim 128 with the rows in cache (Emerald Rapids); ~56 here. The
// bfloat16 dot path before these kernels took a dot product per row and key,
// then wrote each tile's values as key pairs (vpermt2w, 3 uops a vector) to a
// buffer that a GEMM read back; here a value chunk is paired with the next
// key's in registers (vpunpck{l,h}wd, one uop each) and used at once.
// With these kernels int8 decode keeps pace with pages in L3 (15.4 GB/s, two
// cores) but not with DRAM (9.8): the reads' overlap with the arithmetic, not
// the arithmetic, is its limit now (docs/benchmarks-log.md, ninth pass, which
// also has the AMX form of the scores that was tried and was slower).
//
// Shapes of the products (R rows, H = head_dim):
// - scores: score_groups (cpu/kv_decode_few_rows.h) on these operands: each
//   key chunk of 32 elements, once in a register, serves every row;
//   kScoreKeys<R> keys x R rows = 16 accumulators, summed across their lanes
//   together (transposed_sums);
// - values: keys 2m and 2m + 1 of a chunk interleaved (vpunpck{l,h}wd within
//   128-bit lanes) against each row's probability pair broadcast; the
//   accumulators of a block of chunks stay in registers over the whole tile
//   and are put back in element order (vpermt2d/ps) once per tile.
//
// FixedPointInt8 numerics: each query row is rounded to q16 = round(q *
// 32767 / max|q|), its scale max|q| / 32767 applied to the integer sum with
// the key's scale; each row's probabilities times the value scales, p' = p *
// s_v(j), are rounded per tile to round(p' * 32767 / max|p'|) and the tile's
// integer sums added to the float32 output times max|p'| / 32767. Every
// rounding is at most 2^-16 of the row's (or the tile's) largest element,
// finer than bfloat16's 2^-9 of each element, and the sums are exact: |q16|
// <= 32767 and |k| <= 128 make a product < 2^22, a score sums head_dim <=
// kPairMaxHeadDim = 256 of them (< 2^30), a tile's value sum 32 (< 2^27), so
// vpdpwssd (which wraps) never overflows. A query row with a NaN or infinity
// gets a NaN scale (the row is NaN, as on the float path); a tile whose scaled
// probabilities are not finite (a NaN or infinite value scale) takes the
// float32 kernel.
//
// The two instructions are written as inline assembly, so that these
// templates serve both kinds without a target attribute: one naming both
// extensions would let the compiler use either in either kernel, and CPUs
// with VNNI but no BF16 (Ice Lake, Cascade Lake) exist. The callers check the
// CPU first (pair_kernels_fit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu/gemm_bf16_microkernels.h"
#include "cpu/kv_decode_few_rows.h"

namespace jaxops::cpu::kv_decode {

// The int8 kernels on AVX-512 (vpdpwssd) and AVX2 (vpmaddwd + vpaddd,
// cpu/kv_decode_pairs_avx2.h: the same operands and sums); the bfloat16 ones
// on AVX-512 only (AVX2 has no bfloat16 product).
#if defined(JAXOPS_FEW_ROWS_DECODE) && defined(__x86_64__) && \
    (defined(__GNUC__) || defined(__clang__))
#define JAXOPS_PAIR_KERNELS 1

// The longest head_dim whose int8 score sums stay in int32 (the bounds above).
inline constexpr int64_t kPairMaxHeadDim = 256;
// The fixed-point unit: the largest magnitude a rounded operand takes.
inline constexpr float kFixedOne = 32767.0f;

// Rows of R float queries (stride ldq) into 16-bit fixed point: q16[r * H + h]
// and the scale of row r (NaN for a row with a NaN or infinity, 0 for zeros).
inline void quantize_query_rows(const float* q, int64_t ldq, int64_t R, int64_t H, int16_t* q16,
                                float* scale) {
  for (int64_t r = 0; r < R; ++r) {
    const float* row = q + r * ldq;
    float largest = 0.0f;
    bool finite = true;
    for (int64_t h = 0; h < H; ++h) {
      finite = finite && std::isfinite(row[h]);
      largest = std::max(largest, std::fabs(row[h]));
    }
    int16_t* out = q16 + r * H;
    if (!finite || largest == 0.0f) {
      std::fill(out, out + H, int16_t{0});
      scale[r] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float to_fixed = kFixedOne / largest;
    for (int64_t h = 0; h < H; ++h) {
      const float x = std::nearbyint(row[h] * to_fixed);
      out[h] = static_cast<int16_t>(std::clamp(x, -kFixedOne, kFixedOne));
    }
    scale[r] = largest / kFixedOne;
  }
}

#if defined(__AVX512F__)
#define JAXOPS_BF16_PAIR_KERNELS 1

inline bool cpu_has_int8_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}

// acc + the pairwise products of a and b's 16-bit lanes: vpdpwssd (signed
// integers, int32 lanes) and vdpbf16ps (bfloat16, float32 lanes).
inline __m512i pair_products(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
inline __m512 pair_products(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// 16 floats rounded to bfloat16, to nearest even (vcvtneps2bf16).
inline __m256i round_to_bfloat16(__m512 x) {
  __m256i out;
  asm("vcvtneps2bf16 %1, %0" : "=v"(out) : "v"(x));
  return out;
}

// int8 rows against 16-bit fixed-point queries and probabilities.
struct FixedPointInt8 {
  using Element = int8_t;
  using Query = uint16_t;  // int16 fixed point
  using Sum = __m512i;
  static constexpr int kChunk = 32;
  static Sum zero() { return _mm512_setzero_si512(); }
  static __m512i query(const uint16_t* q) { return _mm512_loadu_si512(q); }
  static Sum dot(Sum acc, __m512i q, __m512i k) { return pair_products(acc, q, k); }
  // 32 elements as 16-bit lanes.
  static __m512i chunk(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 to_float(Sum s) { return _mm512_cvtepi32_ps(s); }
  static Sum permute(Sum a, __m512i index, Sum b) { return _mm512_permutex2var_epi32(a, index, b); }
  // Lane c: the exact sum of acc[c]'s lanes, as float.
  static __m512 sum_each(const Sum* acc) {
    return _mm512_cvtepi32_ps(_mm512_castps_si512(
        transposed_sums(reinterpret_cast<const __m512*>(acc), [](__m512 a, __m512 b) {
          return _mm512_castsi512_ps(
              _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
        })));
  }
};

// bfloat16 rows against bfloat16 queries and probabilities.
struct Bfloat16Pairs {
  using Element = bfloat16;
  using Query = uint16_t;  // bfloat16 bits
  using Sum = __m512;
  static constexpr int kChunk = 32;
  static Sum zero() { return _mm512_setzero_ps(); }
  static __m512i query(const uint16_t* q) { return _mm512_loadu_si512(q); }
  static Sum dot(Sum acc, __m512i q, __m512i k) { return pair_products(acc, q, k); }
  static __m512i chunk(const bfloat16* p) { return _mm512_loadu_si512(p); }
  static __m512 to_float(Sum s) { return s; }
  static Sum permute(Sum a, __m512i index, Sum b) { return _mm512_permutex2var_ps(a, index, b); }
  static __m512 sum_each(const Sum* acc) { return kv_decode::sum_each(acc); }
};

// Whether the pair kernels of Kind cover this shape on this CPU.
template <typename Kind>
inline bool pair_kernels_fit(int64_t rows, int64_t head_dim) {
  if (!few_rows_fit(rows, head_dim) || head_dim % 32 != 0) return false;
  if constexpr (std::is_same_v<Kind, FixedPointInt8>) {
    return head_dim <= kPairMaxHeadDim && cpu_has_int8_vnni();
  } else {
    return microkernels::cpu_has_bf16_dot();
  }
}

// The keys of half c (keys 16c .. 16c + 15) of a tile of jn keys that exist.
inline __mmask16 tile_half_keys(int64_t jn, int c) {
  const int64_t left = std::clamp<int64_t>(jn - 16 * c, 0, 16);
  return static_cast<__mmask16>((1u << left) - 1u);
}

// A tile's probabilities as 16-bit operands: p_pairs[r][m] holds keys 2m (low
// half) and 2m + 1 of row r (0 past the tile), unit[r] what one step of them
// is worth. Returns false where the float32 kernel must take the tile.
//
// int8: the value scales folded in, rounded to fixed point per row.
inline bool probability_pairs(const TileRows<int8_t>& tile, const float* p, int64_t ld, int R,
                              int32_t (*p_pairs)[kDecodeKeyTile / 2], float* unit) {
  static_assert(kDecodeKeyTile == 32, "a tile's probabilities are two vectors");
  const int64_t jn = tile.n;
  const __mmask16 keys[2] = {tile_half_keys(jn, 0), tile_half_keys(jn, 1)};
  const __m512 v_scale[2] = {_mm512_maskz_loadu_ps(keys[0], tile.v_scale),
                             _mm512_maskz_loadu_ps(keys[1], tile.v_scale + 16)};
  for (int r = 0; r < R; ++r) {
    __m512 x[2];
    __m512 largest = _mm512_setzero_ps();
    for (int c = 0; c < 2; ++c) {
      x[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(keys[c], p + r * ld + 16 * c), v_scale[c]);
      const __m512 magnitude = _mm512_abs_ps(x[c]);
      // A NaN compares false: not finite.
      if (_mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(std::numeric_limits<float>::max()),
                             _CMP_LE_OQ) != 0xFFFF) {
        return false;
      }
      largest = _mm512_max_ps(largest, magnitude);
    }
    const float row_largest = _mm512_reduce_max_ps(largest);
    const __m512 to_fixed = _mm512_set1_ps(row_largest > 0.0f ? kFixedOne / row_largest : 0.0f);
    unit[r] = row_largest / kFixedOne;
    // Round to nearest even (the default rounding), saturate to 16 bits.
    for (int c = 0; c < 2; ++c) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(&p_pairs[r][8 * c]),
                         _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[c], to_fixed))));
    }
  }
  return true;
}

// bfloat16: rounded to bfloat16 (NaNs stay NaN, as on the float path).
inline bool probability_pairs(const TileRows<bfloat16>& tile, const float* p, int64_t ld, int R,
                              int32_t (*p_pairs)[kDecodeKeyTile / 2], float* unit) {
  const int64_t jn = tile.n;
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 2; ++c) {
      _mm256_store_si256(
          reinterpret_cast<__m256i*>(&p_pairs[r][8 * c]),
          round_to_bfloat16(_mm512_maskz_loadu_ps(tile_half_keys(jn, c), p + r * ld + 16 * c)));
    }
    unit[r] = 1.0f;
  }
  return true;
}

// 32-element chunks of the head dim whose R output rows (two accumulators a
// chunk) stay in registers during the values pass.
template <int R>
inline constexpr int kPairValueChunks = R <= 2 ? 4 : R <= 4 ? 2 : 1;

// o[r * ldo + h] += sum_j p[r * ld + j] * v_j[h] over the tile's keys j (int8:
// times the value scales); asks for the next tile's value rows as it goes.
template <int R, typename Kind>
void pair_values(const TileRows<typename Kind::Element>& tile, float* p, int64_t ld, int64_t H,
                 float* o, int64_t ldo, const TileRows<typename Kind::Element>& next) {
  using Element = typename Kind::Element;
  const int64_t jn = tile.n, pairs = (jn + 1) / 2;
  alignas(64) int32_t p_pairs[R][kDecodeKeyTile / 2];
  float unit[R];
  if (!probability_pairs(tile, p, ld, R, p_pairs, unit)) {
    return few_rows_values<R>(tile, p, ld, H, o, ldo, next);
  }
  // vpunpck{l,h}wd interleave within 128-bit lanes: the low halves' sums hold,
  // per lane group g, elements 8g .. 8g + 3 of a chunk, the high halves'
  // 8g + 4 .. 8g + 7. These put the chunk's 32 elements back in order.
  const __m512i first_half =
      _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second_half =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  constexpr int kChunks = kPairValueChunks<R>;
  constexpr int64_t kChunkBytes = 32 * sizeof(Element);
  for (int64_t h0 = 0; h0 < H; h0 += 32 * kChunks) {
    const int chunks = static_cast<int>(std::min<int64_t>(kChunks, (H - h0) / 32));
    typename Kind::Sum acc[R][2 * kChunks];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < 2 * kChunks; ++c) acc[r][c] = Kind::zero();
    }
    for (int64_t m = 0; m < pairs; ++m) {
      const Element* row0 = tile.v[2 * m] + h0;
      // An odd tile's last key pairs with zeros.
      const bool odd_end = 2 * m + 1 >= jn;
      const Element* row1 = tile.v[odd_end ? 2 * m : 2 * m + 1] + h0;
      // The later rows' lines under this block, one per 64 bytes.
      for (int64_t t = 0; t < 2; ++t) {
        const char* later = next.value_or_null(2 * m + t);
        if (!later) continue;
        later += h0 * static_cast<int64_t>(sizeof(Element));
        for (int64_t b = 0; b < chunks * kChunkBytes; b += 64) simd::prefetch<1>(later + b);
      }
      __m512i pv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) pv[r] = _mm512_set1_epi32(p_pairs[r][m]);
#pragma GCC unroll 4
      for (int c = 0; c < kChunks; ++c) {
        if (c < chunks) {
          // (A bfloat16 row may hold infinities: 0 times one is NaN.)
          const __m512i a = Kind::chunk(row0 + 32 * c);
          const __m512i b = odd_end ? _mm512_setzero_si512() : Kind::chunk(row1 + 32 * c);
          const __m512i low = _mm512_unpacklo_epi16(a, b), high = _mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc[r][2 * c] = pair_products(acc[r][2 * c], low, pv[r]);
            acc[r][2 * c + 1] = pair_products(acc[r][2 * c + 1], high, pv[r]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 u = _mm512_set1_ps(unit[r]);
#pragma GCC unroll 4
      for (int c = 0; c < kChunks; ++c) {
        if (c < chunks) {
          float* out = o + r * ldo + h0 + 32 * c;
          const auto lo = acc[r][2 * c], hi = acc[r][2 * c + 1];
          const __m512 x0 = Kind::to_float(Kind::permute(lo, first_half, hi));
          const __m512 x1 = Kind::to_float(Kind::permute(lo, second_half, hi));
          _mm512_storeu_ps(out, _mm512_fmadd_ps(x0, u, _mm512_loadu_ps(out)));
          _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(x1, u, _mm512_loadu_ps(out + 16)));
        }
      }
    }
  }
}

#endif  // __AVX512F__

#endif  // JAXOPS_PAIR_KERNELS

}  // namespace jaxops::cpu::kv_decode

#if defined(JAXOPS_PAIR_KERNELS) && !defined(__AVX512F__)
#include "cpu/kv_decode_pairs_avx2.h"
#endif
