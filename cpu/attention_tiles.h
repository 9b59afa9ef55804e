// Building blocks of the CPU attention kernels that more than one pass uses
// (cpu/attention_forward.cc, cpu/attention_decode.cc, cpu/attention_backward.cc,
// cpu/attention_jvp.cc): the problem geometry and scratch arena, masking and
// logits, the online softmax and the row tiles of the forward-shaped passes,
// over the SIMD layer (cpu/simd.h), the row conversions (cpu/float_convert.h)
// and the register-blocked products (cpu/gemm_microkernels.h). Internal to
// cpu/: not part of the kernels' contract (cpu/attention.h).
//
// Scores are kept in log2 units (x = logit * log2(e)) so the exponential is
// exp2. A masked score is -inf; a row whose running max is -inf uses 0 as its
// shift, so exp2 never sees -inf - -inf.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/attention.h"
#include "cpu/float_convert.h"
#include "cpu/gemm_microkernels.h"
#include "cpu/simd.h"

namespace jaxops::cpu::attention_internal {

using namespace simd;
using namespace microkernels;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kInf = std::numeric_limits<float>::infinity();

// Query rows per tile (a multiple of every lane count) and keys per tile of
// the forward-shaped passes.
inline constexpr int64_t kRowTile = 64;
inline constexpr int64_t kKeyTile = 64;

// ---------------------------------------------------------------------------
// Problem geometry and the attended key interval of each query row.

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
constexpr int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

inline int thread_count(const AttentionParams& p) {
  return p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
}

// The most bytes of rows a thread keeps converted to float for a kv head or a
// work item (KvHeadRows, the backward's query-side rows), which every
// thread's workspace holds: 8 MiB is a head's K and V at S = 8192, H = 128.
// All threads together keep at most 64 MiB (twice that in the forward mode,
// which keeps the tangents of K and V as well), so that a many-core machine's
// workspace stays a small part of the operands (at 64 threads, 1 MiB each: a
// head's K and V at S = 2048, H = 64). Longer rows are converted tile by
// tile, as they were before.
inline int64_t held_row_budget(const AttentionParams& p) {
  constexpr int64_t kPerThread = int64_t{8} << 20, kAllThreads = int64_t{64} << 20;
  return std::min(kPerThread, kAllThreads / std::max(thread_count(p), 1));
}

struct Geometry {
  int64_t B, T, S, N, K, H, G, Hp;
  int64_t Hv, Hvp;  // the value head dim (of value, out and their gradients), padded
  int64_t offset;  // *p.query_offset: the operand is host memory here, read once per call
  bool causal;
  int64_t window_left, window_right;
  const int32_t* q_lengths;
  const int32_t* kv_lengths;
  float soft_cap;           // > 0: logits capped (natural units); 0: none
  const int32_t* q_segments;   // [B, T] or null
  const int32_t* kv_segments;  // [B, S] or null (null exactly when q_segments is)
  int64_t held_row_bytes;      // the most bytes of converted rows a thread keeps (held_row_budget)

  explicit Geometry(const AttentionParams& p)
      : B(p.batch), T(p.q_len), S(p.kv_len), N(p.num_heads), K(p.num_kv_heads),
        H(p.head_dim), G(p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0),
        Hp(round_up(p.head_dim, kLanes)), Hv(params::value_head_dim(p)),
        Hvp(round_up(params::value_head_dim(p), kLanes)), offset(*p.query_offset),
        causal(p.is_causal), window_left(p.window_left), window_right(p.window_right),
        q_lengths(p.q_seq_lengths), kv_lengths(p.kv_seq_lengths), soft_cap(p.logits_soft_cap),
        q_segments(p.q_segment_ids), kv_segments(p.q_segment_ids ? p.kv_segment_ids : nullptr),
        held_row_bytes(held_row_budget(p)) {}

  int64_t q_valid(int64_t b) const {
    return q_lengths ? std::clamp<int64_t>(q_lengths[b], 0, T) : T;
  }
  int64_t kv_valid(int64_t b) const {
    return kv_lengths ? std::clamp<int64_t>(kv_lengths[b], 0, S) : S;
  }
  // Row t attends keys [lo(t), hi(t)) before the elementwise mask; both bounds
  // are non-decreasing in t, so a tile of rows spans [lo(first), hi(last)).
  int64_t lo(int64_t t) const {
    return window_left < 0 ? 0 : std::clamp<int64_t>(t + offset - window_left, 0, S);
  }
  int64_t hi(int64_t t, int64_t kv_valid_len) const {
    int64_t h = kv_valid_len;
    if (causal) h = std::min(h, t + offset + 1);
    if (window_right >= 0) h = std::min(h, t + offset + window_right + 1);
    return std::clamp<int64_t>(h, 0, S);
  }
  const int32_t* q_ids(int64_t b) const { return q_segments + b * T; }
  const int32_t* kv_ids(int64_t b) const { return kv_segments + b * S; }
};

// The segment ids of a run of rows or keys: [lo, hi]. Two runs can attend each
// other only where their ranges meet, so a tile pair whose ranges are
// disjoint is skipped whole, before any product: with packed documents
// (ids ascending along the sequence) attention then costs about the sum of
// the documents' own. Taken per tile as it is visited: a tile's n ids are
// read once against the n * H multiply-adds of its products.
struct IdRange {
  int32_t lo = std::numeric_limits<int32_t>::max();
  int32_t hi = std::numeric_limits<int32_t>::min();

