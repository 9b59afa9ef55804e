// Flash attention kernels; see attention.h for the contract.
//
// Layout of the work, by pass:
// - Forward: query rows along the SIMD lanes. A score tile is stored
//   transposed, st[key][query row], so the online-softmax statistics (max,
//   sum, rescale) are elementwise vector operations, and the products broadcast
//   key/value elements from their natural layout against packed query tiles.
//   With fewer query rows than lanes (decoding) scores are dot products over H.
// - Backward: keys along the lanes. A key tile is transposed once and serves
//   every query tile that attends to it; query-side rows are read in place.
//   The products into dk/dv/dq vectorise over the head dimension.
// Register-blocked products (gemm, cpu/attention_tiles.h) do the arithmetic;
// bf16 inputs use AVX512_BF16 dot products in the forward where the CPU has
// them. Scores are in log2 units (cpu/attention_tiles.h).
#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
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

// The row-major counterpart of scores_to_logits for one query row t of head n: row[j] = q . k_j of
// keys j0 + j (j < width, a multiple of kLanes) becomes the log2-unit logit,
// -inf where masked. Columns past jn must lie past the row's interval unless
// the tile is inside every row's interval.
void row_logits(const AttentionParams& p, const Geometry& g, int64_t b, int64_t n, int64_t t,
                int64_t kv_valid, int64_t j0, int64_t jn, int64_t width, bool inside,
                float* row) {
  const VecF c = vsplat(p.scale * kLog2e);
  for (int64_t j = 0; j < width; j += kLanes) vstore(row + j, vload(row + j) * c);
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
  if (!inside) {
    VecI iota;
    for (int l = 0; l < kLanes; ++l) iota[l] = l;
    const VecI lo = vsplati(static_cast<int32_t>(std::clamp<int64_t>(g.lo(t) - j0, -1, width)));
    const VecI hi = vsplati(static_cast<int32_t>(std::clamp<int64_t>(g.hi(t, kv_valid) - j0, -1, width)));
    const VecF masked = vsplat(-kInf);
    for (int64_t j = 0; j < width; j += kLanes) {
      const VecI key = iota + static_cast<int32_t>(j);
      vstore(row + j, (key >= lo) & (key < hi) ? vload(row + j) : masked);
    }
  }
}

// ---------------------------------------------------------------------------
// bfloat16 dot products (AVX512_BF16's vdpbf16ps: 32 products per instruction,
// twice the float32 FMA rate), for the bfloat16 forward on CPUs that have them.
// Compiled with a target attribute and chosen at run time, so that the avx512
// variant (x86-64-v4, which does not include BF16) still runs on AVX-512 CPUs
// without them; the other variants have no such path. Operands are pairs of bf16 packed in a
// 32-bit word along the reduction axis; accumulation stays float32.

#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define JAXOPS_BF16_DOT 1
#define JAXOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// C[m, 16 NV] (=, += or scaled +) sum over pairs p of A(m, p) . B(p, :), with
// A(r, p) = a[r * a_rs + p * a_cs] a pair broadcast to every lane and B's rows
// of 16 pairs at b + p * ldb (all in 32-bit words).
template <int MR, int NV, Update U>
JAXOPS_BF16_TARGET inline void dot_block(int64_t pairs, const uint32_t* a, int64_t a_rs,
                                         int64_t a_cs, const uint32_t* b, int64_t ldb, float* c,
                                         int64_t ldc, const float* colscale) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (U == Update::kOverwrite) {
        acc[r][v] = _mm512_setzero_ps();
      } else if constexpr (U == Update::kAdd) {
        acc[r][v] = _mm512_loadu_ps(c + r * ldc + v * 16);
      } else {
        acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(c + r * ldc + v * 16),
                                  _mm512_loadu_ps(colscale + v * 16));
      }
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + v * 16);
    const uint32_t* ap = a + p * a_cs;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r * a_rs]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
  }
}

