// Flash attention backward on the CPU; see attention.h for the contract and
// cpu/attention_tiles.h for the building blocks it shares with the other
// passes.
//
// Keys lie along the SIMD lanes. A key tile is transposed once and serves
// every query tile that attends to it; query-side rows are converted to
// contiguous float rows once per work item. The register-blocked products
// (cpu/gemm_microkernels.h) into dk/dv/dq vectorise over the head dimension.
#include "cpu/attention.h"

#include <algorithm>
#include <type_traits>

#include "cpu/attention_tiles.h"

namespace jaxops::cpu {
using namespace attention_internal;
namespace {

// The backward keeps a key tile while it sweeps the query rows of its head, so
// a larger one halves the reads of q, dout and dq: 7% faster at H = 128 (10%
// in bf16), the same at H = 64; 32 was 15% slower.
constexpr int64_t kBackwardKeyTile = 128;
// The backward splits each (batch, kv head)'s keys into chunks until there are
// at least this many independent work items. A constant (not the thread count)
// keeps results bitwise identical for any number of threads.
constexpr int64_t kMinBackwardItems = 8;

// A work item is one (batch, kv head, chunk of key tiles). For each
// key tile it accumulates dk/dv in scratch over every query head of the group
// and every query tile that attends to it, so dk/dv are written once, by one
// item. dq is accumulated per chunk (directly into dq when there is one chunk
// and the layout allows) and the chunks are summed in a fixed order.
//
// Unlike the forward, score tiles here are [query row][key], vectorised over
// keys: the key tile is transposed once and then serves every query tile of
// the group, while query and output-gradient rows are float rows converted
// once per work item (BackwardScratch::qh) or, past Geometry::held_row_bytes, read in
// place (float inputs with H a multiple of the vector width) or converted
// per key tile.

struct BackwardScratch {
  float* kt;     // [H][Bc] key tile, transposed, zero past the tile's keys
  float* vt;     // [Hv][Bc]
  float* kn;     // [Bc][Hp] key tile as float rows
  float* dk;     // [Bc][Hp] accumulators
  float* dv;     // [Bc][Hvp]
  float* qn;     // [Br][Hp] query rows as float (when neither held nor read in place)
  float* dn;     // [Br][Hvp] output-gradient rows
  float* p;      // [Br][Bc] probabilities
  float* ds;     // [Br][Bc] dP, then dS (the gradient of the logits)
  float* slope;  // [Br][Bc] the soft cap's slope at each logit (with a cap)
  float* row;    // [max(Hp, Hvp)]
  float* row2;   // [max(Hp, Hvp)]
  float* delta;  // [G * T] rowsum(dout * out) - dlse, per (head of the group, row)
  float* lse2;   // [G * T] logsumexp in log2 units; +inf: the row has no key
  // The query and output-gradient rows of a work item's heads as contiguous
  // float rows, converted (or copied) once per item instead of once per key
  // tile: bfloat16 rows were widened S / Bc times, and float rows read in
  // place are N * H floats apart (2 KiB at (1, 2048, 8, 64)), where the
  // products' strips evict each other's rows from the L1's few sets they fall
  // in. Blocks of Br rows are converted on first use. Empty unless
  // holds_query_side_rows.
  float* qh;            // [G][T][Hp]
  float* dh;            // [G][T][Hvp]
  uint8_t* rows_ready;  // [G][ceil(T / Br)]
};

// Whether a work item keeps its heads' query-side rows (BackwardScratch::qh).
bool holds_query_side_rows(const Geometry& g) {
  return g.G * g.T * (g.Hp + g.Hvp) * static_cast<int64_t>(sizeof(float)) <= g.held_row_bytes;
}

BackwardScratch carve_backward(const Geometry& g, Arena& arena) {
  const int64_t Br = kRowTile, Bc = kBackwardKeyTile;
  BackwardScratch s;
  s.kt = arena.take<float>(g.H * Bc);
  s.vt = arena.take<float>(g.Hv * Bc);
  s.kn = arena.take<float>(Bc * g.Hp);
  s.dk = arena.take<float>(Bc * g.Hp);
  s.dv = arena.take<float>(Bc * g.Hvp);
  s.qn = arena.take<float>(Br * g.Hp);
  s.dn = arena.take<float>(Br * g.Hvp);
  s.p = arena.take<float>(Br * Bc);
  s.ds = arena.take<float>(Br * Bc);
  s.slope = arena.take<float>(g.soft_cap > 0.0f ? Br * Bc : 0);
  s.row = arena.take<float>(std::max(g.Hp, g.Hvp));
  s.row2 = arena.take<float>(std::max(g.Hp, g.Hvp));
  s.delta = arena.take<float>(g.G * g.T);
  s.lse2 = arena.take<float>(g.G * g.T);
  const bool hold = holds_query_side_rows(g);
  s.qh = arena.take<float>(hold ? g.G * g.T * g.Hp : 0);
  s.dh = arena.take<float>(hold ? g.G * g.T * g.Hvp : 0);
  s.rows_ready = arena.take<uint8_t>(hold ? g.G * ceil_div(g.T, Br) : 0);
  return s;
}

struct BackwardPlan {
  int64_t key_tiles;
  int64_t chunks;         // key-tile chunks per (batch, kv head)
  bool in_place;          // float rows with H and Hv % lanes == 0 are read where they are
                          // (query-side rows when not held), dq accumulated in place
  bool dq_direct;         // accumulate into dq itself (in place and one chunk)
  int64_t dq_acc_floats;  // else: [chunks, B, N, T, Hp] float accumulators
};

template <typename T>
BackwardPlan plan_backward(const Geometry& g) {
  BackwardPlan plan;
  plan.key_tiles = ceil_div(g.S, kBackwardKeyTile);
  const int64_t base = std::max<int64_t>(g.B * g.K, 1);
  plan.chunks = std::clamp<int64_t>(ceil_div(kMinBackwardItems, base), 1,
                                    std::max<int64_t>(plan.key_tiles, 1));
  plan.in_place = std::is_same_v<T, float> && g.H == g.Hp && g.Hv == g.Hvp;
  plan.dq_direct = plan.in_place && plan.chunks == 1;
  plan.dq_acc_floats = plan.dq_direct ? 0 : plan.chunks * g.B * g.N * g.T * g.Hp;
  return plan;
}

// Query rows [t_begin, t_end) whose attended interval meets keys [j0, j1).
void rows_meeting_keys(const Geometry& g, int64_t q_valid, int64_t kv_valid, int64_t j0,
                       int64_t j1, int64_t* t_begin, int64_t* t_end) {
  // First t with hi(t) > j0, and first t with lo(t) >= j1 (both monotone).
  int64_t a = 0, z = q_valid;
  while (a < z) {
    const int64_t mid = (a + z) / 2;
    if (g.hi(mid, kv_valid) > j0) z = mid; else a = mid + 1;
  }
  *t_begin = a;
  z = q_valid;
  while (a < z) {
    const int64_t mid = (a + z) / 2;
    if (g.lo(mid) >= j1) z = mid; else a = mid + 1;
  }
  *t_end = a;
}

// delta = rowsum(dout * out) - dlse and lse in log2 units for rows t0.. of head n.
// With a logsumexp cotangent the logit gradient is P * (dP - delta + dlse):
// it is folded into delta.
template <typename T>
void row_statistics(const Geometry& g, const T* out, const float* lse, const T* dout,
                    const float* dlse, int64_t b, int64_t n, int64_t t0, int64_t rows,
                    float* delta, float* lse2, float* row, float* row2) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = ((b * g.T + t0 + i) * g.N + n) * g.Hv;
    load_row(out + at, row, g.Hv);
    load_row(dout + at, row2, g.Hv);
    float sum = 0.0f;
    for (int64_t h = 0; h < g.Hv; ++h) sum += row[h] * row2[h];
    const int64_t stat = (b * g.N + n) * g.T + t0 + i;
    delta[i] = dlse ? sum - dlse[stat] : sum;
    lse2[i] = lse[stat] == -kInf ? kInf : lse[stat] * kLog2e;
  }
}

