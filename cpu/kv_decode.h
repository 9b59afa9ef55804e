// The decode core: attention of a few query rows (T = 1..8 query tokens x the
// G query heads of one kv head) against the keys of that kv head, bound by
// reading each key/value row once. Shared by jaxops.attention's decode path
// (cpu/attention_decode.cc, dense [B, S, K, H] cache) and the paged cache
// (block tables), which differ only in where key j's rows live: the core is
// templated on a *row source* that says so.
//
// Units and state. Scores are kept in log2 units (x = logit * log2(e)) so the
// exponential is exp2, as in cpu/attention_tiles.h. Each query row carries an
// online-softmax partial state over the keys seen so far: the running max m
// (-inf while no key was attended), the sum l of exp2(x - m) and the
// unnormalised output o = sum exp2(x - m) v. Partial states over disjoint key
// ranges merge exactly (merge_decode_state), which lets the keys of one
// (sequence, kv head) be split across threads when there are fewer of those
// than threads (batch 1).
//
// Reading each row once: a tile of kDecodeKeyTile keys is read and every query
// row's scores against it computed while it is in the L1 cache (a dot product
// per row and key for fewer rows than vector lanes, else a register-blocked
// product with the rows along the lanes); the values are then added to every
// row's output by one register-blocked product. With AVX-512 or AVX2, 1 to 8
// rows (one token of a GQA group: the common decode step; 9 to 16 in slices of
// 8 but for float32) and a head_dim of whole vectors (16 or 8 elements) take
// the kernels of cpu/kv_decode_few_rows.h (AVX2: cpu/kv_decode_few_rows_avx2.h)
// instead, which convert rows in registers and ask
// for the next tile's rows between their products
// (decode_keys_few_rows); on a CPU with AVX512_BF16 (bfloat16) or AVX512_VNNI
// (int8), and a head_dim of whole 32-element chunks, their pair-product form
// (cpu/kv_decode_pairs.h). Reading in memory order: run_decode walks the
// groups whose rows interleave (a sequence's kv heads) together, a tile at a
// time through each (decode_walk_width).
//
// Arithmetic is float32 (accumulation included), except:
// - the bfloat16 dot path: with bfloat16 rows, a head_dim that is a multiple
//   of 32 and a CPU with AVX512_BF16, the scores are vdpbf16ps products of the
//   rows against the queries rounded to bfloat16 (exact for bfloat16
//   queries), and the values are accumulated against the probabilities
//   rounded to bfloat16 (float32 accumulation), as the bfloat16 forward does;
// - int8 rows on the pair kernels: the queries and the probabilities in
//   16-bit fixed point, exact integer sums (cpu/kv_decode_pairs.h says how
//   far that rounds).
//
// Masking. Query row i attends keys j in [key_begin[i], key_end[i]) (the
// caller's intervals: causal limit, left/right window, sequence lengths, all
// folded into them, so each row has its own last key). Optional soft cap:
// logit = cap * tanh(logit / cap) after the scale. A row that attends no key
// ends with output 0 and logsumexp -inf. A NaN or +inf reaching a row's
// logits makes that row NaN.
//
// Element types of the rows: float, bfloat16 (Eigen::bfloat16), float16
// (Eigen::half) and int8_t with a float32 scale per row (the real value of
// element h of key j is row[h] * scale(j)).
//
// The row source concept (a small copyable struct):
//
//   struct MySource {
//     using Element = float | bfloat16 | float16 | int8_t;
//     const Element* key(int64_t j) const;    // head_dim elements of key j
//     const Element* value(int64_t j) const;  // value_dim elements of value j
//                                             // (may be key j's own first ones)
//     // int8_t rows only: the scales of keys j .. j + n - 1 into out[0, n).
//     void key_scales(int64_t j, int64_t n, float* out) const;
//     void value_scales(int64_t j, int64_t n, float* out) const;
//     // Elements between key rows j and j + 1 if every key row of keys j ..
//     // j + n - 1 is that far from the previous one, else 0; the same for
//     // the value rows. Lets the tile be read where it lies (a dense cache; a
//     // paged one within a page).
//     int64_t uniform_stride(int64_t j, int64_t n) const;
//     int64_t uniform_value_stride(int64_t j, int64_t n) const;
//     // How many keys from j on (1 .. n) are uniformly strided that way: n
//     // for a dense cache, up to the end of j's page for a paged one.
//     int64_t run_length(int64_t j, int64_t n) const;
//   };
//
// The row sources are read, never written; key j is only asked for j inside
// the key range the caller passes, so a source clamps nothing itself but
// must be valid for every key of that range (a paged source clamps page ids).
//
// The group concept (run_decode's problems: one per (sequence, kv head)):
//
//   struct MyGroups {
//     using Source = MySource;
//     // Fills the `rows` query rows of group g as float, q[i * ld + h]
//     // (h < head_dim; the core zero-pads to ld) with load_query_row, and
//     // each row's key interval; returns the group's row source.
//     Source setup(int64_t g, float* q, int64_t ld, int64_t* key_begin,
//                  int64_t* key_end) const;
//     // Stores row i of group g: out_row (value_dim floats, normalised) and
//     // its natural-log logsumexp.
//     void store(int64_t g, int64_t i, const float* out_row, float lse) const;
//   };
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/attention_tiles.h"
#include "cpu/float_convert.h"
#include "cpu/gemm_bf16_microkernels.h"
#include "cpu/gemm_microkernels.h"
#include "cpu/kv_decode_few_rows.h"
#include "cpu/kv_decode_pairs.h"
#include "cpu/simd.h"