template <int NV, Update U>
JAXOPS_BF16_TARGET void dot_strip(int64_t m, int64_t pairs, const uint32_t* a, int64_t a_rs,
                                  int64_t a_cs, const uint32_t* b, int64_t ldb, float* c,
                                  int64_t ldc, const float* colscale) {
  for_each_row_block<rows_per_block<NV>()>(m, [&](auto rows, int64_t i) {
    dot_block<decltype(rows)::value, NV, U>(pairs, a + i * a_rs, a_rs, a_cs, b, ldb,
                                            c + i * ldc, ldc, colscale);
  });
}

// n (a multiple of 16) columns in strips of up to 4 vectors.
template <Update U>
JAXOPS_BF16_TARGET void dot_gemm(int64_t m, int64_t n, int64_t pairs, const uint32_t* a,
                                 int64_t a_rs, int64_t a_cs, const uint32_t* b, int64_t ldb,
                                 float* c, int64_t ldc, const float* colscale = nullptr) {
  for (int64_t j = 0; j < n;) {
    const int64_t vecs = std::min<int64_t>(4, (n - j) / 16);
    const float* cs = colscale ? colscale + j : nullptr;
    switch (vecs) {
      case 4: dot_strip<4, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
      case 3: dot_strip<3, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
      case 2: dot_strip<2, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
      default: dot_strip<1, U>(m, pairs, a, a_rs, a_cs, b + j, ldb, c + j, ldc, cs); break;
    }
    j += vecs * 16;
  }
}

// Rows j0 .. j0 + jn of one kv head's values as pairs along the keys:
// out[jp * H + h] = (v[2 jp][h], v[2 jp + 1][h]); an odd last row pairs with 0.
JAXOPS_BF16_TARGET void pack_value_pairs(const uint16_t* v, int64_t ld, int64_t jn, int64_t H,
                                         uint32_t* out) {
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t jp = 0; jp < (jn + 1) / 2; ++jp) {
    const uint16_t* r0 = v + 2 * jp * ld;
    const uint16_t* r1 = 2 * jp + 1 < jn ? r0 + ld : nullptr;
    uint32_t* dst = out + jp * H;
    int64_t h = 0;
    for (; h + 32 <= H; h += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + h);
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + h) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + h, _mm512_permutex2var_epi16(a, first, b));
      _mm512_storeu_si512(dst + h + 16, _mm512_permutex2var_epi16(a, second, b));
    }
    for (; h < H; ++h) dst[h] = r0[h] | (r1 ? static_cast<uint32_t>(r1[h]) << 16 : 0u);
  }
}

// Probabilities st[j][i] (float, jn rows of width Br) rounded to bf16 and
// paired along the keys: out[jp * Br + i] = (P[2 jp][i], P[2 jp + 1][i]).
JAXOPS_BF16_TARGET void pack_probability_pairs(const float* st, int64_t jn, int64_t Br,
                                               uint32_t* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                              25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                              18, 2, 17, 1, 16, 0);
  for (int64_t jp = 0; jp < (jn + 1) / 2; ++jp) {
    const float* r0 = st + 2 * jp * Br;
    const bool has_second = 2 * jp + 1 < jn;
    for (int64_t i = 0; i < Br; i += 16) {
      const __m512 a = _mm512_loadu_ps(r0 + i);
      const __m512 b = has_second ? _mm512_loadu_ps(r0 + Br + i) : _mm512_setzero_ps();
      // cvtne2ps(x, y) puts y's 16 values in the low half, x's in the high half.
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_storeu_si512(out + jp * Br + i, _mm512_permutexvar_epi16(interleave, packed));
    }
  }
}
#endif

// ---------------------------------------------------------------------------
// Forward: the row tiles of cpu/attention_tiles.h.