  static IdRange of(const int32_t* ids, int64_t n) {
    IdRange r;
    for (int64_t i = 0; i < n; ++i) {
      r.lo = std::min(r.lo, ids[i]);
      r.hi = std::max(r.hi, ids[i]);
    }
    return r;
  }
  void add(int32_t id) {
    lo = std::min(lo, id);
    hi = std::max(hi, id);
  }
  bool meets(const IdRange& o) const { return lo <= o.hi && o.lo <= hi; }
  // Every id of both runs is the same: no element needs its own test.
  bool same_single(const IdRange& o) const { return lo == hi && o.lo == o.hi && lo == o.lo; }
};

// The segment test a tile of rows against keys j0 .. j0 + jn needs: none
// (no ids, or one id on both sides), or the key ids to compare elementwise.
// `skip`: no row of the tile shares an id with these keys.
struct TileSegments {
  bool skip = false;
  const int32_t* key_ids = nullptr;  // ids of keys j0..; null: no elementwise test
};

// The same from the two ranges: rows' ids against the keys' (whose ids are key_ids).
inline TileSegments segments_between(const IdRange& rows, const IdRange& keys,
                                     const int32_t* key_ids) {
  TileSegments ts;
  ts.skip = !rows.meets(keys);
  if (!ts.skip && !rows.same_single(keys)) ts.key_ids = key_ids;
  return ts;
}

inline TileSegments tile_segments(const Geometry& g, int64_t b, const IdRange& rows, int64_t j0,
                                  int64_t jn) {
  if (!g.q_segments || jn <= 0) return TileSegments{};
  const int32_t* ids = g.kv_ids(b) + j0;
  return segments_between(rows, IdRange::of(ids, jn), ids);
}

// tanh(x / c), c > 0: sign(x) (1 - e) / (1 + e) with e = exp(-2 |x| / c) <= 1,
// vexp2's range (no overflow at any x). minus_two_over_c_log2 = -2 log2(e) / c.
inline VecF tanh_of_ratio(VecF x, VecF minus_two_over_c_log2) {
  const VecF ax = vmax(x, -x);
  const VecF e = vexp2(ax * minus_two_over_c_log2);
  const VecF t = (vsplat(1.0f) - e) * vreciprocal_1_2(vsplat(1.0f) + e);
  return x < VecF{} ? -t : t;
}

// The soft cap on log2-unit logits x = s log2(e): cap tanh(s / cap) log2(e) is
// C tanh(x / C) with C = cap log2(e). `width` floats from x (a multiple of
// kLanes). With `slope`, also the derivative 1 - tanh^2 of each capped logit
// with respect to its uncapped one, written to slope (the backward's and the
// forward mode's chain rule); with `tangent`, the tangents are multiplied by
// it in place instead.
inline void soft_cap_logits(float cap, float* x, int64_t width, float* slope = nullptr,
                            float* tangent = nullptr) {
  const float c = cap * kLog2e;
  const VecF cv = vsplat(c), k = vsplat(-2.0f * kLog2e / c), one = vsplat(1.0f);
  for (int64_t j = 0; j < width; j += kLanes) {
    const VecF t = tanh_of_ratio(vload(x + j), k);
    vstore(x + j, cv * t);
    if (slope) vstore(slope + j, one - t * t);
    if (tangent) vstore(tangent + j, vload(tangent + j) * (one - t * t));
  }
}

// Carves 64-byte aligned arrays out of a workspace; with a null base it only
// measures, so size functions and kernels share one layout description.
class Arena {
 public:
  explicit Arena(void* base) : base_(reinterpret_cast<uintptr_t>(base)) {
    if (base_) used_ = round_up(base_, 64) - base_;
  }
  template <typename U>
  U* take(int64_t count) {
    U* result = reinterpret_cast<U*>(base_ + used_);
    used_ += round_up(std::max<int64_t>(count, 1) * sizeof(U), 64);
    return result;
  }
  size_t used() const { return used_; }

 private:
  uintptr_t base_;
  size_t used_ = 0;
};

// Keys j0 .. j0 + jn of one kv head of a [B, S, K, d] tensor (d: H for keys,
// Hv for values) converted to float rows of stride ld (zero-padded from d to ld).
template <typename T>
inline void load_kv_tile(const Geometry& g, const T* src, int64_t d, int64_t b, int64_t kh,
                         int64_t j0, int64_t jn, float* dst, int64_t ld) {
  for (int64_t j = 0; j < jn; ++j) {
    load_row(src + ((b * g.S + j0 + j) * g.K + kh) * d, dst + j * ld, d);
    std::fill(dst + j * ld + d, dst + (j + 1) * ld, 0.0f);
  }
}

// Asks for `rows` rows of row_bytes, stride_bytes apart, to be brought into
// the L2 cache while the current tile is computed. Hardware prefetchers do not
// cross a 4 KiB page, so rows 2 KiB or more apart (a head's keys when K * H
// elements reach 2 KiB, as at (1, 4096, 8, 128) in bfloat16) leave them one or
// two rows per page, too few to start on. Measured (2026-11-27, alternating
// builds; docs/benchmarks-log.md, fifth pass): decoding 4 tokens against [8, 4096, 8,
// 128] caches, float32 rows 4 KiB apart 40 -> 25 ms and, with the threshold
// lowered from 4 KiB to 2 KiB, bfloat16 rows 2 KiB apart 17 -> 11 ms; the
// training-shaped forward, backward and JVP at 2 and 3 KiB strides within
// +-3%. (Earlier measurements of this function were taken while GCC deleted
// its prefetches; see simd::prefetch.)
inline void prefetch_rows(const void* first, int64_t rows, int64_t stride_bytes, int64_t row_bytes) {
  constexpr int64_t kMinStrideBytes = 2048, kLineBytes = 64;
  if (stride_bytes < kMinStrideBytes) return;
  const char* row = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r, row += stride_bytes) {
    for (int64_t at = 0; at < row_bytes; at += kLineBytes) simd::prefetch<2>(row + at);
  }
}