namespace jaxops::cpu::kv_decode {

using namespace simd;
using namespace microkernels;
// The attention kernels' units, rounding and scratch arena.
using attention_internal::Arena;
using attention_internal::ceil_div;
using attention_internal::kInf;
using attention_internal::kLn2;
using attention_internal::kLog2e;
using attention_internal::round_up;

// A key split is never shorter than this: below it, merging costs more than
// the parallelism gains.
inline constexpr int64_t kMinKeysPerSplit = 256;

// The padded head dimension of query and output rows (a whole number of vectors).
inline int64_t decode_padded_dim(int64_t head_dim) { return round_up(head_dim, kLanes); }

// What the core computes for one group: `rows` query rows of head_dim, whose
// outputs have value_dim (MLA: 192 and 128, or 576 and 512 with the values
// the keys' first 512 features).
struct DecodeShape {
  int64_t rows = 0;
  int64_t head_dim = 0;
  float scale = 1.0f;     // multiplies q . k
  float soft_cap = 0.0f;  // > 0: logit = cap * tanh(logit / cap) after the scale
  // Consecutive groups whose rows interleave in memory (the kv heads of one
  // sequence: key j of every head lies in one block): run_decode walks them
  // together (decode_walk_width). 1: each group alone.
  int64_t groups_per_walk = 1;
  // false: the float32 few-rows kernels even where the pair kernels
  // (cpu/kv_decode_pairs.h) fit, so that the C++ test runs both on one CPU.
  bool pair_kernels = true;
  int64_t value_dim = -1;  // the output's head dim; -1: head_dim
};

inline int64_t decode_value_dim(const DecodeShape& shape) {
  return shape.value_dim >= 0 ? shape.value_dim : shape.head_dim;
}

// Online-softmax partial state of a group's rows over some keys.
struct DecodeState {
  float* m;  // [rows] running max of the log2-unit logits; -inf: no key yet
  float* l;  // [rows] sum of exp2(x - shift), shift = m (0 while m is -inf)
  float* o;  // [rows][padded value_dim] unnormalised output
};

// ---------------------------------------------------------------------------
// Row conversions.

// A query row into float, zero-padded to ld.
template <typename T>
inline void load_query_row(const T* src, float* dst, int64_t head_dim, int64_t ld) {
  load_row(src, dst, head_dim);
  std::fill(dst + head_dim, dst + ld, 0.0f);
}

// A cache row as float (scaled for int8), zero-padded to ld.
template <typename Element>
inline void load_cache_row(const Element* src, float scale, float* dst, int64_t head_dim,
                           int64_t ld) {
  if constexpr (std::is_same_v<Element, int8_t>) {
#pragma omp simd
    for (int64_t h = 0; h < head_dim; ++h) dst[h] = static_cast<float>(src[h]) * scale;
  } else {
    (void)scale;
    load_row(src, dst, head_dim);
  }
  std::fill(dst + head_dim, dst + ld, 0.0f);
}

// ---------------------------------------------------------------------------
// Scratch of one thread.

struct DecodeScratch {
  float* q;            // [rows][Hp] queries
  uint32_t* q_pairs;   // [rows][H/2] queries as bf16 pairs (bf16 dot path)
  int16_t* q_fixed;    // [rows][H] queries in 16-bit fixed point (int8 pair kernels)
  float* q_fixed_scale;  // [rows] their scales
  // With at least kLanes rows, the scores are products with the rows along
  // the lanes (rows_along_lanes): Rp = rows rounded up to kLanes.
  float* q_t;          // [H][Rp] queries, transposed
  uint32_t* q_pairs_t; // [H/2][Rp] bf16 query pairs, transposed
  float* scores_t;     // [kDecodeKeyTile][Rp] scores, transposed
  int64_t* key_begin;  // [rows]
  int64_t* key_end;    // [rows]
  float* scores;       // [rows][kDecodeKeyTile] logits, then probabilities
  uint16_t* p_bf16;    // [rows][kDecodeKeyTile] probabilities as bf16 (bf16 dot path)
  float* k_rows;       // [kDecodeKeyTile][Hp] converted key rows
  float* v_rows;       // [kDecodeKeyTile][Hvp] converted value rows (Hv: value_dim)
  uint32_t* v_pairs;   // [kDecodeKeyTile/2][Hv] value rows as bf16 pairs along the keys
  float* out_row;      // [Hvp]
  DecodeState state;   // the thread's own state (unsplit groups, merges)
};

// Whether the scores are register-blocked products with the query rows along
// the vector lanes (the tiled forward's form: a key element broadcast against
// kLanes rows, no horizontal sums) rather than one dot product per row and
// key. Measured (one core, cache-resident, H = 128, 16 rows): f32 12.4 ->
// 17.0 GB/s, bf16 10.6 -> 13.8 (the tiled forward of cpu/attention_forward.cc,
// which the dense cache keeps for these shapes: 20.4 and 18.5).
inline bool rows_along_lanes(int64_t rows) { return rows >= kLanes; }

// Rows per slice: decode_keys takes more than kMaxFewRows rows of the element
// types the few-rows kernels read (all but float), up to kMaxSlicedRows (T = 4
// tokens of a GQA group of 4, or one of 16), in slices of kMaxFewRows, each
// reading the tile (from L1 after the first). Measured against the products
// with the rows along the lanes (a driver of this core, 2 threads, 8 x 8
// groups of 16 rows x 4096 keys, H = 128, alternated): int8 2.1-2.4 -> 3.1-3.4
// GB/s, bfloat16 4.3-4.7 -> 4.8-5.0. float32 rows are not sliced: on the
// general path's dot products they were slower (11.1 -> 6.6), on the few-rows
// kernels no faster (8.2-9.8 against 8.9-9.6).
inline constexpr int64_t kMaxSlicedRows = 16;
template <typename Element>
inline int64_t decode_row_slice(int64_t rows) {
#if defined(JAXOPS_FEW_ROWS_DECODE)
  if (!std::is_same_v<Element, float> && rows > kMaxFewRows && rows <= kMaxSlicedRows) {
    return kMaxFewRows;
  }
#endif
  return rows;
}

inline DecodeState carve_decode_state(int64_t rows, int64_t value_dim, Arena& arena) {
  DecodeState s;
  s.m = arena.take<float>(rows);
  s.l = arena.take<float>(rows);
  s.o = arena.take<float>(rows * decode_padded_dim(value_dim));
  return s;
}

// A group's scratch; with tiles_of, the tile buffers (scores, converted rows,
// out_row: used within one decode_keys call at a time) are that scratch's.
inline DecodeScratch carve_decode_scratch(const DecodeShape& shape, Arena& arena,
                                          const DecodeScratch* tiles_of = nullptr) {
  const int64_t rows = shape.rows, head_dim = shape.head_dim, Hv = decode_value_dim(shape);
  const int64_t Hp = decode_padded_dim(head_dim), Hvp = decode_padded_dim(Hv);
  const int64_t Bc = kDecodeKeyTile;
  DecodeScratch s;
  s.q = arena.take<float>(rows * Hp);
  s.q_pairs = arena.take<uint32_t>(rows * (head_dim / 2));
  s.q_fixed = arena.take<int16_t>(rows * head_dim);
  s.q_fixed_scale = arena.take<float>(rows);
  const int64_t Rp = rows_along_lanes(rows) ? round_up(rows, kLanes) : 0;
  s.q_t = arena.take<float>(head_dim * Rp);
  s.q_pairs_t = arena.take<uint32_t>(head_dim / 2 * Rp);
  s.key_begin = arena.take<int64_t>(rows);
  s.key_end = arena.take<int64_t>(rows);
  s.state = carve_decode_state(rows, Hv, arena);
  if (tiles_of) {
    s.scores_t = tiles_of->scores_t;
    s.scores = tiles_of->scores;
    s.p_bf16 = tiles_of->p_bf16;
    s.k_rows = tiles_of->k_rows;
    s.v_rows = tiles_of->v_rows;
    s.v_pairs = tiles_of->v_pairs;
    s.out_row = tiles_of->out_row;
    return s;
  }
  s.scores_t = arena.take<float>(Bc * Rp);
  s.scores = arena.take<float>(rows * Bc);
  s.p_bf16 = arena.take<uint16_t>(rows * Bc);
  s.k_rows = arena.take<float>(Bc * Hp);
  s.v_rows = arena.take<float>(Bc * Hvp);
  s.v_pairs = arena.take<uint32_t>(Bc / 2 * Hv);
  s.out_row = arena.take<float>(Hvp);
  return s;
}

// ---------------------------------------------------------------------------
// Scores.

// Calls f(std::integral_constant<int, n>) for n in 1..8, else
// f(std::integral_constant<int, 0>) (0: the count is only known at run time).
// The score kernels keep a query row's n vectors in registers when n is fixed;
// the few-rows kernels take their row count this way.
template <typename F>
inline void with_chunk_count(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// scores[j] = q . k_rows[j] for j < jn (float rows of Hp = chunks * kLanes
// elements; q zero-padded). Scores past jn (to the next multiple of kLanes)
// are written with junk. One key row at a time against the query held in
// registers (kChunks > 0): a row pointer per key, never 16 live ones (x86 has
// 16 general registers), and one load per FMA.
template <int kChunks>
inline void float_scores(const float* q, int64_t chunks, const float* const* k_rows, int64_t jn,
                         float* scores) {
  constexpr int kHeld = kChunks > 0 ? kChunks : 1;
  VecF qv[kHeld];
  for (int h = 0; h < kHeld; ++h) qv[h] = vload(q + h * kLanes);
  for (int64_t j0 = 0; j0 < jn; j0 += kLanes) {
    VecF acc[kLanes];
#pragma GCC unroll 16
    for (int c = 0; c < kLanes; ++c) {
      const float* row = k_rows[std::min<int64_t>(j0 + c, jn - 1)];
      VecF a{};
      if constexpr (kChunks > 0) {
#pragma GCC unroll 8
        for (int h = 0; h < kChunks; ++h) a = vfma(qv[h], vload(row + h * kLanes), a);
      } else {
        for (int64_t h = 0; h < chunks; ++h) a = vfma(vload(q + h * kLanes), vload(row + h * kLanes), a);
      }
      acc[c] = a;
    }
    vstore(scores + j0, sum_each(acc));
  }
}

#if defined(JAXOPS_BF16_DOT)
// The same with bf16 rows and queries: chunks = head_dim / 32 vdpbf16ps per score.
template <int kChunks>
JAXOPS_BF16_TARGET inline void bf16_scores(const uint32_t* q_pairs, int64_t chunks,
                                           const uint16_t* const* k_rows, int64_t jn,
                                           float* scores) {
  constexpr int kHeld = kChunks > 0 ? kChunks : 1;
  __m512bh qv[kHeld];
  for (int h = 0; h < kHeld; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(q_pairs + h * 16);
  for (int64_t j0 = 0; j0 < jn; j0 += 16) {
    VecF acc[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      const uint16_t* row = k_rows[std::min<int64_t>(j0 + c, jn - 1)];
      __m512 a = _mm512_setzero_ps();
      if constexpr (kChunks > 0) {
#pragma GCC unroll 8
        for (int h = 0; h < kChunks; ++h) {
          a = _mm512_dpbf16_ps(a, qv[h], (__m512bh)_mm512_loadu_si512(row + h * 32));
        }
      } else {
        for (int64_t h = 0; h < chunks; ++h) {
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q_pairs + h * 16),
                               (__m512bh)_mm512_loadu_si512(row + h * 32));
        }
      }
      acc[c] = a;
    }
    vstore(scores + j0, sum_each(acc));
  }
}

// Queries rounded to bf16 (round to nearest even), consecutive pairs along H.
JAXOPS_BF16_TARGET inline void pack_query_pairs(const float* q, int64_t head_dim,
                                                uint32_t* out) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t h = 0; h < head_dim; h += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + h),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + h)));
  }
}