// Rows t0 .. t0 + rows of head n of a [B, T, N, d] tensor (d: H for the
// query, Hv for dout) as float rows: in place, or converted into buf (stride
// d rounded up to the lanes, zero padded). Returns the first row; *ld is the
// row stride.
template <typename T>
const float* query_side_rows(const Geometry& g, bool in_place, const T* x, int64_t d, int64_t b,
                             int64_t n, int64_t t0, int64_t rows, float* buf, int64_t* ld) {
  const T* first = x + ((b * g.T + t0) * g.N + n) * d;
  if (in_place) {
    *ld = g.N * d;
    return reinterpret_cast<const float*>(first);
  }
  const int64_t dp = round_up(d, kLanes);
  for (int64_t i = 0; i < rows; ++i) {
    load_row(first + i * g.N * d, buf + i * dp, d);
    std::fill(buf + i * dp + d, buf + (i + 1) * dp, 0.0f);
  }
  *ld = dp;
  return buf;
}

// Rows t0 .. t0 + rows of head kh * G + gi of q and dout in s.qh and s.dh
// (converting the blocks of Br rows not converted yet in this item).
template <typename T>
void hold_query_side_rows(const Geometry& g, const T* q, const T* dout, int64_t b, int64_t kh,
                          int64_t gi, int64_t t0, int64_t rows, const BackwardScratch& s) {
  const int64_t Br = kRowTile, n = kh * g.G + gi;
  uint8_t* ready = s.rows_ready + gi * ceil_div(g.T, Br);
  for (int64_t block = t0 / Br; block * Br < t0 + rows; ++block) {
    if (ready[block]) continue;
    for (int64_t t = block * Br; t < std::min(g.T, (block + 1) * Br); ++t) {
      const int64_t at = (b * g.T + t) * g.N + n;
      row_as_float(q + at * g.H, g.H, g.Hp, s.qh + (gi * g.T + t) * g.Hp);
      row_as_float(dout + at * g.Hv, g.Hv, g.Hvp, s.dh + (gi * g.T + t) * g.Hvp);
    }
    ready[block] = 1;
  }
}