// prefetch_rows for keys j0 .. j0 + jn of one kv head of a [B, S, K, d] tensor.
template <typename T>
inline void prefetch_kv_rows(const Geometry& g, const T* x, int64_t d, int64_t b, int64_t kh,
                             int64_t j0, int64_t jn) {
  prefetch_rows(x + ((b * g.S + j0) * g.K + kh) * d, jn, g.K * d * static_cast<int64_t>(sizeof(T)),
                d * static_cast<int64_t>(sizeof(T)));
}

// The same in K ([.., H]) and V ([.., Hv]).
template <typename T>
inline void prefetch_kv_tile(const Geometry& g, const T* k, const T* v, int64_t b, int64_t kh,
                             int64_t j0, int64_t jn) {
  prefetch_kv_rows(g, k, g.H, b, kh, j0, jn);
  prefetch_kv_rows(g, v, g.Hv, b, kh, j0, jn);
}

// Adds bias[b, n[i], t[i], j0 + j] * log2(e) (read through the four element
// strides s) to a transposed tile x[j][i] of rows i < rows.
inline void add_bias_tile(const float* bias, const int64_t* s, int64_t b, const int64_t* n,
                          const int64_t* t, int64_t rows, int64_t j0, int64_t jn, float* x,
                          int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = bias + b * s[0] + n[i] * s[1] + t[i] * s[2] + j0 * s[3];
    for (int64_t j = 0; j < jn; ++j) x[j * ld + i] += row[j * s[3]] * kLog2e;
  }
}

// Adds bias and applies the boolean mask to a transposed tile of scaled scores
// st[j][i] (log2 units) for rows i < rows whose (head, query index) are n[i], t[i].
inline void apply_bias_and_mask(const AttentionParams& p, int64_t b, const int64_t* n,
                                const int64_t* t, int64_t rows, int64_t j0, int64_t jn,
                                float* st, int64_t ld) {
  if (p.bias) add_bias_tile(p.bias, p.bias_strides, b, n, t, rows, j0, jn, st, ld);
  if (p.mask) {
    const int64_t* s = p.mask_strides;
    for (int64_t i = 0; i < rows; ++i) {
      const uint8_t* row = p.mask + b * s[0] + n[i] * s[1] + t[i] * s[2] + j0 * s[3];
      for (int64_t j = 0; j < jn; ++j) {
        if (!row[j * s[3]]) st[j * ld + i] = -kInf;
      }
    }
  }
}

// Turns scores st[j][i] = q_i . k_j of keys j0.. into log2-unit logits, in
// the order every path follows (docs/design.md): the scale (unless `scaled`:
// the queries were multiplied by it already), the soft cap, the bias, then the
// masks: boolean mask, segment ids (with key_ids, the ids of keys j0..:
// row i attends key j only where row_ids[i] == key_ids[j]) and, unless the
// tile lies inside every row's interval, the [lo, hi) interval of each row.
// With dst (the forward mode), the logits' tangents in dst are multiplied by
// the cap's slope.
inline void scores_to_logits(const AttentionParams& p, const Geometry& g, int64_t b,
                             const int64_t* n, const int64_t* t, int64_t rows, const int32_t* lo,
                             const int32_t* hi, bool inside, bool scaled, int64_t j0, int64_t jn,
                             int64_t width, float* st, const int32_t* row_ids = nullptr,
                             const int32_t* key_ids = nullptr, float* dst = nullptr) {
  if (!scaled) {
    const VecF c = vsplat(p.scale * kLog2e);
    for (int64_t j = 0; j < jn; ++j) {
      for (int64_t v = 0; v < width; v += kLanes) vstore(st + j * width + v, vload(st + j * width + v) * c);
    }
  }
  if (g.soft_cap > 0.0f) soft_cap_logits(g.soft_cap, st, jn * width, nullptr, dst);
  if (p.bias || p.mask) apply_bias_and_mask(p, b, n, t, rows, j0, jn, st, width);
  const VecF masked = vsplat(-kInf);
  if (key_ids) {
    for (int64_t v = 0; v < width; v += kLanes) {
      const VecI ids = vloadi(row_ids + v);
      for (int64_t j = 0; j < jn; ++j) {
        const VecI same = ids == vsplati(key_ids[j]);
        vstore(st + j * width + v, same ? vload(st + j * width + v) : masked);
      }
    }
  }
  if (!inside) {
    for (int64_t v = 0; v < width; v += kLanes) {
      const VecI lo_v = vloadi(lo + v), hi_v = vloadi(hi + v);
      for (int64_t j = 0; j < jn; ++j) {
        const VecI key = vsplati(static_cast<int32_t>(j0 + j));
        const VecI keep = (key >= lo_v) & (key < hi_v);
        vstore(st + j * width + v, keep ? vload(st + j * width + v) : masked);
      }
    }
  }
}