struct ForwardScratch {
  float* qt;      // [H][Br] query tile, transposed
  float* ot;      // [H][Br] unnormalised output, transposed
  float* st;      // [Bc][Br] scores / probabilities, transposed
  float* kf;      // [Bc][H] key tile as float (non-float inputs)
  float* vf;      // [Bc][H]
  uint32_t* qp;   // [H/2][Br] query tile as bf16 pairs along H (bf16 dot path)
  uint32_t* vp;   // [Bc/2][H] value tile as bf16 pairs along the keys
  uint32_t* pp;   // [Bc/2][Br] probabilities as bf16 pairs along the keys
  float* row;     // [H]
  SoftmaxRows stats;
  int32_t* lo;    // [Br] attended key interval
  int32_t* hi;
  int64_t* t;     // [Br] query index of each row
  int64_t* n;     // [Br] head of each row
  // Few-rows path (T * G < kLanes), row-major:
  float* qn;      // [kLanes][Hp] query rows
  float* on;      // [kLanes][Hp] unnormalised output rows
  float* kn;      // [Bc][Hp] key rows as float (when not read in place)
  float* vn;      // [Bc][Hp]
  float* sn;      // [kLanes][Bc] logits / probabilities
};

ForwardScratch carve_forward(const Geometry& g, int64_t Br, Arena& arena) {
  ForwardScratch s;
  s.qt = arena.take<float>(g.H * Br);
  s.ot = arena.take<float>(g.H * Br);
  s.st = arena.take<float>(kKeyTile * Br);
  s.kf = arena.take<float>(kKeyTile * g.H);
  s.vf = arena.take<float>(kKeyTile * g.H);
  s.qp = arena.take<uint32_t>((g.H + 1) / 2 * Br);
  s.vp = arena.take<uint32_t>(kKeyTile / 2 * g.H);
  s.pp = arena.take<uint32_t>(kKeyTile / 2 * Br);
  s.row = arena.take<float>(g.H);
  s.stats = carve_softmax_rows(Br, arena);
  s.lo = arena.take<int32_t>(Br);
  s.hi = arena.take<int32_t>(Br);
  s.t = arena.take<int64_t>(Br);
  s.n = arena.take<int64_t>(Br);
  s.qn = arena.take<float>(kLanes * g.Hp);
  s.on = arena.take<float>(kLanes * g.Hp);
  s.kn = arena.take<float>(kKeyTile * g.Hp);
  s.vn = arena.take<float>(kKeyTile * g.Hp);
  s.sn = arena.take<float>(kLanes * kKeyTile);
  return s;
}

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
void forward_tile(const AttentionParams& p, const Geometry& g, const T* q, const T* k,
                  const T* v, T* out, float* lse, int64_t b, int64_t kh, int64_t r0,
                  int64_t Br, const ForwardScratch& s) {
  const int64_t H = g.H;
  const bool bf16_dot = forward_uses_bf16_dot<T>(g);
  const RowTile tile = plan_row_tile(g, b, kh, r0, Br, s.t, s.n, s.lo, s.hi);
  const int64_t rows = tile.rows;

  if (tile.attends()) {
    if (bf16_dot) {
      for (int64_t i = 0; i < Br; ++i) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(
            q + ((b * g.T + s.t[i]) * g.N + s.n[i]) * H);
        for (int64_t hp = 0; hp < H / 2; ++hp) s.qp[hp * Br + i] = i < rows ? src[hp] : 0u;
      }
    } else {
      // Queries scaled to log2-unit logits here, once per row, rather than
      // every score tile.
      transpose_query_tile(g, q, b, s.t, s.n, rows, Br, p.scale * kLog2e, s.row, s.qt);
    }
    std::fill(s.ot, s.ot + H * Br, 0.0f);
    std::fill(s.stats.m, s.stats.m + Br, -kInf);
    std::fill(s.stats.l, s.stats.l + Br, 0.0f);

    for (int64_t j0 = tile.key_begin; j0 < tile.key_end; j0 += kKeyTile) {
      const int64_t jn = std::min(kKeyTile, tile.key_end - j0);
      if (j0 + jn < tile.key_end) {
        prefetch_kv_tile(g, k, v, b, kh, j0 + jn, std::min(kKeyTile, tile.key_end - j0 - jn));
      }
      const bool inside = tile.inside(j0, jn);
#if defined(JAXOPS_BF16_DOT)
      if (bf16_dot) {
        const int64_t at = ((b * g.S + j0) * g.K + kh) * H;
        const uint32_t* kp = reinterpret_cast<const uint32_t*>(k + at);
        dot_gemm<Update::kOverwrite>(jn, Br, H / 2, kp, g.K * H / 2, 1, s.qp, Br, s.st, Br);
        scores_to_logits(p, b, s.n, s.t, rows, s.lo, s.hi, inside, false, j0, jn, Br, s.st);
        online_softmax(jn, Br, false, s.st, s.stats);
        pack_value_pairs(reinterpret_cast<const uint16_t*>(v + at), g.K * H, jn, H, s.vp);
        pack_probability_pairs(s.st, jn, Br, s.pp);
        dot_gemm<Update::kScaleAdd>(H, Br, (jn + 1) / 2, s.vp, 1, H, s.pp, Br, s.ot, Br,
                                    s.stats.alpha);
        continue;
      }
#endif
      int64_t ldk;
      const float* kt = kv_tile_as_float(g, k, b, kh, j0, jn, s.kf, &ldk);
      const float* vt = kv_tile_as_float(g, v, b, kh, j0, jn, s.vf, &ldk);
      // The queries carry the scale, so a tile inside every row's interval,
      // with no bias or mask, is logits as it leaves the product, which also
      // gives its maximum.
      const bool logits_as_computed = inside && !p.bias && !p.mask;
      if (logits_as_computed) {
        std::fill(s.stats.tile_max, s.stats.tile_max + Br, -kInf);
        gemm<Update::kOverwriteMax>(jn, Br, H, kt, ldk, 1, s.qt, Br, s.st, Br, s.stats.tile_max);
      } else {
        gemm<Update::kOverwrite>(jn, Br, H, kt, ldk, 1, s.qt, Br, s.st, Br);
        scores_to_logits(p, b, s.n, s.t, rows, s.lo, s.hi, inside, true, j0, jn, Br, s.st);
      }
      online_softmax(jn, Br, logits_as_computed, s.st, s.stats);
      gemm<Update::kScaleAdd>(H, Br, jn, vt, 1, ldk, s.st, Br, s.ot, Br, s.stats.alpha);
    }
  }

  for (int64_t i = 0; i < rows; ++i) {
    T* dst = out + ((b * g.T + s.t[i]) * g.N + s.n[i]) * H;
    float* lse_dst = lse + (b * g.N + s.n[i]) * g.T + s.t[i];
    const bool attended = tile.attends() && s.t[i] < tile.q_valid && s.stats.l[i] > 0.0f;
    if (attended) {
      const float inv = 1.0f / s.stats.l[i];
      for (int64_t h = 0; h < H; ++h) s.row[h] = s.ot[h * Br + i] * inv;
      *lse_dst = row_logsumexp(s.stats.shift[i], s.stats.l[i]);
    } else {
      std::fill(s.row, s.row + H, 0.0f);
      *lse_dst = -kInf;
    }
    narrow_row(s.row, dst, H);
  }
}

