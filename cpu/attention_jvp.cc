// Forward-mode (JVP) flash attention on the CPU; see attention.h for the
// contract and cpu/attention_tiles.h for the shared building blocks.
//
// Per query row i (logits s_ij over its attended keys j, p_ij = exp(s_ij - lse_i)):
//   ds_ij     = scale (dq_i . k_j + q_i . dk_j) + dbias_ij   (the logits' tangent)
//   dlse_i    = mu_i = sum_j p_ij ds_ij
//   dout_i    = sum_j p_ij (ds_ij - mu_i) v_j + sum_j p_ij dv_j
// computed in the forward's single pass: with the online softmax's
// unnormalised probabilities e_ij (running max, rescale alpha per key tile)
// the tile loop accumulates O = sum e v, dO = sum e (ds - c) v + e dv and
// M = sum e (ds - c), all rescaled by alpha like the running sum l, and the
// rows end with out = O / l, mu = M / l + c, dout = dO / l - (M / l) out.
// Any per-row constant c gives the same result in exact arithmetic; the
// kernel takes the e-weighted mean of ds over the tile that last raised the
// row's maximum (online_softmax_with_tangent), so that where ds is large and
// nearly constant over the keys that carry the weight (a query of 1e30: ds
// ~1e31 at a one-hot key) e (ds - c) stays small and e dv is not absorbed
// into it. Without the shift such a row's output tangent came out all zero
// (issue 43, item 2); the CUDA kernel shifts the same way.
//
// Work items, tiles and order are the forward's (row tiles of
// cpu/attention_tiles.h: query rows along the lanes, transposed score tiles).
// Per key tile, two paired products (each operand element loaded once for
// the value and its tangent) do the 6 matrix products: scores and their
// tangents, st = K q and dst = K dq + dK q, then O += V e and
// dO += V (e ds) + dV e. Absent tangents drop their terms. Smaller
// inputs (bf16, f16) are widened to float tiles.
#include "cpu/attention.h"

#include <algorithm>

#include "cpu/attention_tiles.h"