// The soft cap of a tile whose logits are final as the product left them (no
// bias, mask or partial interval): the tile (jn rows of width) and its row
// maxima tile_max (width), and the tangents dst when given. tanh is
// increasing, so the capped maximum is the cap of the maximum.
inline void soft_cap_tile_as_computed(const Geometry& g, int64_t jn, int64_t width, float* st,
                                      float* tile_max, float* dst = nullptr) {
  if (!(g.soft_cap > 0.0f)) return;
  soft_cap_logits(g.soft_cap, st, jn * width, nullptr, dst);
  soft_cap_logits(g.soft_cap, tile_max, width);
}

// The row-major counterpart of scores_to_logits (the decode path and the
// backward) for one query row t of head n: row[j] = q . k_j of keys j0 + j
// (j < width, a multiple of kLanes) becomes the log2-unit logit, -inf where
// masked; key_ids (or null) as in scores_to_logits. With slope, also the soft
// cap's slope of each logit (the backward's chain rule; untouched without a
// cap). Columns past jn must lie past the row's interval unless the tile is
// inside every row's interval.
inline void row_logits(const AttentionParams& p, const Geometry& g, int64_t b, int64_t n, int64_t t,
                int64_t kv_valid, int64_t j0, int64_t jn, int64_t width, bool inside,
                const int32_t* key_ids, float* row, float* slope = nullptr) {
  const VecF c = vsplat(p.scale * kLog2e);
  for (int64_t j = 0; j < width; j += kLanes) vstore(row + j, vload(row + j) * c);
  if (g.soft_cap > 0.0f) soft_cap_logits(g.soft_cap, row, width, slope);
  if (p.bias) {
    const int64_t* st = p.bias_strides;
    const float* bias = p.bias + b * st[0] + n * st[1] + t * st[2] + j0 * st[3];
    for (int64_t j = 0; j < jn; ++j) row[j] += bias[j * st[3]] * kLog2e;
  }
  if (p.mask) {
    const int64_t* st = p.mask_strides;
    const uint8_t* mask = p.mask + b * st[0] + n * st[1] + t * st[2] + j0 * st[3];
    for (int64_t j = 0; j < jn; ++j) {
      if (!mask[j * st[3]]) row[j] = -kInf;
    }
  }
  if (key_ids) {
    const int32_t id = g.q_ids(b)[t];
    for (int64_t j = 0; j < jn; ++j) {
      if (key_ids[j] != id) row[j] = -kInf;
    }
  }
  if (!inside) {
    VecI iota;
    for (int l = 0; l < kLanes; ++l) iota[l] = l;
    const VecI lo = vsplati(static_cast<int32_t>(std::clamp<int64_t>(g.lo(t) - j0, -1, width)));
    const VecI hi =
        vsplati(static_cast<int32_t>(std::clamp<int64_t>(g.hi(t, kv_valid) - j0, -1, width)));
    const VecF masked = vsplat(-kInf);
    for (int64_t j = 0; j < width; j += kLanes) {
      const VecI key = iota + static_cast<int32_t>(j);
      vstore(row + j, (key >= lo) & (key < hi) ? vload(row + j) : masked);
    }
  }
}

// ---------------------------------------------------------------------------
// Row tiles of the forward-shaped passes. A work item is one (batch, kv head,
// tile of query rows), where the rows of a kv head enumerate (t, g) pairs
// t-major over its G query heads: heads sharing K/V share every key tile, and
// small T (decoding) still fills the vector lanes with the group's heads.
// Query rows lie along the SIMD lanes and score tiles are stored transposed,
// st[key][row], so the online-softmax statistics are elementwise vector
// operations.

inline int64_t forward_row_tile(const Geometry& g) {
  return std::min<int64_t>(kRowTile, round_up(std::max<int64_t>(g.T * g.G, 1), kLanes));
}

// What a tile of Br rows r0.. of kv head kh attends.
struct RowTile {
  int64_t rows;                // rows of the tile that exist (the rest pad it to Br)
  int64_t q_valid, kv_valid;   // valid query rows and keys of its batch
  int64_t key_begin, key_end;  // the keys its rows attend; empty when none does
  int64_t max_lo, min_hi;      // keys in [max_lo, min_hi) lie in every row's interval
  IdRange ids;                 // segment ids of its valid rows (with segment ids)

  bool attends() const { return key_begin < key_end; }
  bool inside(int64_t j0, int64_t jn) const { return max_lo <= j0 && min_hi >= j0 + jn; }
};