// Forward for a kv head with fewer query rows than vector lanes (decoding:
// T * G < kLanes). Rows along the lanes would leave most of them idle; here a
// score is a dot product over H and the output accumulates rows of V, both
// vectorised over H, so the work is proportional to the rows (the pass is
// bound by reading K and V once).
template <typename T>
void forward_few_rows(const AttentionParams& p, const Geometry& g, const T* q, const T* k,
                      const T* v, T* out, float* lse, int64_t b, int64_t kh,
                      const ForwardScratch& s) {
  const int64_t H = g.H, Hp = g.Hp, Bc = kKeyTile;
  const int64_t rows = g.T * g.G;
  const int64_t q_valid = g.q_valid(b), kv_valid = g.kv_valid(b);
  const bool in_place = std::is_same_v<T, float> && H == Hp;
  int64_t t_first = -1, t_last = -1;
  for (int64_t i = 0; i < rows; ++i) {
    s.t[i] = i / g.G;
    s.n[i] = kh * g.G + i % g.G;
    if (s.t[i] < q_valid) {
      if (t_first < 0) t_first = s.t[i];
      t_last = s.t[i];
    }
    widen_row(q + ((b * g.T + s.t[i]) * g.N + s.n[i]) * H, s.qn + i * Hp, H);
    std::fill(s.qn + i * Hp + H, s.qn + (i + 1) * Hp, 0.0f);
  }
  const int64_t key_begin = t_first < 0 ? 0 : g.lo(t_first);
  const int64_t key_end = t_first < 0 ? 0 : g.hi(t_last, kv_valid);
  const int64_t max_lo = t_first < 0 ? 0 : g.lo(t_last);
  const int64_t min_hi = t_first < 0 ? 0 : g.hi(t_first, kv_valid);
  std::fill(s.on, s.on + rows * Hp, 0.0f);
  std::fill(s.stats.m, s.stats.m + rows, -kInf);
  std::fill(s.stats.shift, s.stats.shift + rows, 0.0f);
  std::fill(s.stats.l, s.stats.l + rows, 0.0f);

  for (int64_t j0 = key_begin; j0 < key_end; j0 += Bc) {
    const int64_t jn = std::min(Bc, key_end - j0);
    const int64_t at = ((b * g.S + j0) * g.K + kh) * H;
    if (j0 + jn < key_end) prefetch_kv_tile(g, k, v, b, kh, j0 + jn, std::min(Bc, key_end - j0 - jn));
    const float* kr;
    const float* vr;
    int64_t ld;
    if (in_place) {
      kr = reinterpret_cast<const float*>(k + at);
      vr = reinterpret_cast<const float*>(v + at);
      ld = g.K * H;
    } else {
      load_kv_tile(g, k, b, kh, j0, jn, s.kn, Hp);
      load_kv_tile(g, v, b, kh, j0, jn, s.vn, Hp);
      kr = s.kn;
      vr = s.vn;
      ld = Hp;
    }
    // Columns past jn lie past every row's interval unless the tile is inside.
    const bool inside = max_lo <= j0 && min_hi >= j0 + Bc;
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
      if (s.t[i] < q_valid) {
        row_logits(p, g, b, s.n[i], s.t[i], kv_valid, j0, jn, Bc, inside, srow);
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
      float* oi = s.on + i * Hp;
      for (int64_t h = 0; h < Hp; h += kLanes) vstore(oi + h, vload(oi + h) * vsplat(alpha));
    }
    gemm<Update::kAdd>(rows, Hp, jn, s.sn, Bc, 1, vr, ld, s.on, Hp);
  }

  for (int64_t i = 0; i < rows; ++i) {
    T* dst = out + ((b * g.T + s.t[i]) * g.N + s.n[i]) * H;
    float* lse_dst = lse + (b * g.N + s.n[i]) * g.T + s.t[i];
    if (s.t[i] < q_valid && s.stats.l[i] > 0.0f) {
      const float inv = 1.0f / s.stats.l[i];
      for (int64_t h = 0; h < H; ++h) s.row[h] = s.on[i * Hp + h] * inv;
      *lse_dst = row_logsumexp(s.stats.shift[i], s.stats.l[i]);
    } else {
      std::fill(s.row, s.row + H, 0.0f);
      *lse_dst = -kInf;
    }
    narrow_row(s.row, dst, H);
  }
}