// Probabilities rounded to bf16: a row's consecutive keys form the pairs.
JAXOPS_BF16_TARGET inline void pack_probability_row(const float* p, int64_t width,
                                                    uint16_t* out) {
  for (int64_t j = 0; j < width; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j)));
  }
}
#endif

// Whether rows of Element take the bf16 dot path.
template <typename Element>
inline bool decode_uses_bf16_dot(int64_t head_dim) {
#if defined(JAXOPS_BF16_DOT)
  return std::is_same_v<Element, bfloat16> && head_dim % 32 == 0 && cpu_has_bf16_dot();
#else
  (void)head_dim;
  return false;
#endif
}

// The pair kernels (cpu/kv_decode_pairs.h) rows of Element take, if any:
// PairKind<Element>::type, void for none.
template <typename Element>
struct PairKind {
  using type = void;
};
#if defined(JAXOPS_PAIR_KERNELS)
template <>
struct PairKind<int8_t> {
  using type = FixedPointInt8;
};
#endif
#if defined(JAXOPS_BF16_PAIR_KERNELS)
template <>
struct PairKind<bfloat16> {
  using type = Bfloat16Pairs;
};
#endif

// Whether the shape's rows of Element take the pair kernels on this CPU.
template <typename Element>
inline bool decode_uses_pair_kernels(const DecodeShape& shape) {
#if defined(JAXOPS_PAIR_KERNELS)
  using Kind = typename PairKind<Element>::type;
  if constexpr (!std::is_void_v<Kind>) {
    const int64_t rows = decode_row_slice<Element>(shape.rows);
    return shape.pair_kernels && pair_kernels_fit<Kind>(rows, shape.head_dim) &&
           pair_kernels_fit<Kind>(rows, decode_value_dim(shape));
  }
#endif
  (void)shape;
  return false;
}