// The key and value tile of keys j0 .. j0 + jn: transposed (kt: [H][Bc],
// vt: [Hv][Bc], zero past jn) for the score products, and the keys as
// contiguous float rows (kn, stride Hp) for dq: float keys read in place are
// K * H floats apart, which the L1 holds in few sets (see BackwardScratch::qh).
template <typename T>
const float* load_backward_kv_tile(const Geometry& g, const T* k, const T* v, int64_t b,
                                   int64_t kh, int64_t j0, int64_t jn, const BackwardScratch& s,
                                   int64_t* ld_k) {
  const int64_t Bc = kBackwardKeyTile;
  std::fill(s.kt, s.kt + g.H * Bc, 0.0f);
  std::fill(s.vt, s.vt + g.Hv * Bc, 0.0f);
  for (int64_t j = 0; j < jn; ++j) {
    const float* kr = s.kn + j * g.Hp;
    row_as_float(k + ((b * g.S + j0 + j) * g.K + kh) * g.H, g.H, g.Hp, s.kn + j * g.Hp);
    for (int64_t h = 0; h < g.H; ++h) s.kt[h * Bc + j] = kr[h];
    load_row(v + ((b * g.S + j0 + j) * g.K + kh) * g.Hv, s.row, g.Hv);
    for (int64_t h = 0; h < g.Hv; ++h) s.vt[h * Bc + j] = s.row[h];
  }
  *ld_k = g.Hp;
  return s.kn;
}