// Fills each row's query index t[i], head n[i], attended key interval
// [lo[i], hi[i]) and, with segment ids, its id ids[i] for i < Br; padding rows
// repeat the last row.
inline RowTile plan_row_tile(const Geometry& g, int64_t b, int64_t kh, int64_t r0, int64_t Br,
                             int64_t* t, int64_t* n, int32_t* lo, int32_t* hi,
                             int32_t* ids = nullptr) {
  RowTile tile;
  tile.rows = std::min(Br, g.T * g.G - r0);
  tile.q_valid = g.q_valid(b);
  tile.kv_valid = g.kv_valid(b);
  int64_t t_first = -1, t_last = -1;
  for (int64_t i = 0; i < Br; ++i) {
    const int64_t r = r0 + std::min(i, tile.rows - 1);
    t[i] = r / g.G;
    n[i] = kh * g.G + r % g.G;
    if (ids && g.q_segments) ids[i] = g.q_ids(b)[t[i]];
    if (i < tile.rows && t[i] < tile.q_valid) {
      lo[i] = static_cast<int32_t>(g.lo(t[i]));
      hi[i] = static_cast<int32_t>(g.hi(t[i], tile.kv_valid));
      if (ids && g.q_segments) tile.ids.add(ids[i]);
      if (t_first < 0) t_first = t[i];
      t_last = t[i];
    } else {
      // Rows whose result is discarded are never masked: they cannot make a
      // tile partial.
      lo[i] = std::numeric_limits<int32_t>::min();
      hi[i] = std::numeric_limits<int32_t>::max();
    }
  }
  tile.key_begin = t_first < 0 ? 0 : g.lo(t_first);
  tile.key_end = t_first < 0 ? 0 : g.hi(t_last, tile.kv_valid);
  tile.max_lo = t_first < 0 ? 0 : g.lo(t_last);
  tile.min_hi = t_first < 0 ? 0 : g.hi(t_first, tile.kv_valid);
  return tile;
}

// The first key tile at or after j0 (tiles of kKeyTile keys, as the row
// tile's loop steps them) that the row tile's segment ids may attend; the
// tile's key_end when there is none. The loops step by it, so that the tile
// they ask the caches for next is one they will read: over packed documents
// most tiles before a row tile's document are skipped.
inline int64_t next_attended_tile(const Geometry& g, int64_t b, const RowTile& tile, int64_t j0) {
  if (!g.q_segments) return j0;
  for (; j0 < tile.key_end; j0 += kKeyTile) {
    const int64_t jn = std::min(kKeyTile, tile.key_end - j0);
    if (tile.ids.meets(IdRange::of(g.kv_ids(b) + j0, jn))) return j0;
  }
  return tile.key_end;
}

// Asks for the tile's rows (i < rows) of a [B, T, N, d] tensor to be brought
// into the L1 cache, for reading or (kForWrite) writing. The row loops that
// read (transpose_query_tile) or write a tile's rows otherwise wait for one
// row's cache misses after another; asked for together, the misses overlap.
template <bool kForWrite, typename T>
inline void prefetch_tile_rows(const Geometry& g, const T* x, int64_t d, int64_t b,
                               const int64_t* t, const int64_t* n, int64_t rows) {
  constexpr int64_t kLineBytes = 64;
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = reinterpret_cast<const char*>(x + ((b * g.T + t[i]) * g.N + n[i]) * d);
    for (int64_t at = 0; at < d * static_cast<int64_t>(sizeof(T)); at += kLineBytes) {
      simd::prefetch<3, kForWrite>(row + at);
    }
  }
}

// The tile's rows of a [B, T, N, H] query-side tensor, times `scale`,
// transposed into xt[h][i] (Br columns; padding rows are zero).
template <typename T>
inline void transpose_query_tile(const Geometry& g, const T* x, int64_t b, const int64_t* t,
                                 const int64_t* n, int64_t rows, int64_t Br, float scale,
                                 float* row, float* xt) {
  for (int64_t i = 0; i < Br; ++i) {
    if (i < rows) {
      load_row(x + ((b * g.T + t[i]) * g.N + n[i]) * g.H, row, g.H);
      for (int64_t h = 0; h < g.H; ++h) xt[h * Br + i] = row[h] * scale;
    } else {
      for (int64_t h = 0; h < g.H; ++h) xt[h * Br + i] = 0.0f;
    }
  }
}

// Keys j0 .. j0 + jn of one kv head of a [B, S, K, d] tensor (d: H or Hv) as
// float rows: float inputs where they are, others converted into buf.
// Returns the first row; *ld is the row stride.
template <typename T>
inline const float* kv_tile_as_float(const Geometry& g, const T* x, int64_t d, int64_t b,
                                     int64_t kh, int64_t j0, int64_t jn, float* buf,
                                     int64_t* ld) {
  if constexpr (std::is_same_v<T, float>) {
    *ld = g.K * d;
    return x + ((b * g.S + j0) * g.K + kh) * d;
  } else {
    load_kv_tile(g, x, d, b, kh, j0, jn, buf, d);
    *ld = d;
    return buf;
  }
}