// cap * tanh(x / cap), by the attention kernels' tanh (cpu/attention_tiles.h).
inline VecF soft_cap_vec(VecF x, float cap) {
  return vsplat(cap) * attention_internal::tanh_of_ratio(x, vsplat(-2.0f * kLog2e / cap));
}

// Raw scores q . k of keys j0 .. j0 + jn (width: jn rounded up to kLanes) into
// log2-unit logits, -inf outside [begin, end).
inline void scores_to_logits(const DecodeShape& shape, int64_t begin, int64_t end, int64_t j0,
                             int64_t jn, int64_t width, float* row) {
  if (shape.soft_cap > 0.0f) {
    const VecF scale = vsplat(shape.scale), to_log2 = vsplat(kLog2e);
    for (int64_t j = 0; j < width; j += kLanes) {
      vstore(row + j, soft_cap_vec(vload(row + j) * scale, shape.soft_cap) * to_log2);
    }
  } else {
    const VecF c = vsplat(shape.scale * kLog2e);
    for (int64_t j = 0; j < width; j += kLanes) vstore(row + j, vload(row + j) * c);
  }
  const int64_t lo = std::max<int64_t>(begin - j0, 0), hi = std::min<int64_t>(end - j0, jn);
  if (lo == 0 && hi == width) return;
  if (lo >= hi) {
    std::fill(row, row + width, -kInf);
    return;
  }
  std::fill(row, row + lo, -kInf);
  std::fill(row + hi, row + width, -kInf);
}

// Online-softmax update of one row with a tile of logits (width entries):
// returns alpha, the rescale of the row's earlier output; turns the logits
// into probabilities.
inline float online_softmax_row(float* row, int64_t width, float* m, float* l) {
  VecF tile_max = vsplat(-kInf);
  // vmax(tile_max, x): a NaN logit makes tile_max NaN, and vmax_lanes then
  // leaves that lane out; the NaN reaches l through exp2.
  for (int64_t j = 0; j < width; j += kLanes) tile_max = vmax(tile_max, vload(row + j));
  const float m_new = std::max(*m, vmax_lanes(tile_max));
  const float shift = m_new == -kInf ? 0.0f : m_new;
  const float old_shift = *m == -kInf ? 0.0f : *m;
  const float alpha = *m == -kInf ? 0.0f : vexp2(vsplat(old_shift - shift))[0];
  VecF sum{};
  for (int64_t j = 0; j < width; j += kLanes) {
    const VecF prob = vexp2(vload(row + j) - vsplat(shift));
    vstore(row + j, prob);
    sum += prob;
  }
  *m = m_new;
  *l = *l * alpha + vsum(sum);
  return alpha;
}

// Keys j0 .. j0 + jn of the source's key (kKey) or value rows (H: their head
// dim) as float rows of stride *ld: where they lie when they are float and
// `in_place` (uniformly strided, and as many elements as the product reads),
// else converted (scaled for int8) into buf, zero-padded to the padded H.
template <bool kKey, typename Source>
inline const float* float_tile(const Source& src, int64_t j0, int64_t jn, bool in_place,
                               int64_t H, float* buf, int64_t* ld) {
  using Element = typename Source::Element;
  if constexpr (std::is_same_v<Element, float>) {
    if (in_place) {
      *ld = kKey ? src.uniform_stride(j0, jn) : src.uniform_value_stride(j0, jn);
      return kKey ? src.key(j0) : src.value(j0);
    }
  }
  const int64_t Hp = decode_padded_dim(H);
  float scales[kDecodeKeyTile];
  if constexpr (std::is_same_v<Element, int8_t>) {
    if (kKey) {
      src.key_scales(j0, jn, scales);
    } else {
      src.value_scales(j0, jn, scales);
    }
  }
  for_each_run(src, j0, jn, [&](int64_t i, const Element* k, const Element* v,
                                int64_t k_stride, int64_t v_stride, int64_t len) {
    for (int64_t t = 0; t < len; ++t) {
      const float scale = std::is_same_v<Element, int8_t> ? scales[i + t] : 1.0f;
      const Element* row = kKey ? k + t * k_stride : v + t * v_stride;
      load_cache_row(row, scale, buf + (i + t) * Hp, H, Hp);
    }
  });
  *ld = Hp;
  return buf;
}

// ---------------------------------------------------------------------------
// The core.

inline void reset_decode_state(const DecodeShape& shape, const DecodeState& st) {
  const int64_t Hvp = decode_padded_dim(decode_value_dim(shape));
  std::fill(st.m, st.m + shape.rows, -kInf);
  std::fill(st.l, st.l + shape.rows, 0.0f);
  std::fill(st.o, st.o + shape.rows * Hvp, 0.0f);
}

// The keys of the tile at j0 (at most n): n, or, when those rows are not
// uniformly strided, their longest uniformly strided prefix if it still fills
// a vector of scores. A paged cache's tile then ends at its page, and its rows
// are read in place (float32 rows, bfloat16 value pairs) instead of being
// converted into the tile buffer.
template <typename Source>
int64_t uniform_tile_length(const Source& src, int64_t j0, int64_t n) {
  if (n <= kLanes) return n;
  const int64_t run = src.run_length(j0, n);
  return run >= kLanes ? run : n;
}

// The tile's scores (s.scores, rows of kDecodeKeyTile) into logits, then
// probabilities; each row's online-softmax state updated and its earlier
// output rescaled.
inline void softmax_tile(const DecodeShape& shape, int64_t j0, int64_t jn, const DecodeScratch& s,
                         const DecodeState& st) {
  const int64_t Hvp = decode_padded_dim(decode_value_dim(shape)), width = round_up(jn, kLanes);
  for (int64_t i = 0; i < shape.rows; ++i) {
    float* row = s.scores + i * kDecodeKeyTile;
    scores_to_logits(shape, s.key_begin[i], s.key_end[i], j0, jn, width, row);
    const float alpha = online_softmax_row(row, width, st.m + i, st.l + i);
    if (alpha != 1.0f) {
      float* o = st.o + i * Hvp;
      const VecF a = vsplat(alpha);
      for (int64_t h = 0; h < Hvp; h += kLanes) vstore(o + h, vload(o + h) * a);
    }
  }
}