// ---------------------------------------------------------------------------
// Backward. A work item is one (batch, kv head, chunk of key tiles). For each
// key tile it accumulates dk/dv in scratch over every query head of the group
// and every query tile that attends to it, so dk/dv are written once, by one
// item. dq is accumulated per chunk (directly into dq when there is one chunk
// and the layout allows) and the chunks are summed in a fixed order.
//
// Unlike the forward, score tiles here are [query row][key], vectorised over
// keys: the key tile is transposed once and then serves every query tile of
// the group, while query and output-gradient rows are read in place (float
// inputs with H a multiple of the vector width) or converted row by row.

struct BackwardScratch {
  float* kt;     // [H][Bc] key tile, transposed, zero past the tile's keys
  float* vt;     // [H][Bc]
  float* kn;     // [Bc][Hp] key tile as float rows (when not read in place)
  float* dk;     // [Bc][Hp] accumulators
  float* dv;     // [Bc][Hp]
  float* qn;     // [Br][Hp] query rows as float (when not read in place)
  float* dn;     // [Br][Hp] output-gradient rows
  float* p;      // [Br][Bc] probabilities
  float* ds;     // [Br][Bc] dP, then dS (the gradient of the logits)
  float* row;    // [Hp]
  float* row2;   // [Hp]
  float* delta;  // [G * T] rowsum(dout * out) - dlse, per (head of the group, row)
  float* lse2;   // [G * T] logsumexp in log2 units; +inf: the row has no key
};

