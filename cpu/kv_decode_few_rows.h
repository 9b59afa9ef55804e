// The decode core's inner kernels for a few query rows (1 to kMaxFewRows: one
// token of a GQA group, the common decode step) of float32, float16 or int8
// cache rows (and bfloat16 where vdpbf16ps is not used), for AVX-512 here and
// for AVX2 in cpu/kv_decode_few_rows_avx2.h (few_rows_fit says which shapes;
// cpu/kv_decode_pairs.h has their pair-product form for int8 and bfloat16 on
// AVX-512); the driver is
// decode_keys_few_rows (cpu/kv_decode.h). They replace the general tile path
// there (a dot product per row and key over rows converted into a float tile,
// then a blocked GEMM for the values) for these shapes.
//
// What they do differently:
// - Rows are converted in registers, a 16-element chunk at a time, and never
//   written to a tile buffer: float32 read as they lie, bfloat16 by a shift,
//   float16 by vcvtph2ps, int8
//   by a sign extension and vcvtdq2ps (its scale applied to the score, and to
//   the probability for the values, not to every element).
// - Scores: each key chunk, once in a register, serves every row, and each
//   query chunk, once loaded, serves 16 / R keys: 16 accumulators, (row, key)
//   pairs, summed across their lanes together (sum_each).
// - Values: the output rows of a block of head-dim chunks stay in registers
//   over a slice of keys; each value chunk is loaded once per key and serves
//   every row.
// - Where a tile's rows lie is looked up once per tile (TileRows), not by
//   every pass (a paged lookup reads the block table and divides).
// - Prefetches of the next tile's rows are spread over the passes' products.
//
// Measured on one core (Zen 4, 3.66 GHz), 4 rows, head_dim 128, cycles per
// key. The two passes over a tile in L1/L2: int8 48 + 40. A whole decode of
// 64 keys per group, the rows in cache, everything included (general path ->
// these kernels): int8 154-156 -> 111-116.
//
// Numerics are the general path's: float32 arithmetic and accumulation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/float_convert.h"
#include "cpu/gemm_bf16_microkernels.h"
#include "cpu/simd.h"