// Rows r0 .. of a group's scratch and state (the query rows, their intervals
// and prepared operands; the tile buffers are shared).
inline DecodeScratch scratch_rows(DecodeScratch s, int64_t r0, int64_t H) {
  const int64_t Hp = decode_padded_dim(H);
  s.q += r0 * Hp;
  s.q_pairs += r0 * (H / 2);
  s.q_fixed += r0 * H;
  s.q_fixed_scale += r0;
  s.key_begin += r0;
  s.key_end += r0;
  return s;
}
inline DecodeState state_rows(DecodeState st, int64_t r0, int64_t Hvp) {
  st.m += r0;
  st.l += r0;
  st.o += r0 * Hvp;
  return st;
}

#if defined(JAXOPS_FEW_ROWS_DECODE)
// decode_keys for R <= kMaxFewRows rows of whole chunks (few_rows_fit) of the
// element types decode_keys gives them, on the kernels of
// cpu/kv_decode_few_rows.h (Kind void) or the pair kernels of Kind
// (cpu/kv_decode_pairs.h), over keys [first, last): the rows' union interval
// within the caller's range. The passes over the last tile ask for the keys
// after it up to `ahead` (>= last); first_asked: the caller asked for the
// first tile's rows already.
template <int R, typename Kind, typename Source>
void decode_keys_few_rows(const DecodeShape& shape, const Source& src, int64_t first,
                          int64_t last, int64_t ahead, bool first_asked, const DecodeScratch& s,
                          const DecodeState& st) {
  using Element = typename Source::Element;
  const int64_t H = shape.head_dim, Hp = decode_padded_dim(H), Bc = kDecodeKeyTile;
  const int64_t Hv = decode_value_dim(shape), Hvp = decode_padded_dim(Hv);
  // This tile's rows and the next one's, which the passes over this one ask
  // for as they go; the first tile's are asked for at once unless the caller
  // has (in a walk, every tile but the first: asking again for lines already
  // on their way or in L1 took 10% of the int8 pair kernels' time).
  TileRows<Element> rows[2];
  TileRows<Element>* tile = &rows[0];
  TileRows<Element>* next = &rows[1];
  if (first < last) find_tile_rows(src, first, std::min(Bc, last - first), tile);
  if (!first_asked) ask_for_tile(*tile, H, Hv);
  for (int64_t j0 = first; j0 < last; j0 += Bc) {
    const int64_t jn = tile->n;
    next->n = 0;
    if (j0 + Bc < ahead) find_tile_rows(src, j0 + Bc, std::min(Bc, ahead - j0 - Bc), next);
#if defined(JAXOPS_PAIR_KERNELS)
    if constexpr (!std::is_void_v<Kind>) {
      // The queries as 16-bit operands: fixed point (int8), bf16 pairs.
      const auto* q16 = std::is_same_v<Kind, FixedPointInt8>
                            ? reinterpret_cast<const uint16_t*>(s.q_fixed)
                            : reinterpret_cast<const uint16_t*>(s.q_pairs);
      const float* q_scale = std::is_same_v<Kind, FixedPointInt8> ? s.q_fixed_scale : nullptr;
      score_groups<R, Kind>(*tile, q16, H, H, q_scale, s.scores, Bc, *next);
      softmax_tile(shape, j0, jn, s, st);
      pair_values<R, Kind>(*tile, s.scores, Bc, Hv, st.o, Hvp, *next);
      std::swap(tile, next);
      continue;
    }
#endif
    few_rows_scores<R>(*tile, s.q, Hp, H, s.scores, Bc, *next);
    softmax_tile(shape, j0, jn, s, st);
    few_rows_values<R>(*tile, s.scores, Bc, Hv, st.o, Hvp, *next);
    std::swap(tile, next);
  }
}
#endif