// For query rows t0 .. t0 + rows of head n (rows qr / dr, statistics delta /
// lse2 indexed by row) against the loaded key tile (key_ids: its segment ids
// where they need an elementwise test): s.p = P and s.ds = dS, the gradient
// of the logits after the soft cap (dbias) or, `through_cap`, before it (the
// products' gradient: times the cap's slope; the same without a cap).
void probabilities_and_logit_grads(const AttentionParams& p, const Geometry& g, int64_t b,
                                   int64_t n, int64_t t0, int64_t rows, int64_t kv_valid,
                                   int64_t j0, int64_t jn, const int32_t* key_ids,
                                   bool through_cap, const float* qr, int64_t ld_q,
                                   const float* dr, int64_t ld_d, const float* delta,
                                   const float* lse2, const BackwardScratch& s) {
  const int64_t Bc = kBackwardKeyTile;
  const bool capped = g.soft_cap > 0.0f;
  gemm<Update::kOverwrite>(rows, Bc, g.H, qr, ld_q, 1, s.kt, Bc, s.p, Bc);
  gemm<Update::kOverwrite>(rows, Bc, g.Hv, dr, ld_d, 1, s.vt, Bc, s.ds, Bc);
  // Columns past jn (the last tile) lie past every row's interval.
  const bool inside = g.lo(t0 + rows - 1) <= j0 && g.hi(t0, kv_valid) >= j0 + Bc;
  for (int64_t i = 0; i < rows; ++i) {
    float* prow = s.p + i * Bc;
    float* dsrow = s.ds + i * Bc;
    float* slope = capped ? s.slope + i * Bc : nullptr;
    row_logits(p, g, b, n, t0 + i, kv_valid, j0, jn, Bc, inside, key_ids, prow, slope);
    const VecF shift = vsplat(lse2[i]);
    const VecF row_delta = vsplat(delta[i]);
    // A masked key (logit -inf) gets P = 0 and dS = 0 even when the row's
    // statistics are NaN or its dP is (a NaN V row the row does not attend).
    const VecF masked = vsplat(-kInf);
    for (int64_t j = 0; j < Bc; j += kLanes) {
      const VecF logit = vload(prow + j);
      const VecF prob = logit == masked ? VecF{} : exp2_of_shifted(logit - shift);
      vstore(prow + j, prob);
      VecF ds = prob * (vload(dsrow + j) - row_delta);
      if (capped && through_cap) ds *= vload(slope + j);
      vstore(dsrow + j, logit == masked ? VecF{} : ds);
    }
  }
}

