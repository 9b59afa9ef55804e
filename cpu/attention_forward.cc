// Flash attention forward on the CPU; see attention.h for the contract and
// cpu/attention_tiles.h for the building blocks it shares with the other
// passes.
//
// Query rows lie along the SIMD lanes. A score tile is stored transposed,
// st[key][query row], so the online-softmax statistics (max, sum, rescale) are
// elementwise vector operations, and the register-blocked products
// (cpu/gemm_microkernels.h) broadcast key/value elements from their natural
// layout against packed query tiles. bf16 inputs use AVX512_BF16 dot products
// (cpu/gemm_bf16_microkernels.h) where the CPU has them. With fewer query rows
// than lanes (decoding) the forward is cpu/attention_decode.cc's.
#include "cpu/attention.h"

#include <algorithm>
#include <type_traits>

#include "cpu/attention_tiles.h"
#include "cpu/gemm_bf16_microkernels.h"

namespace jaxops::cpu {
using namespace attention_internal;
namespace {

struct ForwardScratch : TileRowState {
  float* qt;      // [H][Br] query tile, transposed
  float* ot;      // [Hv][Br] unnormalised output, transposed
  float* st;      // [Bc][Br] scores / probabilities, transposed
  float* kf;      // [Bc][H] key tile as float (non-float inputs)
  float* vf;      // [Bc][Hv]
  uint32_t* qp;   // [H/2][Br] query tile as bf16 pairs along H (bf16 dot path)
  uint32_t* vp;   // [Bc/2][Hv] value tile as bf16 pairs along the keys
  uint32_t* pp;   // [Bc/2][Br] probabilities as bf16 pairs along the keys
  KvHeadRows kv;  // the kv head's K/V as float rows (keeps_kv_head_rows)
};

// Whether the bfloat16 forward uses the bf16 dot-product path.
template <typename T>
bool forward_uses_bf16_dot(const Geometry& g) {
#if defined(JAXOPS_BF16_DOT)
  return std::is_same_v<T, bfloat16> && g.H % 2 == 0 && cpu_has_bf16_dot();
#else
  (void)g;
  return false;
#endif
}

template <typename T>
ForwardScratch carve_forward(const Geometry& g, int64_t Br, Arena& arena) {
  ForwardScratch s;
  s.qt = arena.take<float>(g.H * Br);
  s.ot = arena.take<float>(g.Hv * Br);
  s.st = arena.take<float>(kKeyTile * Br);
  s.kf = arena.take<float>(kKeyTile * g.H);
  s.vf = arena.take<float>(kKeyTile * g.Hv);
  s.qp = arena.take<uint32_t>((g.H + 1) / 2 * Br);
  s.vp = arena.take<uint32_t>(kKeyTile / 2 * g.Hv);
  s.pp = arena.take<uint32_t>(kKeyTile / 2 * Br);
  s.kv = carve_kv_head_rows(g, keeps_kv_head_rows(g, Br) && !forward_uses_bf16_dot<T>(g), arena);
  carve_tile_row_state(s, g, Br, arena);
  return s;
}

template <typename T>
void forward_tile(const AttentionParams& p, const Geometry& g, const T* q, const T* k,
                  const T* v, T* out, float* lse, int64_t b, int64_t kh, int64_t r0,
                  int64_t Br, const ForwardScratch& s) {
  const int64_t H = g.H, Hv = g.Hv;
  const bool bf16_dot = forward_uses_bf16_dot<T>(g);
  const bool keep_kv = keeps_kv_head_rows(g, Br) && !bf16_dot;
  const RowTile tile = plan_row_tile(g, b, kh, r0, Br, s.t, s.n, s.lo, s.hi, s.ids);
  const int64_t rows = tile.rows;

  if (tile.attends()) {
    if (bf16_dot) {
      for (int64_t i = 0; i < Br; ++i) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(
            q + ((b * g.T + s.t[i]) * g.N + s.n[i]) * H);
        for (int64_t hp = 0; hp < H / 2; ++hp) s.qp[hp * Br + i] = i < rows ? src[hp] : 0u;
      }
    } else {
      // The rows' cache misses overlap (as in the forward mode,
      // cpu/attention_jvp.cc): 3% of the AVX2 forward at (1, 2048, 8, 64)
      // f32 waited on them one row after another. Queries scaled to
      // log2-unit logits here, once per row, rather than every score tile.
      prefetch_tile_rows<false>(g, q, H, b, s.t, s.n, rows);
      transpose_query_tile(g, q, b, s.t, s.n, rows, Br, p.scale * kLog2e, s.row, s.qt);
    }
    std::fill(s.ot, s.ot + Hv * Br, 0.0f);
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
          prefetch_kv_tile(g, k, v, b, kh, next, next_n);
        }
      } else {
        // The rows the results go to, written after this last tile.
        prefetch_tile_rows<true>(g, out, Hv, b, s.t, s.n, rows);
      }
      const bool inside = tile.inside(j0, jn);
      const TileSegments segments = tile_segments(g, b, tile.ids, j0, jn);
#if defined(JAXOPS_BF16_DOT)
      if (bf16_dot) {
        const uint32_t* kp =
            reinterpret_cast<const uint32_t*>(k + ((b * g.S + j0) * g.K + kh) * H);
        dot_gemm<Update::kOverwrite>(jn, Br, H / 2, kp, g.K * H / 2, 1, s.qp, Br, s.st, Br);
        scores_to_logits(p, g, b, s.n, s.t, rows, s.lo, s.hi, inside, false, j0, jn, Br, s.st,
                         s.ids, segments.key_ids);
        online_softmax(jn, Br, false, s.st, s.stats);
        pack_value_pairs(reinterpret_cast<const uint16_t*>(v + ((b * g.S + j0) * g.K + kh) * Hv),
                         g.K * Hv, jn, Hv, s.vp);
        pack_probability_pairs(s.st, jn, Br, s.pp);
        dot_gemm<Update::kScaleAdd>(Hv, Br, (jn + 1) / 2, s.vp, 1, Hv, s.pp, Br, s.ot, Br,
                                    s.stats.alpha);
        continue;
      }
#endif
      int64_t ldk = H, ldv = Hv;
      const float* kt;
      const float* vt;
      if (keep_kv) {
        hold_kv_rows(g, k, v, b, kh, j0, jn, s.kv);
        kt = s.kv.k + j0 * H;
        vt = s.kv.v + j0 * Hv;
      } else {
        kt = kv_tile_as_float(g, k, H, b, kh, j0, jn, s.kf, &ldk);
        vt = kv_tile_as_float(g, v, Hv, b, kh, j0, jn, s.vf, &ldv);
      }
      // The queries carry the scale, so a tile inside every row's interval,
      // with no bias, mask or segment test, is logits as it leaves the product
      // (capped in place), which also gives its maximum.
      const bool logits_as_computed = inside && !p.bias && !p.mask && !segments.key_ids;
      if (logits_as_computed) {
        std::fill(s.stats.tile_max, s.stats.tile_max + Br, -kInf);
        gemm<Update::kOverwriteMax>(jn, Br, H, kt, ldk, 1, s.qt, Br, s.st, Br, s.stats.tile_max);
        soft_cap_tile_as_computed(g, jn, Br, s.st, s.stats.tile_max);
      } else {
        gemm<Update::kOverwrite>(jn, Br, H, kt, ldk, 1, s.qt, Br, s.st, Br);
        scores_to_logits(p, g, b, s.n, s.t, rows, s.lo, s.hi, inside, true, j0, jn, Br, s.st,
                         s.ids, segments.key_ids);
      }
      online_softmax(jn, Br, logits_as_computed, s.st, s.stats);
      gemm<Update::kScaleAdd>(Hv, Br, jn, vt, 1, ldv, s.st, Br, s.ot, Br, s.stats.alpha);
    }
  }

  store_forward_rows(g, b, s.t, s.n, rows, tile.attends(), tile.q_valid, s.stats, s.ot, 1, Br,
                     s.row, out, lse);
}

}  // namespace