// Accumulates keys [j_begin, j_end) (each row limited to its own interval in
// s.key_begin/key_end) into st, which reset_decode_state (or an earlier call
// over other keys) set. s.q holds the rows' queries (padded); with the bf16
// dot path prepare_decode_queries must have packed them. The few-rows passes
// ask for the next tile's rows as they go, past j_end up to ask_until (the
// next call's keys, when the caller walks a range a tile at a time) where the
// rows attend them; first_asked says the call before (over the keys just
// before j_begin) did so for this call's first tile. The general path asks
// for the next tile's rows in one burst before a tile and only within j_end:
// in a walk it leaves the reads to the hardware prefetchers, which were
// faster there (float32, 2 threads, alternated: 13-18% slower with the
// burst).
template <typename Source>
void decode_keys(const DecodeShape& shape, const Source& src, int64_t j_begin, int64_t j_end,
                 const DecodeScratch& s, const DecodeState& st, int64_t ask_until = 0,
                 bool first_asked = false) {
  using Element = typename Source::Element;
  const int64_t R = shape.rows, H = shape.head_dim, Hp = decode_padded_dim(H);
  const int64_t Hv = decode_value_dim(shape), Hvp = decode_padded_dim(Hv);
  const int64_t Bc = kDecodeKeyTile;
  if (const int64_t slice = decode_row_slice<Element>(R); slice < R) {
    for (int64_t r0 = 0; r0 < R; r0 += slice) {
      DecodeShape part = shape;
      part.rows = std::min(slice, R - r0);
      // (The first slice's passes ask for the next tile; the later slices
      // read this one from L1.)
      decode_keys(part, src, j_begin, j_end, scratch_rows(s, r0, H), state_rows(st, r0, Hvp),
                  ask_until, first_asked || r0 > 0);
    }
    return;
  }
  const bool bf16_dot = decode_uses_bf16_dot<Element>(H);
  // The rows' union interval within [j_begin, j_end).
  int64_t first = j_end, last = j_begin;
  for (int64_t i = 0; i < R; ++i) {
    if (s.key_begin[i] < s.key_end[i]) {
      first = std::min(first, s.key_begin[i]);
      last = std::max(last, s.key_end[i]);
    }
  }
#if defined(JAXOPS_FEW_ROWS_DECODE)
  // How far the few-rows passes ask ahead: past j_end up to ask_until where
  // the rows attend (last is still their union's end here).
  const int64_t ahead = std::max(std::min(last, j_end), std::min(ask_until, last));
#endif
  first = std::max(first, j_begin);
  last = std::min(last, j_end);
#if defined(JAXOPS_FEW_ROWS_DECODE)
  // The few-rows kernels take every element type but bfloat16 on the dot
  // path without the pair kernels: they convert rows in registers (or read
  // float32 rows as they lie) and spread the next tile's prefetches over
  // their products. On this core's driver (2 threads, the walk, 8 x 8 groups
  // x 4096 keys, H = 128, alternated, GB/s) they beat the general path: float32
  // 4 rows dense 17.8-17.9 -> 21.3-21.4, pages of 16 13.8-15.7 -> 16.1-16.9,
  // 1 row 19.6-20.4 -> 20.5-23.4, one kv head (no walk) 13.3-15.6 ->
  // 17.3-23.0; the pair kernels (bfloat16 against the dot path's general
  // kernels, 4 rows 8.6-9.2 -> 13.1, 1 row 11.4 -> 15.9, 16 rows 3.7 -> 4.3;
  // int8 against the float32 few-rows kernels, 4 rows 8.4-9.1 -> 9.9-11.3).
  // (Before the walk, float32 and a first vdpbf16ps version had measured
  // slower here than the general path: paged float32 19.9, 20.9, 20.4 against
  // 14.4, 16.6, 18.5 GB/s.)
  {
    const bool pairs = decode_uses_pair_kernels<Element>(shape);
    if ((pairs || !bf16_dot) && few_rows_fit(R, H) && few_rows_fit(R, Hv)) {
      with_chunk_count(R, [&](auto rows) {
        if constexpr (rows() > 0) {
          using Kind = typename PairKind<Element>::type;
          if constexpr (!std::is_void_v<Kind>) {
            if (pairs) {
              return decode_keys_few_rows<rows(), Kind>(shape, src, first, last, ahead,
                                                         first_asked, s, st);
            }
          }
          decode_keys_few_rows<rows(), void>(shape, src, first, last, ahead, first_asked, s,
                                             st);
        }
      });
      return;
    }
  }
#endif

  // Rows read where they lie when uniformly strided (else converted, and
  // a shorter tile would only add per-tile work).
  const bool reads_in_place = (std::is_same_v<Element, float> && H == Hp) || bf16_dot;
  const float* k_ptr[kDecodeKeyTile];
  for (int64_t j0 = first, jn = 0; j0 < last; j0 += jn) {
    jn = std::min(Bc, last - j0);
    if (reads_in_place) jn = uniform_tile_length(src, j0, jn);
    // The next tile's rows, asked for now: each row of a kv head is often a
    // page or more from the previous one, where hardware prefetchers stop.
    // Key by key, each row looked up: issued a run at a time (for_each_run),
    // the same prefetches came closer together and paged float32 decode ran
    // 5-10% slower (a stand-alone driver, three alternating rounds).
    for (int64_t j = j0 + jn; j < std::min(last, j0 + jn + Bc); ++j) {
      ask_for_rows(src.key(j), H * static_cast<int64_t>(sizeof(Element)), src.value(j),
                   Hv * static_cast<int64_t>(sizeof(Element)));
    }
    const int64_t stride = src.uniform_stride(j0, jn);
    const int64_t v_stride = src.uniform_value_stride(j0, jn);

    // Scores of every row against the tile.
    bool scored = false;
    if (rows_along_lanes(R)) {
      const int64_t Rp = round_up(R, kLanes);
#if defined(JAXOPS_BF16_DOT)
      if (bf16_dot && stride > 0) {
        dot_gemm<Update::kOverwrite>(jn, Rp, H / 2,
                                     reinterpret_cast<const uint32_t*>(src.key(j0)), stride / 2,
                                     1, s.q_pairs_t, Rp, s.scores_t, Rp);
        scored = true;
      }
#endif
      if (!scored) {
        // The product reads H elements of each key row: in place at any H.
        int64_t ld;
        const float* k_tile = float_tile<true>(src, j0, jn, stride > 0, H, s.k_rows, &ld);
        gemm<Update::kOverwrite>(jn, Rp, H, k_tile, ld, 1, s.q_t, Rp, s.scores_t, Rp);
        scored = true;
      }
      for (int64_t j = 0; j < jn; ++j) {
        for (int64_t i = 0; i < R; ++i) s.scores[i * Bc + j] = s.scores_t[j * Rp + i];
      }
    }
#if defined(JAXOPS_BF16_DOT)
    if (bf16_dot && !scored) {
      const uint16_t* kb[kDecodeKeyTile];
      for (int64_t j = 0; j < jn; ++j) kb[j] = reinterpret_cast<const uint16_t*>(src.key(j0 + j));
      with_chunk_count(H / 32, [&](auto chunks) {
        for (int64_t i = 0; i < R; ++i) {
          bf16_scores<chunks()>(s.q_pairs + i * (H / 2), H / 32, kb, jn, s.scores + i * Bc);
        }
      });
    }
#endif
    if (!bf16_dot && !scored) {
      // The dot products read Hp elements of each key row, which need not be
      // uniformly strided: float rows in place when H == Hp.
      bool in_place = false;
      if constexpr (std::is_same_v<Element, float>) {
        if (H == Hp) {
          for (int64_t j = 0; j < jn; ++j) k_ptr[j] = src.key(j0 + j);
          in_place = true;
        }
      }
      if (!in_place) {
        int64_t ld;
        const float* k_tile = float_tile<true>(src, j0, jn, false, H, s.k_rows, &ld);
        for (int64_t j = 0; j < jn; ++j) k_ptr[j] = k_tile + j * ld;
      }
      with_chunk_count(Hp / kLanes, [&](auto chunks) {
        for (int64_t i = 0; i < R; ++i) {
          float_scores<chunks()>(s.q + i * Hp, Hp / kLanes, k_ptr, jn, s.scores + i * Bc);
        }
      });
    }

    softmax_tile(shape, j0, jn, s, st);

    // Values: o += P V.
#if defined(JAXOPS_BF16_DOT)
    if (bf16_dot && v_stride > 0 && decode_uses_bf16_dot<Element>(Hv)) {
      for (int64_t i = 0; i < R; ++i) {
        pack_probability_row(s.scores + i * Bc, round_up(jn, kLanes), s.p_bf16 + i * Bc);
      }
      pack_value_pairs(reinterpret_cast<const uint16_t*>(src.value(j0)), v_stride, jn, Hv,
                       s.v_pairs);
      dot_gemm<Update::kAdd>(R, Hv, (jn + 1) / 2, reinterpret_cast<const uint32_t*>(s.p_bf16),
                             Bc / 2, 1, s.v_pairs, Hv, st.o, Hvp);
      continue;
    }
#endif
    // The product reads Hvp elements of each value row: in place when Hv == Hvp.
    int64_t ldv;
    const float* v_rows =
        float_tile<false>(src, j0, jn, v_stride > 0 && Hv == Hvp, Hv, s.v_rows, &ldv);
    gemm<Update::kAdd>(R, Hvp, jn, s.scores, Bc, 1, v_rows, ldv, st.o, Hvp);
  }
}