// One kv head's keys and values as contiguous float rows, kept by a thread
// across the row tiles it computes for that head, so that each key tile is
// converted (or, for float, copied) once per thread and head rather than once
// per row tile: with T * G / Br row tiles per head the per-tile widening of
// bfloat16 K/V was 10% of the AVX2 forward at (1, 2048, 8, 64), its loads
// waiting on the rows' cache misses. Float rows read in place are K * H
// floats apart, 2 or 4 KiB at H = 64 or 128 with 8 kv heads: a key tile's
// rows then fall into a few of the L1's sets and evict each other between the
// products' strips; the copy's rows are contiguous. Key blocks of kKeyTile
// keys are converted on first use (windows and segment ids visit few).
struct KvHeadRows {
  float* k;        // [S][H]
  float* v;        // [S][Hv]
  uint8_t* ready;  // [ceil(S / kKeyTile)] whether a block of keys is converted
  int64_t* head;   // [1] b * K + kh of the rows held; -1: none
};

// Whether the forward-shaped passes keep a KvHeadRows: a head with one row
// tile reads each key tile once either way.
inline bool keeps_kv_head_rows(const Geometry& g, int64_t Br) {
  return g.T * g.G > Br &&
         g.S * (g.H + g.Hv) * static_cast<int64_t>(sizeof(float)) <= g.held_row_bytes;
}

inline KvHeadRows carve_kv_head_rows(const Geometry& g, bool keep, Arena& arena) {
  KvHeadRows c;
  c.k = arena.take<float>(keep ? g.S * g.H : 0);
  c.v = arena.take<float>(keep ? g.S * g.Hv : 0);
  c.ready = arena.take<uint8_t>(keep ? ceil_div(g.S, kKeyTile) : 0);
  c.head = arena.take<int64_t>(1);
  return c;
}

// Asks for every line of keys j0 .. j0 + jn of K and V at once, whatever
// their stride, before a copy reads them row by row.
template <typename T>
inline void prefetch_kv_tile_now(const Geometry& g, const T* k, const T* v, int64_t b, int64_t kh,
                                 int64_t j0, int64_t jn) {
  constexpr int64_t kLineBytes = 64;
  for (int64_t j = 0; j < jn; ++j) {
    const int64_t row = (b * g.S + j0 + j) * g.K + kh;
    if (k) {
      const char* kr = reinterpret_cast<const char*>(k + row * g.H);
      for (int64_t at = 0; at < g.H * static_cast<int64_t>(sizeof(T)); at += kLineBytes) {
        simd::prefetch<3>(kr + at);
      }
    }
    if (v) {
      const char* vr = reinterpret_cast<const char*>(v + row * g.Hv);
      for (int64_t at = 0; at < g.Hv * static_cast<int64_t>(sizeof(T)); at += kLineBytes) {
        simd::prefetch<3>(vr + at);
      }
    }
  }
}

// A row of d elements as floats at dst, zero from d to dp: float rows copied
// a vector at a time (load_row's float copy goes through 16-float chunks the
// AVX2 build moves via the stack), others converted.
template <typename T>
inline void row_as_float(const T* src, int64_t d, int64_t dp, float* dst) {
  int64_t h = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; h + kLanes <= d; h += kLanes) vstore(dst + h, vload(src + h));
    for (; h < d; ++h) dst[h] = src[h];
  } else {
    load_row(src, dst, d);
    h = d;
  }
  for (; h < dp; ++h) dst[h] = 0.0f;
}

template <typename T>
inline void copy_kv_rows(const Geometry& g, const T* src, int64_t d, int64_t b, int64_t kh,
                         int64_t j0, int64_t jn, float* dst) {
  for (int64_t j = 0; j < jn; ++j) {
    row_as_float(src + ((b * g.S + j0 + j) * g.K + kh) * d, d, d, dst + j * d);
  }
}

// Keys j0 .. j0 + jn of kv head kh of batch b in c, converting the blocks
// not converted yet (a null k or v is left out: the forward mode's absent
// tangents).
template <typename T>
inline void hold_kv_rows(const Geometry& g, const T* k, const T* v, int64_t b, int64_t kh,
                         int64_t j0, int64_t jn, const KvHeadRows& c) {
  const int64_t head = b * g.K + kh;
  if (*c.head != head) {
    std::fill(c.ready, c.ready + ceil_div(g.S, kKeyTile), uint8_t{0});
    *c.head = head;
  }
  for (int64_t block = j0 / kKeyTile; block * kKeyTile < j0 + jn; ++block) {
    if (c.ready[block]) continue;
    const int64_t b0 = block * kKeyTile, bn = std::min(kKeyTile, g.S - b0);
    prefetch_kv_tile_now(g, k, v, b, kh, b0, bn);
    if (k) copy_kv_rows(g, k, g.H, b, kh, b0, bn, c.k + b0 * g.H);
    if (v) copy_kv_rows(g, v, g.Hv, b, kh, b0, bn, c.v + b0 * g.Hv);
    c.ready[block] = 1;
  }
}

// Whether hold_kv_rows would convert any of keys j0 .. j0 + jn.
inline bool kv_rows_missing(const Geometry& g, int64_t b, int64_t kh, int64_t j0, int64_t jn,
                            const KvHeadRows& c) {
  if (*c.head != b * g.K + kh) return true;
  for (int64_t block = j0 / kKeyTile; block * kKeyTile < j0 + jn; ++block) {
    if (!c.ready[block]) return true;
  }
  return false;
}

// Online-softmax state of a tile of Br query rows.
struct SoftmaxRows {
  float* m;         // [Br] running max (log2 units)
  float* shift;     // [Br] max used as the exponent shift (0 while the max is -inf)
  float* l;         // [Br] running sum
  float* alpha;     // [Br] rescale of the previous accumulators
  float* tile_max;  // [Br] max of the current tile's logits, when the product gives it
};