BackwardScratch carve_backward(const Geometry& g, Arena& arena) {
  const int64_t Br = kRowTile, Bc = kBackwardKeyTile;
  BackwardScratch s;
  s.kt = arena.take<float>(g.H * Bc);
  s.vt = arena.take<float>(g.H * Bc);
  s.kn = arena.take<float>(Bc * g.Hp);
  s.dk = arena.take<float>(Bc * g.Hp);
  s.dv = arena.take<float>(Bc * g.Hp);
  s.qn = arena.take<float>(Br * g.Hp);
  s.dn = arena.take<float>(Br * g.Hp);
  s.p = arena.take<float>(Br * Bc);
  s.ds = arena.take<float>(Br * Bc);
  s.row = arena.take<float>(g.Hp);
  s.row2 = arena.take<float>(g.Hp);
  s.delta = arena.take<float>(g.G * g.T);
  s.lse2 = arena.take<float>(g.G * g.T);
  return s;
}

struct BackwardPlan {
  int64_t key_tiles;
  int64_t chunks;         // key-tile chunks per (batch, kv head)
  bool in_place;          // float rows with H % lanes == 0 are read where they are
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
  plan.in_place = std::is_same_v<T, float> && g.H == g.Hp;
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
    const int64_t at = ((b * g.T + t0 + i) * g.N + n) * g.H;
    widen_row(out + at, row, g.H);
    widen_row(dout + at, row2, g.H);
    float sum = 0.0f;
    for (int64_t h = 0; h < g.H; ++h) sum += row[h] * row2[h];
    const int64_t stat = (b * g.N + n) * g.T + t0 + i;
    delta[i] = dlse ? sum - dlse[stat] : sum;
    lse2[i] = lse[stat] == -kInf ? kInf : lse[stat] * kLog2e;
  }
}

// Rows t0 .. t0 + rows of head n of a [B, X, N, H] tensor as float rows:
// in place, or converted into buf (stride Hp, zero padded). Returns the first
// row; *ld is the row stride.
template <typename T>
const float* query_side_rows(const Geometry& g, bool in_place, const T* x, int64_t b, int64_t n,
                             int64_t t0, int64_t rows, float* buf, int64_t* ld) {
  const T* first = x + ((b * g.T + t0) * g.N + n) * g.H;
  if (in_place) {
    *ld = g.N * g.H;
    return reinterpret_cast<const float*>(first);
  }
  for (int64_t i = 0; i < rows; ++i) {
    widen_row(first + i * g.N * g.H, buf + i * g.Hp, g.H);
    std::fill(buf + i * g.Hp + g.H, buf + (i + 1) * g.Hp, 0.0f);
  }
  *ld = g.Hp;
  return buf;
}

// The key and value tile of keys j0 .. j0 + jn: transposed (kt, vt: [H][Bc],
// zero past jn) for the score products, and the keys as rows for dq.
template <typename T>
const float* load_backward_kv_tile(const Geometry& g, bool in_place, const T* k, const T* v,
                                   int64_t b, int64_t kh, int64_t j0, int64_t jn,
                                   const BackwardScratch& s, int64_t* ld_k) {
  const int64_t Bc = kBackwardKeyTile;
  std::fill(s.kt, s.kt + g.H * Bc, 0.0f);
  std::fill(s.vt, s.vt + g.H * Bc, 0.0f);
  for (int64_t j = 0; j < jn; ++j) {
    const int64_t at = ((b * g.S + j0 + j) * g.K + kh) * g.H;
    widen_row(k + at, s.row, g.H);
    for (int64_t h = 0; h < g.H; ++h) s.kt[h * Bc + j] = s.row[h];
    widen_row(v + at, s.row, g.H);
    for (int64_t h = 0; h < g.H; ++h) s.vt[h * Bc + j] = s.row[h];
  }
  if (in_place) {
    *ld_k = g.K * g.H;
    return reinterpret_cast<const float*>(k + ((b * g.S + j0) * g.K + kh) * g.H);
  }
  load_kv_tile(g, k, b, kh, j0, jn, s.kn, g.Hp);
  *ld_k = g.Hp;
  return s.kn;
}