// After s.q holds the rows' queries: the bf16 pairs the bf16 dot path reads,
// the fixed-point rows the int8 kernels read.
template <typename Element>
inline void prepare_decode_queries(const DecodeShape& shape, const DecodeScratch& s) {
  const int64_t R = shape.rows, H = shape.head_dim, Hp = decode_padded_dim(H);
  const int64_t Rp = round_up(R, kLanes);
#if defined(JAXOPS_PAIR_KERNELS)
  if (std::is_same_v<Element, int8_t> && decode_uses_pair_kernels<Element>(shape)) {
    quantize_query_rows(s.q, Hp, R, H, s.q_fixed, s.q_fixed_scale);
  }
#endif
  if (rows_along_lanes(R)) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < Rp; ++i) s.q_t[h * Rp + i] = i < R ? s.q[i * Hp + h] : 0.0f;
    }
  }
#if defined(JAXOPS_BF16_DOT)
  if (decode_uses_bf16_dot<Element>(H)) {
    for (int64_t i = 0; i < R; ++i) pack_query_pairs(s.q + i * Hp, H, s.q_pairs + i * (H / 2));
    if (rows_along_lanes(R)) {
      for (int64_t hp = 0; hp < H / 2; ++hp) {
        for (int64_t i = 0; i < Rp; ++i) {
          s.q_pairs_t[hp * Rp + i] = i < R ? s.q_pairs[i * (H / 2) + hp] : 0u;
        }
      }
    }
  }
#endif
}

// into = into (+) part, row by row: the state over the union of their keys.
inline void merge_decode_state(const DecodeShape& shape, const DecodeState& part,
                               const DecodeState& into) {
  const int64_t Hp = decode_padded_dim(decode_value_dim(shape));
  for (int64_t i = 0; i < shape.rows; ++i) {
    const float m_a = into.m[i], m_b = part.m[i];
    if (m_b == -kInf && !std::isnan(part.l[i])) continue;  // part saw no key
    const float m = std::max(m_a, m_b);
    const float shift = m == -kInf ? 0.0f : m;
    const float alpha = m_a == -kInf ? 0.0f : std::exp2(m_a - shift);
    const float beta = m_b == -kInf ? 0.0f : std::exp2(m_b - shift);
    into.m[i] = m;
    into.l[i] = into.l[i] * alpha + part.l[i] * beta;
    float* o = into.o + i * Hp;
    const float* po = part.o + i * Hp;
    const VecF a = vsplat(alpha), b = vsplat(beta);
    for (int64_t h = 0; h < Hp; h += kLanes) vstore(o + h, vload(o + h) * a + vload(po + h) * b);
  }
}

// Row i's normalised output (value_dim floats into out_row) and natural-log
// logsumexp: 0 and -inf for a row that attended no key.
inline float finish_decode_row(const DecodeShape& shape, const DecodeState& st, int64_t i,
                               float* out_row) {
  const int64_t Hv = decode_value_dim(shape), Hvp = decode_padded_dim(Hv);
  const float l = st.l[i];
  // l is NaN when a NaN or +inf reached the row's logits: the row is NaN then.
  if (l == 0.0f) {
    std::fill(out_row, out_row + Hv, 0.0f);
    return -kInf;
  }
  const float inv = 1.0f / l;
  const float* o = st.o + i * Hvp;
  for (int64_t h = 0; h < Hv; ++h) out_row[h] = o[h] * inv;
  const float shift = st.m[i] == -kInf ? 0.0f : st.m[i];
  return (shift + std::log2(l)) * kLn2;
}

// ---------------------------------------------------------------------------
// The parallel driver: `groups` independent problems of one shape.

// How many groups run_decode walks together: the shape's groups_per_walk
// when it divides the group count, else 1.
//
// Why walk a sequence's kv heads together: in a [.., S, K, H] cache (dense, or
// a page of one) the rows of one head are K * H elements apart, 1-4 KiB, so a
// head alone reads a few lines per 4 KiB page, too few for the hardware
// prefetchers, and each line costs the memory's full latency; software
// prefetches of the next tile's rows did not make up for it (they take the
// same few line-fill buffers). Walking the keys a tile at a time through
// every head of the sequence reads each block of keys whole, in memory order.
// Measured (a stand-alone driver of this core, 2 threads, B = 8 sequences x
// 4096 keys, 8 kv heads x 4 rows, H = 128, both orders alternated in 5
// rounds, GB/s): dense float32 11.1 -> 17.9, bfloat16 9.7 -> 12.6, int8 8.5
// -> 9.1; pages of 16 keys in shuffled order float32 11.1 -> 16.2, bfloat16
// 8.4 -> 11.7, int8 7.4 -> 9.7.
inline int64_t decode_walk_width(int64_t groups, const DecodeShape& shape) {
  const int64_t width = shape.groups_per_walk;
  return width > 1 && groups % width == 0 ? width : 1;
}

// Key splits per walk: enough work items for every thread (two each) when
// the walks alone are too few, never splits shorter than kMinKeysPerSplit
// keys of max_keys (the longest key range a group can have). Depends on the
// shape and the thread count only, so the results do too (deterministic).
inline int64_t decode_key_splits(int64_t walks, int64_t max_keys, int threads) {
  if (threads <= 1 || walks <= 0 || walks >= 2 * static_cast<int64_t>(threads)) return 1;
  const int64_t wanted = ceil_div(2 * static_cast<int64_t>(threads), walks);
  return std::max<int64_t>(1, std::min(wanted, max_keys / kMinKeysPerSplit));
}