template <typename T>
size_t attention_fwd_workspace_bytes(const AttentionParams& p) {
  const Geometry g(p);
  if (takes_decode_path(g)) return decode_fwd_workspace_bytes<T>(p);
  return row_tile_workspace_bytes(
      p, [&](Arena& arena) { return carve_forward<T>(g, forward_row_tile(g), arena); });
}

template <typename T>
void attention_fwd(const AttentionParams& p, const T* q, const T* k, const T* v, T* out,
                   float* lse, void* workspace) {
  const Geometry g(p);
  if (g.B == 0 || g.T == 0 || g.N == 0) return;
  if (takes_decode_path(g)) return decode_fwd(p, q, k, v, out, lse, workspace);
  const int64_t Br = forward_row_tile(g);
  run_row_tile_items(
      g, Br, thread_count(p), workspace,
      [&](Arena& arena) { return carve_forward<T>(g, Br, arena); },
      [&](const ForwardScratch& s, int64_t b, int64_t kh, int64_t r0) {
        forward_tile(p, g, q, k, v, out, lse, b, kh, r0, Br, s);
      },
      [](const ForwardScratch& s) { *s.kv.head = -1; });
}

#define JAXOPS_ATTENTION_FWD_INSTANTIATE(T)                                                \
  template size_t attention_fwd_workspace_bytes<T>(const AttentionParams&);               \
  template void attention_fwd<T>(const AttentionParams&, const T*, const T*, const T*, T*, \
                                 float*, void*);
JAXOPS_ATTENTION_FWD_INSTANTIATE(float)
JAXOPS_ATTENTION_FWD_INSTANTIATE(bfloat16)
JAXOPS_ATTENTION_FWD_INSTANTIATE(float16)
#undef JAXOPS_ATTENTION_FWD_INSTANTIATE

}  // namespace jaxops::cpu
