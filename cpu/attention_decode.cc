// Flash attention forward for kv heads with fewer query rows than vector
// lanes (decoding: T * G < kLanes), the path attention_fwd
// (cpu/attention_forward.cc) takes for those shapes. Rows along the lanes
// would leave most of them idle; here a score is a dot product over H and the
// output accumulates rows of V, both vectorised over H, so the work is
// proportional to the rows (the pass is bound by reading K and V once).
//
// Without a bias, mask or segment-id operand the pass is the decode core's
// (cpu/kv_decode.h: every (sequence, kv head) a group of T * G rows, each with
// its own key interval, keys split across threads when the groups are fewer
// than the threads); with one, decode_kv_head below, which reads the operands
// per row.
#include "cpu/attention.h"

#include <algorithm>
#include <type_traits>

#include "cpu/attention_tiles.h"
#include "cpu/kv_decode.h"

namespace jaxops::cpu::attention_internal {
namespace {

// One work item: all T * G < kLanes query rows of a kv head, row-major.
struct DecodeScratch : TileRowState {
  float* qn;    // [kLanes][Hp] query rows
  float* on;    // [kLanes][Hvp] unnormalised output rows
  float* kn;    // [Bc][Hp] key rows as float (when not read in place)
  float* vn;    // [Bc][Hvp]
  float* sn;    // [kLanes][Bc] logits / probabilities
};

DecodeScratch carve_decode(const Geometry& g, Arena& arena) {
  DecodeScratch s;
  s.qn = arena.take<float>(kLanes * g.Hp);
  s.on = arena.take<float>(kLanes * g.Hvp);
  s.kn = arena.take<float>(kKeyTile * g.Hp);
  s.vn = arena.take<float>(kKeyTile * g.Hvp);
  s.sn = arena.take<float>(kLanes * kKeyTile);
  carve_tile_row_state(s, g, kLanes, arena);
  return s;
}

template <typename T>
void decode_kv_head(const AttentionParams& p, const Geometry& g, const T* q, const T* k,
                    const T* v, T* out, float* lse, int64_t b, int64_t kh,
                    const DecodeScratch& s) {
  const int64_t H = g.H, Hp = g.Hp, Hv = g.Hv, Hvp = g.Hvp, Bc = kKeyTile;
  const RowTile tile = plan_row_tile(g, b, kh, 0, g.T * g.G, s.t, s.n, s.lo, s.hi, s.ids);
  const int64_t rows = tile.rows;
  const bool in_place = std::is_same_v<T, float> && H == Hp && Hv == Hvp;
  for (int64_t i = 0; i < rows; ++i) {
    load_row(q + ((b * g.T + s.t[i]) * g.N + s.n[i]) * H, s.qn + i * Hp, H);
    std::fill(s.qn + i * Hp + H, s.qn + (i + 1) * Hp, 0.0f);
  }
  std::fill(s.on, s.on + rows * Hvp, 0.0f);
  std::fill(s.stats.m, s.stats.m + rows, -kInf);
  std::fill(s.stats.shift, s.stats.shift + rows, 0.0f);
  std::fill(s.stats.l, s.stats.l + rows, 0.0f);

  // Key tiles of other documents only are stepped over (Bc is kKeyTile).
  for (int64_t j0 = next_attended_tile(g, b, tile, tile.key_begin), next; j0 < tile.key_end;
       j0 = next) {
    const int64_t jn = std::min(Bc, tile.key_end - j0);
    const int64_t row = (b * g.S + j0) * g.K + kh;
    next = next_attended_tile(g, b, tile, j0 + jn);
    if (next < tile.key_end) {
      prefetch_kv_tile(g, k, v, b, kh, next, std::min(Bc, tile.key_end - next));
    }
    const TileSegments segments = tile_segments(g, b, tile.ids, j0, jn);
    const float* kr;
    const float* vr;
    int64_t ld, ldv;
    if (in_place) {
      kr = reinterpret_cast<const float*>(k + row * H);
      vr = reinterpret_cast<const float*>(v + row * Hv);
      ld = g.K * H;
      ldv = g.K * Hv;
    } else {
      load_kv_tile(g, k, H, b, kh, j0, jn, s.kn, Hp);
      load_kv_tile(g, v, Hv, b, kh, j0, jn, s.vn, Hvp);
      kr = s.kn;
      vr = s.vn;
      ld = Hp;
      ldv = Hvp;
    }
    // Columns past jn lie past every row's interval unless the tile is inside.
    const bool inside = tile.inside(j0, Bc);
    for (int64_t i = 0; i < rows; ++i) {
      float* srow = s.sn + i * Bc;
      const float* qi = s.qn + i * Hp;
      // Four keys at a time: independent accumulation chains.
      int64_t j = 0;
      for (; j + 4 <= jn; j += 4) {
        VecF acc0{}, acc1{}, acc2{}, acc3{};
        const float* k0 = kr + j * ld;
        for (int64_t h = 0; h < Hp; h += kLanes) {
          const VecF qv = vload(qi + h);
          acc0 = vfma(qv, vload(k0 + h), acc0);
          acc1 = vfma(qv, vload(k0 + ld + h), acc1);
          acc2 = vfma(qv, vload(k0 + 2 * ld + h), acc2);
          acc3 = vfma(qv, vload(k0 + 3 * ld + h), acc3);
        }
        srow[j] = vsum(acc0);
        srow[j + 1] = vsum(acc1);
        srow[j + 2] = vsum(acc2);
        srow[j + 3] = vsum(acc3);
      }
      for (; j < jn; ++j) {
        VecF acc{};
        for (int64_t h = 0; h < Hp; h += kLanes) acc = vfma(vload(qi + h), vload(kr + j * ld + h), acc);
        srow[j] = vsum(acc);
      }
      std::fill(srow + jn, srow + Bc, 0.0f);
      if (s.t[i] < tile.q_valid) {
        row_logits(p, g, b, s.n[i], s.t[i], tile.kv_valid, j0, jn, Bc, inside, segments.key_ids,
                   srow);
      } else {
        std::fill(srow, srow + Bc, -kInf);
      }
      VecF tile_max = vsplat(-kInf);
      for (int64_t j = 0; j < Bc; j += kLanes) tile_max = vmax(tile_max, vload(srow + j));
      float m_new = s.stats.m[i];
      for (int l = 0; l < kLanes; ++l) m_new = std::max(m_new, tile_max[l]);
      const float shift = m_new == -kInf ? 0.0f : m_new;
      const float alpha = vexp2(vsplat(s.stats.m[i] - shift))[0];
      s.stats.m[i] = m_new;
      s.stats.shift[i] = shift;
      VecF sum{};
      for (int64_t j = 0; j < Bc; j += kLanes) {
        const VecF prob = vexp2(vload(srow + j) - vsplat(shift));
        vstore(srow + j, prob);
        sum += prob;
      }
      s.stats.l[i] = s.stats.l[i] * alpha + vsum(sum);
      float* oi = s.on + i * Hvp;
      for (int64_t h = 0; h < Hvp; h += kLanes) vstore(oi + h, vload(oi + h) * vsplat(alpha));
    }
    gemm<Update::kAdd>(rows, Hvp, jn, s.sn, Bc, 1, vr, ldv, s.on, Hvp);
  }

  // The statistics are set for every row, so `attends` need not be checked.
  store_forward_rows(g, b, s.t, s.n, rows, true, tile.q_valid, s.stats, s.on, Hvp, 1, s.row,
                     out, lse);
}

// The rows of kv head kh of batch b in a dense [B, S, K, H] key and [B, S, K,
// Hv] value cache.
template <typename T>
struct DenseKvRows {
  using Element = T;
  const T* k;        // key 0 of the head
  const T* v;
  int64_t stride;    // K * H: from one key to the next
  int64_t v_stride;  // K * Hv
  const T* key(int64_t j) const { return k + j * stride; }
  const T* value(int64_t j) const { return v + j * v_stride; }
  int64_t uniform_stride(int64_t, int64_t) const { return stride; }
  int64_t uniform_value_stride(int64_t, int64_t) const { return v_stride; }
  int64_t run_length(int64_t, int64_t n) const { return n; }
};

// The decode core's groups: (batch, kv head) pairs, rows t-major over the
// head's G query heads. A row past q_seq_lengths[b] attends nothing (output 0,
// logsumexp -inf); the lengths and the offset are clamped by Geometry.
template <typename T>
struct DenseDecodeGroups {
  using Source = DenseKvRows<T>;
  const Geometry& g;
  const T* q;
  const T* k;
  const T* v;
  T* out;
  float* lse;