template <typename T>
void backward_item(const AttentionParams& p, const Geometry& g, const BackwardPlan& plan,
                   const T* q, const T* k, const T* v, const T* out, const float* lse,
                   const T* dout, const float* dlse, T* dq, T* dk, T* dv, float* dq_acc,
                   int64_t b, int64_t kh, int64_t chunk, const BackwardScratch& s) {
  const int64_t Br = kRowTile, Bc = kBackwardKeyTile, H = g.H, Hp = g.Hp, Hv = g.Hv,
                Hvp = g.Hvp;
  const int64_t q_valid = g.q_valid(b), kv_valid = g.kv_valid(b);
  const int64_t tile_begin = plan.key_tiles * chunk / plan.chunks;
  const int64_t tile_end = plan.key_tiles * (chunk + 1) / plan.chunks;

  for (int64_t gi = 0; gi < g.G; ++gi) {
    row_statistics(g, out, lse, dout, dlse, b, kh * g.G + gi, 0, q_valid, s.delta + gi * g.T,
                   s.lse2 + gi * g.T, s.row, s.row2);
  }
  const bool hold_rows = holds_query_side_rows(g);
  if (hold_rows) std::fill(s.rows_ready, s.rows_ready + g.G * ceil_div(g.T, Br), uint8_t{0});
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t j0 = tile * Bc;
    const int64_t jn = std::min(Bc, g.S - j0);
    int64_t t_begin, t_end;
    rows_meeting_keys(g, q_valid, kv_valid, j0, j0 + jn, &t_begin, &t_end);
    std::fill(s.dk, s.dk + jn * Hp, 0.0f);
    std::fill(s.dv, s.dv + jn * Hvp, 0.0f);
    // The key tile's segment ids: a query tile of other documents is skipped
    // whole (its P and dS are 0 there).
    const IdRange key_ids =
        g.q_segments && jn > 0 ? IdRange::of(g.kv_ids(b) + j0, jn) : IdRange{};
    int64_t ld_k = 0;
    const float* kr = t_begin < t_end
        ? load_backward_kv_tile(g, k, v, b, kh, j0, jn, s, &ld_k) : nullptr;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += Br) {
      const int64_t rows = std::min(Br, t_end - t0);
      TileSegments segments;
      if (g.q_segments) {
        segments = segments_between(IdRange::of(g.q_ids(b) + t0, rows), key_ids,
                                    g.kv_ids(b) + j0);
        if (segments.skip) continue;
      }
      const int32_t* tile_key_ids = segments.key_ids;
      for (int64_t gi = 0; gi < g.G; ++gi) {
        const int64_t n = kh * g.G + gi;
        int64_t ld_q = Hp, ld_d = Hvp;
        const float* qr;
        const float* dr;
        if (hold_rows) {
          hold_query_side_rows(g, q, dout, b, kh, gi, t0, rows, s);
          qr = s.qh + (gi * g.T + t0) * Hp;
          dr = s.dh + (gi * g.T + t0) * Hvp;
        } else {
          qr = query_side_rows(g, plan.in_place, q, H, b, n, t0, rows, s.qn, &ld_q);
          dr = query_side_rows(g, plan.in_place, dout, Hv, b, n, t0, rows, s.dn, &ld_d);
        }
        probabilities_and_logit_grads(p, g, b, n, t0, rows, kv_valid, j0, jn, tile_key_ids, true,
                                      qr, ld_q, dr, ld_d, s.delta + gi * g.T + t0,
                                      s.lse2 + gi * g.T + t0, s);
        gemm<Update::kAdd>(jn, Hvp, rows, s.p, 1, Bc, dr, ld_d, s.dv, Hvp);
        gemm<Update::kAdd>(jn, Hp, rows, s.ds, 1, Bc, qr, ld_q, s.dk, Hp);
        float* dq_rows;
        int64_t ld_dq;
        if (plan.dq_direct) {
          dq_rows = reinterpret_cast<float*>(dq) + ((b * g.T + t0) * g.N + n) * H;
          ld_dq = g.N * H;
        } else {
          dq_rows = dq_acc + (((chunk * g.B + b) * g.N + n) * g.T + t0) * Hp;
          ld_dq = Hp;
        }
        // Only the keys some of these rows attend: dS is 0 at the others, but
        // 0 * K is NaN where K holds NaN or inf (an unwritten KV-cache tail).
        const int64_t c0 = std::clamp<int64_t>(g.lo(t0) - j0, 0, jn);
        const int64_t c1 = std::clamp<int64_t>(g.hi(t0 + rows - 1, kv_valid) - j0, c0, jn);
        gemm<Update::kAdd>(rows, Hp, c1 - c0, s.ds + c0, Bc, 1, kr + c0 * ld_k, ld_k, dq_rows,
                           ld_dq);
      }
    }
    for (int64_t j = 0; j < jn; ++j) {
      for (int64_t h = 0; h < H; ++h) s.row[h] = s.dk[j * Hp + h] * p.scale;
      store_row(s.row, dk + ((b * g.S + j0 + j) * g.K + kh) * H, H);
      store_row(s.dv + j * Hvp, dv + ((b * g.S + j0 + j) * g.K + kh) * Hv, Hv);
    }
  }
}