// For query rows t0 .. t0 + rows of head n (rows qr / dr, statistics delta /
// lse2 indexed by row) against the loaded key tile: s.p = P and s.ds = dS.
void probabilities_and_logit_grads(const AttentionParams& p, const Geometry& g, int64_t b,
                                   int64_t n, int64_t t0, int64_t rows, int64_t kv_valid,
                                   int64_t j0, int64_t jn, const float* qr, int64_t ld_q,
                                   const float* dr, int64_t ld_d, const float* delta,
                                   const float* lse2, const BackwardScratch& s) {
  const int64_t Bc = kBackwardKeyTile;
  gemm<Update::kOverwrite>(rows, Bc, g.H, qr, ld_q, 1, s.kt, Bc, s.p, Bc);
  gemm<Update::kOverwrite>(rows, Bc, g.H, dr, ld_d, 1, s.vt, Bc, s.ds, Bc);
  // Columns past jn (the last tile) lie past every row's interval.
  const bool inside = g.lo(t0 + rows - 1) <= j0 && g.hi(t0, kv_valid) >= j0 + Bc;
  for (int64_t i = 0; i < rows; ++i) {
    float* prow = s.p + i * Bc;
    float* dsrow = s.ds + i * Bc;
    row_logits(p, g, b, n, t0 + i, kv_valid, j0, jn, Bc, inside, prow);
    const VecF shift = vsplat(lse2[i]);
    const VecF row_delta = vsplat(delta[i]);
    for (int64_t j = 0; j < Bc; j += kLanes) {
      const VecF prob = vexp2(vload(prow + j) - shift);
      vstore(prow + j, prob);
      vstore(dsrow + j, prob * (vload(dsrow + j) - row_delta));
    }
  }
}