  Source setup(int64_t group, float* qf, int64_t ld, int64_t* begin, int64_t* end) const {
    const int64_t b = group / g.K, kh = group % g.K;
    const int64_t q_valid = g.q_valid(b), kv_valid = g.kv_valid(b);
    for (int64_t i = 0; i < g.T * g.G; ++i) {
      const int64_t t = i / g.G, n = kh * g.G + i % g.G;
      kv_decode::load_query_row(q + ((b * g.T + t) * g.N + n) * g.H, qf + i * ld, g.H, ld);
      begin[i] = t < q_valid ? g.lo(t) : 0;
      end[i] = t < q_valid ? g.hi(t, kv_valid) : 0;
    }
    return Source{k + (b * g.S * g.K + kh) * g.H, v + (b * g.S * g.K + kh) * g.Hv, g.K * g.H,
                  g.K * g.Hv};
  }

  void store(int64_t group, int64_t i, const float* row, float row_lse) const {
    const int64_t b = group / g.K, kh = group % g.K;
    const int64_t t = i / g.G, n = kh * g.G + i % g.G;
    store_row(row, out + ((b * g.T + t) * g.N + n) * g.Hv, g.Hv);
    lse[(b * g.N + n) * g.T + t] = row_lse;
  }
};

kv_decode::DecodeShape decode_core_shape(const AttentionParams& p, const Geometry& g) {
  kv_decode::DecodeShape shape;
  shape.rows = g.T * g.G;
  shape.head_dim = g.H;
  shape.value_dim = g.Hv;
  shape.scale = p.scale;
  shape.soft_cap = p.logits_soft_cap;
  // Key j of every kv head of a sequence lies in one block of the [B, S, K, H]
  // cache: the sequence's heads are walked together.
  shape.groups_per_walk = g.K;
  return shape;
}

// The core covers everything but the bias, mask and segment-id operands (its
// rows attend key intervals).
bool uses_decode_core(const AttentionParams& p) {
  return !p.bias && !p.mask && !p.q_segment_ids;
}

}  // namespace

template <typename T>
size_t decode_fwd_workspace_bytes(const AttentionParams& p) {
  const Geometry g(p);
  if (uses_decode_core(p)) {
    return kv_decode::decode_workspace_bytes(g.B * g.K, decode_core_shape(p, g), g.S,
                                             thread_count(p));
  }
  return row_tile_workspace_bytes(p, [&](Arena& arena) { return carve_decode(g, arena); });
}

template <typename T>
void decode_fwd(const AttentionParams& p, const T* q, const T* k, const T* v, T* out, float* lse,
                void* workspace) {
  const Geometry g(p);
  if (uses_decode_core(p)) {
    const DenseDecodeGroups<T> groups{g, q, k, v, out, lse};
    kv_decode::run_decode(groups, g.B * g.K, decode_core_shape(p, g), g.S, thread_count(p),
                          workspace);
    return;
  }
  // One row tile per kv head: its T * G rows fit in kLanes.
  run_row_tile_items(
      g, kLanes, thread_count(p), workspace, [&](Arena& arena) { return carve_decode(g, arena); },
      [&](const DecodeScratch& s, int64_t b, int64_t kh, int64_t) {
        decode_kv_head(p, g, q, k, v, out, lse, b, kh, s);
      });
}

#define JAXOPS_ATTENTION_DECODE_INSTANTIATE(T)                                                  \
  template size_t decode_fwd_workspace_bytes<T>(const AttentionParams&);                       \
  template void decode_fwd<T>(const AttentionParams&, const T*, const T*, const T*, T*, float*, \
                              void*);
JAXOPS_ATTENTION_DECODE_INSTANTIATE(float)
JAXOPS_ATTENTION_DECODE_INSTANTIATE(bfloat16)
JAXOPS_ATTENTION_DECODE_INSTANTIATE(float16)
#undef JAXOPS_ATTENTION_DECODE_INSTANTIATE

}  // namespace jaxops::cpu::attention_internal