// dbias: one work item per dbias tile that is not broadcast; the item sums
// over the broadcast (stride 0) dims, so every dbias element has one writer.
template <typename T>
void dbias_item(const AttentionParams& p, const Geometry& g, const BackwardPlan& plan,
                const T* q, const T* k, const T* v, const T* out, const float* lse,
                const T* dout, const float* dlse, float* dbias, int64_t b_item, int64_t n_item,
                int64_t t_tile, int64_t k_tile, const BackwardScratch& s) {
  const int64_t Br = kRowTile, Bc = kBackwardKeyTile;
  const int64_t* st = p.bias_strides;
  const bool all_b = st[0] == 0, all_n = st[1] == 0, all_t = st[2] == 0, all_k = st[3] == 0;
  const int64_t t_lo = all_t ? 0 : t_tile * Br, t_hi = all_t ? g.T : std::min(g.T, (t_tile + 1) * Br);
  const int64_t k_lo = all_k ? 0 : k_tile * Bc, k_hi = all_k ? g.S : std::min(g.S, (k_tile + 1) * Bc);

  float* base = dbias + b_item * st[0] + n_item * st[1];
  for (int64_t t = t_lo; t < t_hi; ++t) {
    for (int64_t j = k_lo; j < k_hi; ++j) base[t * st[2] + j * st[3]] = 0.0f;
  }

  for (int64_t b = all_b ? 0 : b_item; b < (all_b ? g.B : b_item + 1); ++b) {
    const int64_t q_valid = g.q_valid(b), kv_valid = g.kv_valid(b);
    for (int64_t n = all_n ? 0 : n_item; n < (all_n ? g.N : n_item + 1); ++n) {
      const int64_t kh = n / g.G;
      for (int64_t j0 = k_lo; j0 < k_hi; j0 += Bc) {
        const int64_t jn = std::min(Bc, k_hi - j0);
        int64_t t_begin, t_end;
        rows_meeting_keys(g, q_valid, kv_valid, j0, j0 + jn, &t_begin, &t_end);
        t_begin = std::max(t_begin, t_lo);
        t_end = std::min(t_end, t_hi);
        if (t_begin >= t_end) continue;
        const IdRange key_ids =
            g.q_segments ? IdRange::of(g.kv_ids(b) + j0, jn) : IdRange{};
        int64_t ld_k;
        load_backward_kv_tile(g, k, v, b, kh, j0, jn, s, &ld_k);
        for (int64_t t0 = t_begin; t0 < t_end; t0 += Br) {
          const int64_t rows = std::min(Br, t_end - t0);
          TileSegments segments;
          if (g.q_segments) {
            segments = segments_between(IdRange::of(g.q_ids(b) + t0, rows), key_ids,
                                        g.kv_ids(b) + j0);
            if (segments.skip) continue;  // dbias stays 0 there
          }
          const int32_t* tile_key_ids = segments.key_ids;
          int64_t ld_q, ld_d;
          const float* qr =
              query_side_rows(g, plan.in_place, q, g.H, b, n, t0, rows, s.qn, &ld_q);
          const float* dr =
              query_side_rows(g, plan.in_place, dout, g.Hv, b, n, t0, rows, s.dn, &ld_d);
          row_statistics(g, out, lse, dout, dlse, b, n, t0, rows, s.delta, s.lse2, s.row, s.row2);
          probabilities_and_logit_grads(p, g, b, n, t0, rows, kv_valid, j0, jn, tile_key_ids,
                                        false, qr, ld_q, dr, ld_d, s.delta, s.lse2, s);
          float* tile = dbias + b * st[0] + n * st[1] + t0 * st[2] + j0 * st[3];
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t j = 0; j < jn; ++j) tile[i * st[2] + j * st[3]] += s.ds[i * Bc + j];
          }
        }
      }
    }
  }
}

}  // namespace

template <typename T>
size_t attention_bwd_workspace_bytes(const AttentionParams& p, bool with_dbias) {
  (void)with_dbias;
  const Geometry g(p);
  Arena arena(nullptr);
  arena.take<float>(plan_backward<T>(g).dq_acc_floats);
  for (int i = 0; i < thread_count(p); ++i) carve_backward(g, arena);
  return arena.used() + 64;
}