template <typename T>
void backward_item(const AttentionParams& p, const Geometry& g, const BackwardPlan& plan,
                   const T* q, const T* k, const T* v, const T* out, const float* lse,
                   const T* dout, const float* dlse, T* dq, T* dk, T* dv, float* dq_acc,
                   int64_t b, int64_t kh, int64_t chunk, const BackwardScratch& s) {
  const int64_t Br = kRowTile, Bc = kBackwardKeyTile, H = g.H, Hp = g.Hp;
  const int64_t q_valid = g.q_valid(b), kv_valid = g.kv_valid(b);
  const int64_t tile_begin = plan.key_tiles * chunk / plan.chunks;
  const int64_t tile_end = plan.key_tiles * (chunk + 1) / plan.chunks;

  for (int64_t gi = 0; gi < g.G; ++gi) {
    row_statistics(g, out, lse, dout, dlse, b, kh * g.G + gi, 0, q_valid, s.delta + gi * g.T,
                   s.lse2 + gi * g.T, s.row, s.row2);
  }
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t j0 = tile * Bc;
    const int64_t jn = std::min(Bc, g.S - j0);
    int64_t t_begin, t_end;
    rows_meeting_keys(g, q_valid, kv_valid, j0, j0 + jn, &t_begin, &t_end);
    std::fill(s.dk, s.dk + jn * Hp, 0.0f);
    std::fill(s.dv, s.dv + jn * Hp, 0.0f);
    int64_t ld_k = 0;
    const float* kr = t_begin < t_end
        ? load_backward_kv_tile(g, plan.in_place, k, v, b, kh, j0, jn, s, &ld_k) : nullptr;
    for (int64_t gi = 0; gi < g.G && t_begin < t_end; ++gi) {
      const int64_t n = kh * g.G + gi;
      for (int64_t t0 = t_begin; t0 < t_end; t0 += Br) {
        const int64_t rows = std::min(Br, t_end - t0);
        int64_t ld_q, ld_d;
        const float* qr = query_side_rows(g, plan.in_place, q, b, n, t0, rows, s.qn, &ld_q);
        const float* dr = query_side_rows(g, plan.in_place, dout, b, n, t0, rows, s.dn, &ld_d);
        probabilities_and_logit_grads(p, g, b, n, t0, rows, kv_valid, j0, jn, qr, ld_q, dr, ld_d,
                                      s.delta + gi * g.T + t0, s.lse2 + gi * g.T + t0, s);
        gemm<Update::kAdd>(jn, Hp, rows, s.p, 1, Bc, dr, ld_d, s.dv, Hp);
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
        gemm<Update::kAdd>(rows, Hp, jn, s.ds, Bc, 1, kr, ld_k, dq_rows, ld_dq);
      }
    }
    for (int64_t j = 0; j < jn; ++j) {
      const int64_t at = ((b * g.S + j0 + j) * g.K + kh) * H;
      for (int64_t h = 0; h < H; ++h) s.row[h] = s.dk[j * Hp + h] * p.scale;
      narrow_row(s.row, dk + at, H);
      narrow_row(s.dv + j * Hp, dv + at, H);
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
        int64_t ld_k;
        load_backward_kv_tile(g, plan.in_place, k, v, b, kh, j0, jn, s, &ld_k);
        for (int64_t t0 = t_begin; t0 < t_end; t0 += Br) {
          const int64_t rows = std::min(Br, t_end - t0);
          int64_t ld_q, ld_d;
          const float* qr = query_side_rows(g, plan.in_place, q, b, n, t0, rows, s.qn, &ld_q);
          const float* dr = query_side_rows(g, plan.in_place, dout, b, n, t0, rows, s.dn, &ld_d);
          row_statistics(g, out, lse, dout, dlse, b, n, t0, rows, s.delta, s.lse2, s.row, s.row2);
          probabilities_and_logit_grads(p, g, b, n, t0, rows, kv_valid, j0, jn, qr, ld_q, dr,
                                        ld_d, s.delta, s.lse2, s);
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
size_t attention_fwd_workspace_bytes(const AttentionParams& p) {
  const Geometry g(p);
  return row_tile_workspace_bytes(
      p, [&](Arena& arena) { return carve_forward(g, forward_row_tile(g), arena); });
}

template <typename T>
void attention_fwd(const AttentionParams& p, const T* q, const T* k, const T* v, T* out,
                   float* lse, void* workspace) {
  const Geometry g(p);
  if (g.B == 0 || g.T == 0 || g.N == 0) return;
  const int64_t Br = forward_row_tile(g);
  const bool few_rows = g.T * g.G < kLanes;
  run_row_tile_items(
      g, Br, thread_count(p), workspace, [&](Arena& arena) { return carve_forward(g, Br, arena); },
      [&](const ForwardScratch& s, int64_t b, int64_t kh, int64_t r0) {
        if (few_rows) {
          forward_few_rows(p, g, q, k, v, out, lse, b, kh, s);
        } else {
          forward_tile(p, g, q, k, v, out, lse, b, kh, r0, Br, s);
        }
      });
}

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
        narrow_row(s.row, dq + r * g.H, g.H);
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

#define JAXOPS_ATTENTION_INSTANTIATE(T)                                                    \
  template size_t attention_fwd_workspace_bytes<T>(const AttentionParams&);               \
  template void attention_fwd<T>(const AttentionParams&, const T*, const T*, const T*, T*, \
                                 float*, void*);                                          \
  template size_t attention_bwd_workspace_bytes<T>(const AttentionParams&, bool);         \
  template void attention_bwd<T>(const AttentionParams&, const T*, const T*, const T*,     \
                                 const T*, const float*, const T*, const float*, T*, T*,  \
                                 T*, float*, void*);
JAXOPS_ATTENTION_INSTANTIATE(float)
JAXOPS_ATTENTION_INSTANTIATE(bfloat16)
JAXOPS_ATTENTION_INSTANTIATE(float16)
#undef JAXOPS_ATTENTION_INSTANTIATE

}  // namespace jaxops::cpu