inline SoftmaxRows carve_softmax_rows(int64_t Br, Arena& arena) {
  SoftmaxRows s;
  s.m = arena.take<float>(Br);
  s.shift = arena.take<float>(Br);
  s.l = arena.take<float>(Br);
  s.alpha = arena.take<float>(Br);
  s.tile_max = arena.take<float>(Br);
  return s;
}

// What every row tile (forward, decode, JVP) keeps besides its own buffers: a
// head-sized row, the online-softmax state and, per row, its attended key
// interval, segment id, query index and head. The scratch structs derive from it.
struct TileRowState {
  float* row;   // [max(H, Hv)]
  SoftmaxRows stats;
  int32_t* lo;  // [Br] attended key interval
  int32_t* hi;
  int32_t* ids;  // [Br] segment id of each row (with segment ids)
  int64_t* t;   // [Br] query index of each row
  int64_t* n;   // [Br] head of each row
};

inline void carve_tile_row_state(TileRowState& s, const Geometry& g, int64_t Br, Arena& arena) {
  s.row = arena.take<float>(std::max(g.H, g.Hv));
  s.stats = carve_softmax_rows(Br, arena);
  s.lo = arena.take<int32_t>(Br);
  s.hi = arena.take<int32_t>(Br);
  s.ids = arena.take<int32_t>(Br);
  s.t = arena.take<int64_t>(Br);
  s.n = arena.take<int64_t>(Br);
}

// 2^x for the probabilities of the softmax passes, x = logit - shift <= 0
// (-inf where masked): simd::vexp2 with AVX-512; with AVX2 and the generic
// build the same polynomial and rounding in 13 vector operations instead of
// 17, which the probability passes (a tenth of the AVX2 forward) spend per
// vector of logits. The scale 2^n is built from the rounding's own bits
// (t = x + 1.5 * 2^23 holds n in its low mantissa bits) rather than by a
// conversion, and multiplies the polynomial rather than being added to its
// exponent, so that n = -127 (x clamped there, -inf included) gives a scale of
// 0 and no separate test of tiny x. The same as vexp2 for x >= -126; below
// it either is 0 or a value under 2^-126. NaN stays NaN (vmax's x second).
inline VecF exp2_of_shifted(VecF x) {
#if defined(__AVX512F__)
  return vexp2(x);
#else
  typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  const VecF c6 = vsplat(1.533758477307856e-4f), c5 = vsplat(1.3399870367720723e-3f),
             c4 = vsplat(9.618519805371761e-3f), c3 = vsplat(5.550329014658928e-2f),
             c2 = vsplat(0.24022646248340607f), c1 = vsplat(0.6931471824645996f),
             c0 = vsplat(1.0f);
  x = vmax(vsplat(-127.0f), x);
  const VecF round_magic = vsplat(12582912.0f);  // 1.5 * 2^23: adds round to integer
  const VecF t = x + round_magic;
  const VecF n = t - round_magic;
  const VecF f = x - n;
  const VecF poly =
      vfma(vfma(vfma(vfma(vfma(vfma(c6, f, c5), f, c4), f, c3), f, c2), f, c1), f, c0);
  // t's bits are those of 1.5 * 2^23 plus n, whose part above bit 8 the shift
  // drops: the bits of 2^n, 0 at n = -127.
  const VecU scale_bits = ((VecU)t + 127u) << 23;
  return poly * (VecF)scale_bits;
#endif
}

// The running maximum's step of an online softmax for the kLanes rows at c
// of a tile of logits st[j][i] (log2 units, jn keys): the tile's maximum (in
// s.tile_max already with `max_known`), the new running max m and the shift
// (0 for a row that has seen no key, whose m stays -inf), stored with the
// rescale alpha of the earlier accumulators. Shared by online_softmax and the
// forward mode's online_softmax_with_tangent (cpu/attention_jvp.cc).
struct RowMaxStep {
  VecF m_old, m_new, shift, alpha;
};

inline RowMaxStep update_row_max(int64_t jn, int64_t Br, int64_t c, bool max_known,
                                 const float* st, const SoftmaxRows& s) {
  VecF tile_max = vsplat(-kInf);
  if (max_known) {
    tile_max = vload(s.tile_max + c);
  } else {
    for (int64_t j = 0; j < jn; ++j) tile_max = vmax(tile_max, vload(st + j * Br + c));
  }
  const VecF m_old = vload(s.m + c);
  const VecF m_new = vmax(m_old, tile_max);
  const VecF shift = m_new == vsplat(-kInf) ? VecF{} : m_new;
  const VecF alpha = vexp2(m_old - shift);
  vstore(s.m + c, m_new);
  vstore(s.shift + c, shift);
  vstore(s.alpha + c, alpha);
  return {m_old, m_new, shift, alpha};
}