template <typename T>
void attention_bwd(const AttentionParams& p, const T* q, const T* k, const T* v, const T* out,
                   const float* lse, const T* dout, const float* dlse, T* dq, T* dk, T* dv,
                   float* dbias, void* workspace) {
  const Geometry g(p);
  if (g.B == 0 || g.N == 0 || g.H == 0) return;
  const BackwardPlan plan = plan_backward<T>(g);
  const int threads = thread_count(p);
  const int64_t groups = g.B * g.K;
  const int64_t items = groups * plan.chunks;
  const int64_t query_rows = g.B * g.T * g.N;
  const int64_t Br = kRowTile, Bc = kBackwardKeyTile;
  const int64_t* bs = p.bias_strides;
  const int64_t dbias_items = dbias == nullptr ? 0
      : (bs[0] ? g.B : 1) * (bs[1] ? g.N : 1) * (bs[2] ? ceil_div(g.T, Br) : 1) *
        (bs[3] ? ceil_div(g.S, Bc) : 1);

#pragma omp parallel num_threads(threads)
  {
    Arena arena(workspace);
    float* dq_acc = arena.take<float>(plan.dq_acc_floats);
    BackwardScratch s{};
    for (int i = 0; i <= omp_get_thread_num(); ++i) s = carve_backward(g, arena);

    if (plan.dq_direct) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < query_rows; ++r) {
        std::fill(reinterpret_cast<float*>(dq) + r * g.H, reinterpret_cast<float*>(dq) + (r + 1) * g.H, 0.0f);
      }
    } else {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < plan.chunks * query_rows; ++r) {
        std::fill(dq_acc + r * g.Hp, dq_acc + (r + 1) * g.Hp, 0.0f);
      }
    }

    // Chunks holding earlier keys see more query rows under a causal mask.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t chunk = item / groups;
      const int64_t b = (item % groups) / g.K, kh = item % g.K;
      backward_item(p, g, plan, q, k, v, out, lse, dout, dlse, dq, dk, dv, dq_acc, b, kh, chunk,
                    s);
    }

    // dq rows: the accumulators are [chunk, B, N, T, Hp]; dq is [B, T, N, H].
#pragma omp for schedule(static)
    for (int64_t r = 0; r < query_rows; ++r) {
      const int64_t b = r / (g.T * g.N), t = (r / g.N) % g.T, n = r % g.N;
      if (plan.dq_direct) {
        float* row = reinterpret_cast<float*>(dq) + r * g.H;
        for (int64_t h = 0; h < g.H; ++h) row[h] *= p.scale;
      } else {
        std::fill(s.row, s.row + g.H, 0.0f);
        for (int64_t c = 0; c < plan.chunks; ++c) {
          const float* acc = dq_acc + (((c * g.B + b) * g.N + n) * g.T + t) * g.Hp;
          for (int64_t h = 0; h < g.H; ++h) s.row[h] += acc[h];
        }
        for (int64_t h = 0; h < g.H; ++h) s.row[h] *= p.scale;
        store_row(s.row, dq + r * g.H, g.H);
      }
    }

    if (dbias_items > 0) {
      const int64_t nn = bs[1] ? g.N : 1;
      const int64_t nt = bs[2] ? ceil_div(g.T, Br) : 1, nk = bs[3] ? ceil_div(g.S, Bc) : 1;
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < dbias_items; ++item) {
        const int64_t kt = item % nk, tt = (item / nk) % nt;
        const int64_t n = (item / (nk * nt)) % nn, b = item / (nk * nt * nn);
        dbias_item(p, g, plan, q, k, v, out, lse, dout, dlse, dbias, b, n, tt, kt, s);
      }
    }
  }
}

#define JAXOPS_ATTENTION_BWD_INSTANTIATE(T)                                                \
  template size_t attention_bwd_workspace_bytes<T>(const AttentionParams&, bool);         \
  template void attention_bwd<T>(const AttentionParams&, const T*, const T*, const T*,     \
                                 const T*, const float*, const T*, const float*, T*, T*,  \
                                 T*, float*, void*);
JAXOPS_ATTENTION_BWD_INSTANTIATE(float)
JAXOPS_ATTENTION_BWD_INSTANTIATE(bfloat16)
JAXOPS_ATTENTION_BWD_INSTANTIATE(float16)
#undef JAXOPS_ATTENTION_BWD_INSTANTIATE

}  // namespace jaxops::cpu