// One thread's scratch: a DecodeScratch per group of a walk, sharing one set
// of tile buffers.
inline std::vector<DecodeScratch> carve_walk_scratch(const DecodeShape& shape, int64_t width,
                                                     Arena& arena) {
  std::vector<DecodeScratch> s(width);
  for (int64_t h = 0; h < width; ++h) {
    s[h] = carve_decode_scratch(shape, arena, h > 0 ? &s[0] : nullptr);
  }
  return s;
}

// Bytes of one thread's scratch and of one partial state. Every take is a
// multiple of 64 bytes, so these are the same at any 64-byte aligned base:
// the workspace holds the threads' scratch one after another, then the
// partial states.
inline size_t walk_scratch_bytes(const DecodeShape& shape, int64_t width) {
  Arena measure(nullptr);
  carve_walk_scratch(shape, width, measure);
  return measure.used();
}
inline size_t decode_state_bytes(const DecodeShape& shape) {
  Arena measure(nullptr);
  carve_decode_state(shape.rows, decode_value_dim(shape), measure);
  return measure.used();
}

inline size_t decode_workspace_bytes(int64_t groups, const DecodeShape& shape,
                                     int64_t max_keys, int threads) {
  const int64_t width = decode_walk_width(groups, shape);
  const int64_t splits = decode_key_splits(groups / width, max_keys, threads);
  const size_t partials = splits > 1 ? static_cast<size_t>(groups * splits) : 0;
  // + 64: the workspace's own alignment.
  return static_cast<size_t>(threads) * walk_scratch_bytes(shape, width) +
         partials * decode_state_bytes(shape) + 64;
}

// Runs every group on `threads` OpenMP threads with the workspace
// decode_workspace_bytes gave for the same arguments. max_keys bounds every
// row's key_end (the source's key count). A work item is a walk (width
// consecutive groups, decode_walk_width) over one key split: its groups take
// each tile of keys in turn. A split group's partial states are merged in key
// order by one thread: the result does not depend on which thread ran which
// split.
template <typename Groups>
void run_decode(const Groups& groups_fn, int64_t groups, const DecodeShape& shape,
                int64_t max_keys, int threads, void* workspace) {
  using Source = typename Groups::Source;
  using Element = typename Source::Element;
  const int64_t width = decode_walk_width(groups, shape), walks = groups / width;
  const int64_t splits = decode_key_splits(walks, max_keys, threads);
  const int64_t R = shape.rows, Hp = decode_padded_dim(shape.head_dim);
  // The workspace's layout (decode_workspace_bytes): thread t's scratch t
  // walk scratches in, the partial states after every thread's.
  const size_t walk_bytes = walk_scratch_bytes(shape, width);
  const size_t state_bytes = decode_state_bytes(shape);
  char* const aligned = static_cast<char*>(workspace) + Arena(workspace).used();
#pragma omp parallel num_threads(threads)
  {
    Arena arena(aligned + static_cast<size_t>(omp_get_thread_num()) * walk_bytes);
    std::vector<DecodeScratch> s = carve_walk_scratch(shape, width, arena);
    std::vector<Source> sources(width);
    std::vector<DecodeState> states(width);  // the groups' states of the item at hand
    char* const first_state = aligned + static_cast<size_t>(omp_get_num_threads()) * walk_bytes;
    // Group g's state over key split `split`.
    auto partial = [&](int64_t g, int64_t split) {
      Arena at(first_state + static_cast<size_t>(g * splits + split) * state_bytes);
      return carve_decode_state(R, decode_value_dim(shape), at);
    };
    auto store_rows = [&](int64_t g, const DecodeState& st) {
      for (int64_t i = 0; i < R; ++i) {
        const float lse = finish_decode_row(shape, st, i, s[0].out_row);
        groups_fn.store(g, i, s[0].out_row, lse);
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < walks * splits; ++item) {
      const int64_t walk = item / splits, split = item % splits;
      // The walk's union interval of keys.
      int64_t first = max_keys, last = 0;
      for (int64_t h = 0; h < width; ++h) {
        const DecodeScratch& sh = s[h];
        sources[h] = groups_fn.setup(walk * width + h, sh.q, Hp, sh.key_begin, sh.key_end);
        for (int64_t i = 0; i < R; ++i) {
          std::fill(sh.q + i * Hp + shape.head_dim, sh.q + (i + 1) * Hp, 0.0f);
          sh.key_begin[i] = std::clamp<int64_t>(sh.key_begin[i], 0, max_keys);
          sh.key_end[i] = std::clamp<int64_t>(sh.key_end[i], 0, max_keys);
          if (sh.key_begin[i] < sh.key_end[i]) {
            first = std::min(first, sh.key_begin[i]);
            last = std::max(last, sh.key_end[i]);
          }
        }
        prepare_decode_queries<Element>(shape, sh);
      }
      if (first > last) first = last = 0;
      // This split's share of it, in whole tiles.
      const int64_t per = round_up(ceil_div(last - first, splits), kDecodeKeyTile);
      const int64_t j_begin = std::min(last, first + split * per);
      const int64_t j_end = std::min(last, j_begin + per);
      for (int64_t h = 0; h < width; ++h) {
        states[h] = splits > 1 ? partial(walk * width + h, split) : s[h].state;
        reset_decode_state(shape, states[h]);
      }
      if (width == 1) {
        decode_keys(shape, sources[0], j_begin, j_end, s[0], states[0]);
      } else {
        for (int64_t j0 = j_begin; j0 < j_end; j0 += kDecodeKeyTile) {
          const int64_t j1 = std::min(j_end, j0 + kDecodeKeyTile);
          // Each group's passes over this tile ask for its rows of the next.
          const int64_t ask_until = std::min(j_end, j1 + kDecodeKeyTile);
          for (int64_t h = 0; h < width; ++h) {
            decode_keys(shape, sources[h], j0, j1, s[h], states[h], ask_until, j0 > j_begin);
          }
        }
      }
      if (splits == 1) {
        for (int64_t h = 0; h < width; ++h) store_rows(walk * width + h, states[h]);
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; ++g) {
        reset_decode_state(shape, s[0].state);
        for (int64_t split = 0; split < splits; ++split) {
          merge_decode_state(shape, partial(g, split), s[0].state);
        }
        store_rows(g, s[0].state);
      }
    }
  }
}

}  // namespace jaxops::cpu::kv_decode