// Online softmax over one tile of logits st[j][i] (log2 units, jn keys): updates
// the running max m, the shift, the rescale alpha of earlier accumulators and
// the running sum l, and turns st into probabilities. With `max_known` the
// tile's maximum is in s.tile_max already.
inline void online_softmax(int64_t jn, int64_t Br, bool max_known, float* st,
                           const SoftmaxRows& s) {
  for (int64_t c = 0; c < Br; c += kLanes) {
    const VecF shift = update_row_max(jn, Br, c, max_known, st, s).shift;
    VecF sum{};
    for (int64_t j = 0; j < jn; ++j) {
      const VecF prob = exp2_of_shifted(vload(st + j * Br + c) - shift);
      vstore(st + j * Br + c, prob);
      sum += prob;
    }
    vstore(s.l + c, vfma(vload(s.l + c), vload(s.alpha + c), sum));
  }
}

// Natural-log logsumexp of a row from its softmax statistics (log2 units).
inline float row_logsumexp(float shift, float l) { return (shift + std::log2(l)) * kLn2; }

// The forward's results for rows i < rows (query index t[i], head n[i]) of
// batch b: out = O / l, with row i's unnormalised output O[h] (h < Hv) at
// acc[i * row_stride + h * h_stride], and the logsumexp; 0 and -inf for a row
// that attends no key (`attends` false: the tile has no attended key, and its
// statistics were never set). row is [Hv] scratch.
template <typename T>
inline void store_forward_rows(const Geometry& g, int64_t b, const int64_t* t, const int64_t* n,
                               int64_t rows, bool attends, int64_t q_valid,
                               const SoftmaxRows& stats, const float* acc, int64_t row_stride,
                               int64_t h_stride, float* row, T* out, float* lse) {
  for (int64_t i = 0; i < rows; ++i) {
    T* dst = out + ((b * g.T + t[i]) * g.N + n[i]) * g.Hv;
    float* lse_dst = lse + (b * g.N + n[i]) * g.T + t[i];
    // l is NaN when a NaN or inf reached the row's logits: the row is NaN then.
    if (attends && t[i] < q_valid && !(stats.l[i] == 0.0f)) {
      const float inv = 1.0f / stats.l[i];
      const float* o = acc + i * row_stride;
      for (int64_t h = 0; h < g.Hv; ++h) row[h] = o[h * h_stride] * inv;
      *lse_dst = row_logsumexp(stats.shift[i], stats.l[i]);
    } else {
      std::fill(row, row + g.Hv, 0.0f);
      *lse_dst = -kInf;
    }
    store_row(row, dst, g.Hv);
  }
}

// Workspace bytes for run_row_tile_items: the scratch of every thread
// (carve(arena) carves one thread's), and the slack of aligning the base.
template <typename Carve>
inline size_t row_tile_workspace_bytes(const AttentionParams& p, Carve carve) {
  Arena arena(nullptr);
  for (int i = 0; i < thread_count(p); ++i) carve(arena);
  return arena.used() + 64;
}

// Runs item(scratch, b, kh, r0) for every work item (batch b, kv head kh, row
// tile at r0) on `threads` threads, each with the scratch carve(arena) gives
// it from the workspace. Items run kv head by kv head, so the threads sweep one
// head's K/V (a few MiB at long S) while it is in the cache: interleaving heads
// streamed every head's K/V from DRAM (at (1, 4096, 8, 128) the K/V of all
// heads, 32 MiB, fill the L3) and cost 25-40% of the forward. Within a head the
// later row tiles, which see more keys under a causal mask, come first, so the
// last items of the loop are the shortest.
// begin(scratch) runs once on each thread before its first item (state a
// thread keeps across items, as a KvHeadRows, is set there: carve only
// computes pointers, and a thread carves the slots of the threads before it).
template <typename Carve, typename Item, typename Begin>
inline void run_row_tile_items(const Geometry& g, int64_t Br, int threads, void* workspace,
                               Carve carve, Item item, Begin begin) {
  const int64_t row_tiles = ceil_div(g.T * g.G, Br);
  const int64_t items = g.B * g.K * row_tiles;
#pragma omp parallel num_threads(threads)
  {
    Arena arena(workspace);
    auto s = carve(arena);
    for (int i = 0; i < omp_get_thread_num(); ++i) s = carve(arena);
    begin(s);
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < items; ++index) {
      const int64_t group = index / row_tiles;
      const int64_t tile = row_tiles - 1 - index % row_tiles;
      item(s, group / g.K, group % g.K, tile * Br);
    }
  }
}

template <typename Carve, typename Item>
inline void run_row_tile_items(const Geometry& g, int64_t Br, int threads, void* workspace,
                               Carve carve, Item item) {
  run_row_tile_items(g, Br, threads, workspace, carve, item, [](const auto&) {});
}

// ---------------------------------------------------------------------------
// The forward of a kv head with fewer query rows than vector lanes (decoding),
// cpu/attention_decode.cc: attention_fwd's path for those shapes.

inline bool has_few_rows(const Geometry& g) { return g.T * g.G < kLanes; }

// Every head dim pair takes it (MLA's 192/128 and 576/512 decode included:
// the value rows have their own padded width there).
inline bool takes_decode_path(const Geometry& g) { return has_few_rows(g); }

template <typename T>
size_t decode_fwd_workspace_bytes(const AttentionParams& p);

template <typename T>
void decode_fwd(const AttentionParams& p, const T* q, const T* k, const T* v, T* out, float* lse,
                void* workspace);

}  // namespace jaxops::cpu::attention_internal