namespace jaxops::cpu {
using namespace attention_internal;
namespace {

template <typename T>
struct InputTangents {
  const T* dq;
  const T* dk;
  const T* dv;
  const float* dbias;
};

struct JvpScratch : TileRowState {
  float* qt;    // [H][Br] query tile times scale * log2(e), transposed
  float* dqt;   // [H][Br] its tangent, the same
  float* ot;    // [Hv][Br] unnormalised output O, transposed
  float* dot;   // [Hv][Br] unnormalised output tangent dO
  float* st;    // [Bc][Br] logits, then probabilities e, transposed
  float* dst;   // [Bc][Br] logits' tangents (log2 units), then e * ds
  float* kf;    // [Bc][H] key tile as float (non-float inputs)
  float* dkf;   // [Bc][H]
  float* vf;    // [Bc][Hv]
  float* dvf;   // [Bc][Hv]
  float* mu;    // [Br] M, the running sum of e * (ds - c)
  float* shift_of_tangents;  // [Br] c (log2 units), the shift of ds
  KvHeadRows kv;   // the kv head's K/V as float rows (keeps_kv_head_rows)
  KvHeadRows dkv;  // and their tangents dK/dV
};

JvpScratch carve_jvp(const Geometry& g, int64_t Br, Arena& arena) {
  JvpScratch s;
  s.qt = arena.take<float>(g.H * Br);
  s.dqt = arena.take<float>(g.H * Br);
  s.ot = arena.take<float>(g.Hv * Br);
  s.dot = arena.take<float>(g.Hv * Br);
  s.st = arena.take<float>(kKeyTile * Br);
  s.dst = arena.take<float>(kKeyTile * Br);
  s.kf = arena.take<float>(kKeyTile * g.H);
  s.dkf = arena.take<float>(kKeyTile * g.H);
  s.vf = arena.take<float>(kKeyTile * g.Hv);
  s.dvf = arena.take<float>(kKeyTile * g.Hv);
  s.mu = arena.take<float>(Br);
  s.shift_of_tangents = arena.take<float>(Br);
  s.kv = carve_kv_head_rows(g, keeps_kv_head_rows(g, Br), arena);
  s.dkv = carve_kv_head_rows(g, keeps_kv_head_rows(g, Br), arena);
  carve_tile_row_state(s, g, Br, arena);
  return s;
}

// online_softmax (cpu/attention_tiles.h) with the logits' tangents: dst[j][i]
// holds them (log2 units) and becomes e * (ds - c) in natural units, mu
// accumulates its sum, rescaled by alpha like l. The shift c of a row is the
// e-weighted mean of ds over the tile that raised its maximum last: when a
// tile raises it, the earlier accumulators, which hold e * (ds - c_old), are
// moved to the new shift (dO += (c_old - c_new) O, M += (c_old - c_new) l)
// before alpha rescales them, a product of Hv x Br per raising tile against
// the tile's Hv x Br x jn. A key the row does not attend has e = 0 and adds
// nothing, whatever its tangent holds (a non-finite bias tangent at a masked
// key); a NaN e (a NaN reached the row's logits) carries on.
void online_softmax_with_tangent(int64_t jn, int64_t Br, int64_t Hv, bool max_known, float* st,
                                 const SoftmaxRows& s, float* dst, float* mu, float* shift,
                                 const float* ot, float* dot) {
  for (int64_t c = 0; c < Br; c += kLanes) {
    const RowMaxStep step = update_row_max(jn, Br, c, max_known, st, s);
    const VecF m_old = step.m_old, m_new = step.m_new, row_shift = step.shift;
    const VecF alpha = step.alpha;
    VecF sum{}, weighted_tangents{};
    for (int64_t j = 0; j < jn; ++j) {
      const VecF prob = exp2_of_shifted(vload(st + j * Br + c) - row_shift);
      vstore(st + j * Br + c, prob);
      sum += prob;
      const VecF weighted = prob * vload(dst + j * Br + c);
      weighted_tangents += prob != VecF{} ? weighted : VecF{};  // NaN prob: attended
    }
    // Rows whose maximum this tile raised take its mean tangent as their shift.
    const VecF c_old = vload(shift + c);
    const VecF raised = m_new > m_old ? vsplat(1.0f) : VecF{};
    const VecF c_new = raised != VecF{} ? weighted_tangents / sum : c_old;
    vstore(shift + c, c_new);
    // Rows with earlier accumulators (m_old finite) move them to the new shift.
    const VecF earlier = m_old != vsplat(-kInf) ? raised : VecF{};
    const VecF move = earlier != VecF{} ? (c_old - c_new) * vsplat(kLn2) : VecF{};
    VecF l_old = vload(s.l + c);
    VecF mu_old = vload(mu + c);
    bool any_move = false;
    for (int i = 0; i < kLanes; ++i) any_move |= move[i] != 0.0f;
    if (any_move) {
      mu_old = vfma(move, l_old, mu_old);
      for (int64_t h = 0; h < Hv; ++h) {
        vstore(dot + h * Br + c, vfma(move, vload(ot + h * Br + c), vload(dot + h * Br + c)));
      }
    }
    VecF tangent_sum{};
    for (int64_t j = 0; j < jn; ++j) {
      const VecF prob = vload(st + j * Br + c);
      const VecF centred = prob * ((vload(dst + j * Br + c) - c_new) * vsplat(kLn2));
      const VecF attended = prob != VecF{} ? centred : VecF{};
      vstore(dst + j * Br + c, attended);
      tangent_sum += attended;
    }
    vstore(s.l + c, vfma(l_old, alpha, sum));
    vstore(mu + c, vfma(mu_old, alpha, tangent_sum));
  }
}

template <typename T>
void jvp_tile(const AttentionParams& p, const Geometry& g, const T* q, const T* k, const T* v,
              const InputTangents<T>& d, T* out, float* lse, T* dout, float* dlse, int64_t b,
              int64_t kh, int64_t r0, int64_t Br, const JvpScratch& s) {
  const int64_t H = g.H, Hv = g.Hv;
  const RowTile tile = plan_row_tile(g, b, kh, r0, Br, s.t, s.n, s.lo, s.hi, s.ids);
  const int64_t rows = tile.rows;
  // The products' tangent terms: the scores' A = K, B = q; the values' A = V,
  // B = e, whose tangent is e * ds when the logits have one.
  const bool logits_have_tangent = d.dq || d.dk || d.dbias;
  const int score_terms = (d.dq ? kTangentOfB : 0) | (d.dk ? kTangentOfA : 0);
  const int value_terms = (logits_have_tangent ? kTangentOfB : 0) | (d.dv ? kTangentOfA : 0);
  const bool keep_kv = keeps_kv_head_rows(g, Br);

  if (tile.attends()) {
    // At (1, 2048, 8, 64) f32 the transposes below took 4% of the kernel
    // without, 2% with.
    prefetch_tile_rows<false>(g, q, H, b, s.t, s.n, rows);
    if (d.dq) prefetch_tile_rows<false>(g, d.dq, H, b, s.t, s.n, rows);
    // Queries and their tangents scaled to log2-unit logits once per row.
    const float logit_scale = p.scale * kLog2e;
    transpose_query_tile(g, q, b, s.t, s.n, rows, Br, logit_scale, s.row, s.qt);
    if (d.dq) transpose_query_tile(g, d.dq, b, s.t, s.n, rows, Br, logit_scale, s.row, s.dqt);
    std::fill(s.ot, s.ot + Hv * Br, 0.0f);
    std::fill(s.dot, s.dot + Hv * Br, 0.0f);
    std::fill(s.mu, s.mu + Br, 0.0f);
    std::fill(s.shift_of_tangents, s.shift_of_tangents + Br, 0.0f);
    std::fill(s.stats.m, s.stats.m + Br, -kInf);
    std::fill(s.stats.l, s.stats.l + Br, 0.0f);

    // Key tiles of other documents only are stepped over before any product.
    for (int64_t j0 = next_attended_tile(g, b, tile, tile.key_begin), next; j0 < tile.key_end;
         j0 = next) {
      const int64_t jn = std::min(kKeyTile, tile.key_end - j0);
      next = next_attended_tile(g, b, tile, j0 + jn);
      if (next < tile.key_end) {
        const int64_t next_n = std::min(kKeyTile, tile.key_end - next);
        if (!keep_kv || kv_rows_missing(g, b, kh, next, next_n, s.kv)) {
          for (const T* x : {k, d.dk}) {
            if (x) prefetch_kv_rows(g, x, H, b, kh, next, next_n);
          }
          for (const T* x : {v, d.dv}) {
            if (x) prefetch_kv_rows(g, x, Hv, b, kh, next, next_n);
          }
        }
      } else {
        // The rows the results go to, written after this last tile: at
        // (1, 1024, 8, 64) f32 on one thread the writes took 6% of the kernel
        // without, 3% with.
        prefetch_tile_rows<true>(g, out, Hv, b, s.t, s.n, rows);
        prefetch_tile_rows<true>(g, dout, Hv, b, s.t, s.n, rows);
      }
      const TileSegments segments = tile_segments(g, b, tile.ids, j0, jn);
      int64_t ld = H, ldv = Hv;
      const float *kt, *vt, *dkt = nullptr, *dvt = nullptr;
      if (keep_kv) {
        hold_kv_rows(g, k, v, b, kh, j0, jn, s.kv);
        kt = s.kv.k + j0 * H;
        vt = s.kv.v + j0 * Hv;
        if (d.dk || d.dv) {
          hold_kv_rows(g, d.dk, d.dv, b, kh, j0, jn, s.dkv);
          if (d.dk) dkt = s.dkv.k + j0 * H;
          if (d.dv) dvt = s.dkv.v + j0 * Hv;
        }
      } else {
        kt = kv_tile_as_float(g, k, H, b, kh, j0, jn, s.kf, &ld);
        vt = kv_tile_as_float(g, v, Hv, b, kh, j0, jn, s.vf, &ldv);
        if (d.dk) dkt = kv_tile_as_float(g, d.dk, H, b, kh, j0, jn, s.dkf, &ld);
        if (d.dv) dvt = kv_tile_as_float(g, d.dv, Hv, b, kh, j0, jn, s.dvf, &ldv);
      }

      // As in the forward: a tile inside every row's interval, with no bias,
      // mask or segment test, is logits as it leaves the product (capped in
      // place), which gives its maximum. The cap's slope multiplies the
      // products' tangents (not the bias tangent, added after the cap).
      const bool inside = tile.inside(j0, jn);
      const bool logits_as_computed = inside && !p.bias && !p.mask && !segments.key_ids;
      float* score_tangents = score_terms != kNoTangent ? s.dst : nullptr;
      if (logits_as_computed) {
        std::fill(s.stats.tile_max, s.stats.tile_max + Br, -kInf);
        paired_gemm<Update::kOverwriteMax>(score_terms, jn, Br, H, kt, dkt, ld, 1, s.qt, s.dqt,
                                           Br, s.st, s.dst, Br, s.stats.tile_max);
        soft_cap_tile_as_computed(g, jn, Br, s.st, s.stats.tile_max, score_tangents);
      } else {
        paired_gemm<Update::kOverwrite>(score_terms, jn, Br, H, kt, dkt, ld, 1, s.qt, s.dqt, Br,
                                        s.st, s.dst, Br);
        scores_to_logits(p, g, b, s.n, s.t, rows, s.lo, s.hi, inside, true, j0, jn, Br, s.st,
                         s.ids, segments.key_ids, score_tangents);
      }
      if (d.dbias) {
        if (score_terms == kNoTangent) std::fill(s.dst, s.dst + jn * Br, 0.0f);
        add_bias_tile(d.dbias, p.bias_strides, b, s.n, s.t, rows, j0, jn, s.dst, Br);
      }
      if (logits_have_tangent) {
        online_softmax_with_tangent(jn, Br, Hv, logits_as_computed, s.st, s.stats, s.dst, s.mu,
                                    s.shift_of_tangents, s.ot, s.dot);
      } else {
        online_softmax(jn, Br, logits_as_computed, s.st, s.stats);
      }
      paired_gemm<Update::kScaleAdd>(value_terms, Hv, Br, jn, vt, dvt, 1, ldv, s.st, s.dst, Br,
                                     s.ot, s.dot, Br, s.stats.alpha);
    }
  }

  for (int64_t i = 0; i < rows; ++i) {
    T* out_row = out + ((b * g.T + s.t[i]) * g.N + s.n[i]) * Hv;
    T* dout_row = dout + ((b * g.T + s.t[i]) * g.N + s.n[i]) * Hv;
    const int64_t stat = (b * g.N + s.n[i]) * g.T + s.t[i];
    const bool attended = tile.attends() && s.t[i] < tile.q_valid && !(s.stats.l[i] == 0.0f);  // NaN l: a NaN row
    if (attended) {
      const float inv = 1.0f / s.stats.l[i];
      const float centred_mu = s.mu[i] * inv;
      for (int64_t h = 0; h < Hv; ++h) {
        const float o = s.ot[h * Br + i] * inv;
        out_row[h] = static_cast<T>(o);
        dout_row[h] = static_cast<T>(s.dot[h * Br + i] * inv - centred_mu * o);
      }
      lse[stat] = row_logsumexp(s.stats.shift[i], s.stats.l[i]);
      // Where no tangent reaches the logits the shift stays 0.
      dlse[stat] = centred_mu + s.shift_of_tangents[i] * kLn2;
    } else {
      std::fill(out_row, out_row + Hv, static_cast<T>(0.0f));
      std::fill(dout_row, dout_row + Hv, static_cast<T>(0.0f));
      lse[stat] = -kInf;
      dlse[stat] = 0.0f;
    }
  }
}

}  // namespace

template <typename T>
size_t attention_fwd_jvp_workspace_bytes(const AttentionParams& p) {
  const Geometry g(p);
  return row_tile_workspace_bytes(
      p, [&](Arena& arena) { return carve_jvp(g, forward_row_tile(g), arena); });
}

template <typename T>
void attention_fwd_jvp(const AttentionParams& p, const T* q, const T* k, const T* v,
                       const T* dq, const T* dk, const T* dv, const float* dbias, T* out,
                       float* lse, T* dout, float* dlse, void* workspace) {
  const Geometry g(p);
  if (g.B == 0 || g.T == 0 || g.N == 0) return;
  const InputTangents<T> d{dq, dk, dv, dbias};
  // Decoding shapes (T * G < kLanes) take the same path with padded tiles:
  // correct, with idle lanes.
  const int64_t Br = forward_row_tile(g);
  run_row_tile_items(
      g, Br, thread_count(p), workspace, [&](Arena& arena) { return carve_jvp(g, Br, arena); },
      [&](const JvpScratch& s, int64_t b, int64_t kh, int64_t r0) {
        jvp_tile(p, g, q, k, v, d, out, lse, dout, dlse, b, kh, r0, Br, s);
      },
      [](const JvpScratch& s) {
        *s.kv.head = -1;
        *s.dkv.head = -1;
      });
}

#define JAXOPS_ATTENTION_JVP_INSTANTIATE(T)                                                   \
  template size_t attention_fwd_jvp_workspace_bytes<T>(const AttentionParams&);              \
  template void attention_fwd_jvp<T>(const AttentionParams&, const T*, const T*, const T*,   \
                                     const T*, const T*, const T*, const float*, T*, float*, \
                                     T*, float*, void*);
JAXOPS_ATTENTION_JVP_INSTANTIATE(float)
JAXOPS_ATTENTION_JVP_INSTANTIATE(bfloat16)
JAXOPS_ATTENTION_JVP_INSTANTIATE(float16)
#undef JAXOPS_ATTENTION_JVP_INSTANTIATE

}  // namespace jaxops::cpu