namespace jaxops::cpu::kv_decode {

using namespace simd;

// Keys per tile: a tile of K and of V rows (f32, head_dim 128: 16 KiB each)
// stays in the L1 cache while every query row reads it.
inline constexpr int64_t kDecodeKeyTile = 32;

// Lane c of the result is the sum of the lanes of acc[c]. With AVX-512 a
// transposing tree (45 shuffles and adds for 16 sums instead of ~8 each).
//
// Its loops are unrolled by pragma, so that every step is in registers at any
// optimisation level. The kernels build at -O3, where GCC 12 unrolls them
// itself (the pragmas leave those objects byte for byte the same); at -O2 it
// left them rolled, kept the callers' 16 accumulators in memory and stored all
// of them on every pass of the callers' FMA loops, 16 stores per 16 FMAs
// (objdump). The int8 scores of 4 rows in L1 then took 126-133 cycles per key
// instead of 57-62: a trap for -O2 builds (the C++ tests, stand-alone drivers)
// and for measurements taken with them.
#if defined(__AVX512F__)
// The tree on any lane-wise add of 32-bit lanes (the shuffles only move bits):
// float adds here, integer ones for the fixed-point kernels
// (cpu/kv_decode_pairs.h).
template <typename Add>
inline __m512 transposed_sums(const __m512* acc, Add add) {
  __m512 pairs[8], quads[4], octs[2];
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m512 a = acc[2 * c], b = acc[2 * c + 1];
    // Per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3].
    pairs[c] = add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 a = pairs[2 * c], b = pairs[2 * c + 1];
    // Per 128-bit chunk: one partial sum of each of the four accumulators.
    quads[c] = add(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
#pragma GCC unroll 2
  for (int c = 0; c < 2; ++c) {
    const __m512 a = quads[2 * c], b = quads[2 * c + 1];
    octs[c] = add(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  return add(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88),
             _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Lane c of the result is the sum of the lanes of acc[c] (8 accumulators).
// vhaddps pairs neighbouring lanes of two vectors per 128-bit half: two
// levels give each half one partial sum of four accumulators, and a cross-half
// add finishes them. 6 hadds, 2 lane permutes and an add for 8 sums, where a
// sum per accumulator takes ~4 shuffles and adds each.
//
// The tree on any lane-wise pair of 32-bit ops (hadd, add): float ones here,
// integer ones for the fixed-point kernels (cpu/kv_decode_pairs_avx2.h); the
// permutes only move bits.
template <typename Hadd, typename Add>
inline __m256 transposed_sums_avx2(const __m256* acc, Hadd hadd, Add add) {
  const __m256 t0 = hadd(acc[0], acc[1]);
  const __m256 t1 = hadd(acc[2], acc[3]);
  const __m256 t2 = hadd(acc[4], acc[5]);
  const __m256 t3 = hadd(acc[6], acc[7]);
  // u0: [s0 s1 s2 s3 | s0' s1' s2' s3'] with s the low halves' sums and s' the
  // high halves'; u1 the same for accumulators 4..7.
  const __m256 u0 = hadd(t0, t1);
  const __m256 u1 = hadd(t2, t3);
  return add(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline __m256 sum_each_avx2(const __m256* acc) {
  return transposed_sums_avx2(
      acc, [](__m256 a, __m256 b) { return _mm256_hadd_ps(a, b); },
      [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
}

#endif

inline VecF sum_each(const VecF* acc) {
#if defined(__AVX512F__)
  return transposed_sums(reinterpret_cast<const __m512*>(acc),
                         [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
#elif defined(__AVX2__) && defined(__FMA__)
  return sum_each_avx2(reinterpret_cast<const __m256*>(acc));
#else
  VecF out;
  for (int c = 0; c < kLanes; ++c) out[c] = vsum(acc[c]);
  return out;
#endif
}

// Calls f(i, key_row, value_row, key_stride, value_stride, len) for each run
// of keys j0 + i .. j0 + i + len - 1 of keys j0 .. j0 + n whose key rows lie
// key_stride elements apart and value rows value_stride (0 for a run of one):
// one run for a dense cache, one per page for a paged one. Each run's rows are looked up once: a paged lookup is a
// block-table read and a division, ~20 cycles a key when each key's scales
// were looked up alone (a loop of those lookups alone; in the paged int8
// bench the change was within the noise, 0-5%).
template <typename Source, typename F>
inline void for_each_run(const Source& src, int64_t j0, int64_t n, F&& f) {
  for (int64_t i = 0; i < n;) {
    const int64_t j = j0 + i, len = src.run_length(j, n - i);
    f(i, src.key(j), src.value(j), len > 1 ? src.uniform_stride(j, len) : int64_t{0},
      len > 1 ? src.uniform_value_stride(j, len) : int64_t{0}, len);
    i += len;
  }
}

// Asks for every cache line of a key row and its value row, into L2 (a value
// row inside its key row, absorbed MLA's, is asked for once).
inline void ask_for_rows(const void* key, int64_t key_bytes, const void* value,
                         int64_t value_bytes) {
  for (int64_t b = 0; b < key_bytes; b += 64) simd::prefetch<1>(static_cast<const char*>(key) + b);
  if (value == key && value_bytes <= key_bytes) return;
  for (int64_t b = 0; b < value_bytes; b += 64) {
    simd::prefetch<1>(static_cast<const char*>(value) + b);
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define JAXOPS_FEW_ROWS_DECODE 1

// Rows of at most this many query rows take the few-rows kernels.
inline constexpr int kMaxFewRows = 8;


// Where the rows of a tile's n keys lie (and, for int8 rows, their scales):
// looked up once per tile, since a paged source's lookup (a block-table read
// and a division) cost more than the arithmetic when every pass repeated it.
template <typename Element>
struct TileRows {
  int64_t n = 0;
  const Element* k[kDecodeKeyTile];
  const Element* v[kDecodeKeyTile];
  float k_scale[kDecodeKeyTile];  // int8 rows only
  float v_scale[kDecodeKeyTile];
  // Key j's row, or nullptr past the tile.
  const char* key_or_null(int64_t j) const {
    return j < n ? reinterpret_cast<const char*>(k[j]) : nullptr;
  }
  const char* value_or_null(int64_t j) const {
    return j < n ? reinterpret_cast<const char*>(v[j]) : nullptr;
  }
};

// The rows of keys j0 .. j0 + n (n <= kDecodeKeyTile) in runs of one stride
// (a dense cache: one run; a paged one: a run per page).
template <typename Source>
void find_tile_rows(const Source& src, int64_t j0, int64_t n,
                    TileRows<typename Source::Element>* rows) {
  rows->n = n;
  for_each_run(src, j0, n, [&](int64_t i, const auto* k, const auto* v, int64_t k_stride,
                               int64_t v_stride, int64_t len) {
    for (int64_t t = 0; t < len; ++t) {
      rows->k[i + t] = k + t * k_stride;
      rows->v[i + t] = v + t * v_stride;
    }
  });
  if constexpr (std::is_same_v<typename Source::Element, int8_t>) {
    src.key_scales(j0, n, rows->k_scale);
    src.value_scales(j0, n, rows->v_scale);
  }
}

// Asks for every line of a tile's K rows (H elements) and V rows (Hv), key by
// key, into L2.
template <typename Element>
inline void ask_for_tile(const TileRows<Element>& rows, int64_t H, int64_t Hv) {
  for (int64_t j = 0; j < rows.n; ++j) {
    ask_for_rows(rows.k[j], H * static_cast<int64_t>(sizeof(Element)), rows.v[j],
                 Hv * static_cast<int64_t>(sizeof(Element)));
  }
}

// Prefetches by the passes. Given the next tile's rows (`next`; no rows: no
// prefetches), each pass over a tile asks for them as it goes (`later`: the
// same key of the next tile), a cache line at a time between its products,
// rather than in one burst before the tile, which stalls the core until most
// of the burst has arrived, so that reads and arithmetic take turns. In a
// model loop (2 threads, float32 rows 4 KiB apart, ~90 cycles of FMAs per
// key) this read 27.5 GB/s against the burst's 22. In these kernels, on a
// dense cache (2 threads, interleaved runs, medians of 6): int8 13.0 against
// 10.4 GB/s.

// Whether the few-rows kernels cover this shape: at most kMaxFewRows rows, a
// head dim of one or more whole chunks (kLanes elements: 16 with AVX-512, 8
// with AVX2).
inline bool few_rows_fit(int64_t rows, int64_t head_dim) {
  // (head_dim 0, which an op may be given, has no chunks: the general path.)
  return rows >= 1 && rows <= kMaxFewRows && head_dim > 0 && head_dim % kLanes == 0;
}
#endif  // JAXOPS_FEW_ROWS_DECODE

#if defined(__AVX512F__)
// 16 elements of a cache row as float (int8: unscaled).
inline __m512 load_chunk(const bfloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_chunk(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_chunk(const float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_chunk(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}


// Keys per score group: R rows x kKeys keys fill at most 16 accumulators.
template <int R>
inline constexpr int kScoreKeys = 16 / R;

// Lane c of a score group's sums holds key c % kKeys of row c / kKeys: the
// permutes that give each lane its key's or its row's scale (constant tables:
// a vector load of scales written one by one just before stalls on the failed
// store forwarding, 12% of the int8 scores pass where store_scores did so).
template <int kKeys>
struct ScoreLanes {
  int32_t key[16];
  int32_t row[16];
  constexpr ScoreLanes() : key(), row() {
    for (int c = 0; c < 16; ++c) {
      key[c] = c % kKeys;
      row[c] = c / kKeys;
    }
  }
};

// Stores a group's sums (lane r * kScoreKeys + kk: row r, key j + kk) into
// the score rows (row r at scores + r * ld), keys below jn only, times each
// key's scale for int8 rows.
template <int R, typename Element>
inline void store_scores(__m512 sums, const TileRows<Element>& rows, int64_t j, int64_t jn,
                         float* scores, int64_t ld) {
  constexpr int kKeys = kScoreKeys<R>;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 keys = static_cast<__mmask16>((1u << std::min<int64_t>(kKeys, jn - j)) - 1u);
  if constexpr (std::is_same_v<Element, int8_t>) {
    // Lane r * kKeys + kk takes key kk's scale.
    alignas(64) static constexpr ScoreLanes<kKeys> lanes;
    sums = _mm512_mul_ps(sums, _mm512_permutexvar_ps(_mm512_load_si512(lanes.key),
                                                     _mm512_maskz_loadu_ps(keys, rows.k_scale + j)));
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    // Row r's kKeys lanes to the front.
    const __m512i from = _mm512_add_epi32(lane, _mm512_set1_epi32(r * kKeys));
    _mm512_mask_storeu_ps(scores + r * ld + j, keys, _mm512_permutexvar_ps(from, sums));
  }
}

// The float32 kernels' operands: rows in 16-element chunks converted to
// float, float queries, FMAs. (The pair kernels' kinds, cpu/kv_decode_pairs.h,
// have the same members.)
template <typename E>
struct FloatLanes {
  using Element = E;
  using Query = float;
  using Sum = __m512;
  static constexpr int kChunk = 16;
  static Sum zero() { return _mm512_setzero_ps(); }
  static __m512 query(const float* q) { return _mm512_loadu_ps(q); }
  static __m512 chunk(const E* p) { return load_chunk(p); }
  static Sum dot(Sum acc, __m512 q, __m512 k) { return _mm512_fmadd_ps(k, q, acc); }
  static __m512 sum_each(const Sum* acc) { return kv_decode::sum_each(acc); }
};

// scores[r * ld + j] = q_r . k_j for the tile's keys j, in Kind's operands (q:
// R rows of H at stride ldq, times q_scale[r] where q_scale is given); asks
// for the next tile's key rows.
template <int R, typename Kind>
void score_groups(const TileRows<typename Kind::Element>& tile, const typename Kind::Query* q,
                  int64_t ldq, int64_t H, const float* q_scale, float* scores, int64_t ld,
                  const TileRows<typename Kind::Element>& next) {
  using Element = typename Kind::Element;
  constexpr int kKeys = kScoreKeys<R>;
  const int64_t jn = tile.n;
  // Lane r * kKeys + kk of a group's sums is row r's: its query scale (0 in
  // the lanes past the R rows, which store_scores leaves out).
  alignas(64) static constexpr ScoreLanes<kKeys> lanes;
  const __m512 row_scale =
      q_scale ? _mm512_permutexvar_ps(_mm512_load_si512(lanes.row),
                                      _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << R) - 1u), q_scale))
              : _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < jn; j += kKeys) {
    const Element* rows[kKeys];
    const char* later[kKeys];
#pragma GCC unroll 16
    for (int kk = 0; kk < kKeys; ++kk) {
      rows[kk] = tile.k[std::min<int64_t>(j + kk, jn - 1)];
      later[kk] = next.key_or_null(j + kk);
    }
    typename Kind::Sum acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < 16; ++a) acc[a] = Kind::zero();
    for (int64_t h = 0; h < H; h += Kind::kChunk) {
      // One line of each later row per 64 bytes of this chunk's rows: the
      // prefetches spread over the products.
      if ((h * static_cast<int64_t>(sizeof(Element))) % 64 == 0) {
#pragma GCC unroll 16
        for (int kk = 0; kk < kKeys; ++kk) {
          if (later[kk]) simd::prefetch<1>(later[kk] + h * sizeof(Element));
        }
      }
      decltype(Kind::query(q)) qv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) qv[r] = Kind::query(q + r * ldq + h);
#pragma GCC unroll 16
      for (int kk = 0; kk < kKeys; ++kk) {
        const auto kv = Kind::chunk(rows[kk] + h);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r * kKeys + kk] = Kind::dot(acc[r * kKeys + kk], qv[r], kv);
        }
      }
    }
    __m512 sums = Kind::sum_each(acc);
    if (q_scale) sums = _mm512_mul_ps(sums, row_scale);
    store_scores<R>(sums, tile, j, jn, scores, ld);
  }
}

// Head-dim chunks whose R output rows stay in registers during the values
// pass: at most 20 accumulators, with R probability broadcasts and a value
// chunk beside them in the 32 vector registers.
template <int R>
inline constexpr int kValueChunks = std::min(8, 20 / R);

// o[r * ldo + h] += sum_j p[r * ld + j] * v_j[h] over the tile's keys j (p:
// probabilities; for int8 rows the value scale is folded into them here, in
// place); asks for the next tile's value rows.
template <int R, typename Element>
void few_rows_values(const TileRows<Element>& tile, float* p, int64_t ld, int64_t H, float* o,
                     int64_t ldo, const TileRows<Element>& next) {
  const int64_t jn = tile.n;
  constexpr int kChunks = kValueChunks<R>;
  if constexpr (std::is_same_v<Element, int8_t>) {
    for (int64_t j = 0; j < jn; ++j) {
      const float scale = tile.v_scale[j];
      for (int r = 0; r < R; ++r) p[r * ld + j] *= scale;
    }
  }
  // The head dim in blocks of at most kChunks chunks, as even as they come
  // (8 chunks for 5 rows: 4 + 4, not 5 + 3).
  const int64_t total = H / 16, blocks = (total + kChunks - 1) / kChunks;
  const int64_t per_block = (total + blocks - 1) / blocks;
  // Keys in slices of kValueKeys, the head-dim blocks within a slice: a
  // slice's rows stay in L1 while every block reads them. A whole tile of a
  // dense cache's rows (a page or a fraction of one apart, so the same line
  // offsets share few L1 sets of 8 ways) can be evicted between blocks and
  // read again from L2.
  constexpr int64_t kValueKeys = 8;
  for (int64_t s0 = 0; s0 < jn; s0 += kValueKeys) {
    const int64_t s_end = std::min(jn, s0 + kValueKeys);
    for (int64_t h0 = 0; h0 < H; h0 += 16 * per_block) {
      const int chunks = static_cast<int>(std::min<int64_t>(per_block, (H - h0) / 16));
      __m512 acc[R][kChunks];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          acc[r][c] = c < chunks ? _mm512_loadu_ps(o + r * ldo + h0 + 16 * c) : _mm512_setzero_ps();
        }
      }
      for (int64_t j = s0; j < s_end; ++j) {
        const Element* row = tile.v[j] + h0;
        // The later row's lines under this block's chunks, one per 64 bytes.
        const char* later = next.value_or_null(j);
        if (later) later += h0 * sizeof(Element);
        __m512 pv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pv[r] = _mm512_set1_ps(p[r * ld + j]);
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) {
            if (later && (16 * c * sizeof(Element)) % 64 == 0) {
              simd::prefetch<1>(later + 16 * c * sizeof(Element));
            }
            const __m512 v = load_chunk(row + 16 * c);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(pv[r], v, acc[r][c]);
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) _mm512_storeu_ps(o + r * ldo + h0 + 16 * c, acc[r][c]);
        }
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

#endif  // __AVX512F__

}  // namespace jaxops::cpu::kv_decode

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include "cpu/kv_decode_few_rows_avx2.h"
#endif
