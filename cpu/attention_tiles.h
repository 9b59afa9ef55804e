// Building blocks of the CPU attention kernels that more than one pass uses
// (cpu/attention.cc: forward and backward; cpu/attention_jvp.cc: the
// forward-mode kernel): the SIMD layer, row conversions, the register-blocked
// products, the problem geometry and scratch arena, masking and logits, the
// online softmax and the row tiles of the forward-shaped passes. Internal to
// cpu/: not part of the kernels' contract (cpu/attention.h).
//
// Scores are kept in log2 units (x = logit * log2(e)) so the exponential is
// exp2. A masked score is -inf; a row whose running max is -inf uses 0 as its
// shift, so exp2 never sees -inf - -inf.
#pragma once

#include <omp.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// GCC 12 reports the deliberately undefined pass-through operand inside
// avx512fintrin.h's max/roundscale/scalef/cvtph as maybe-uninitialized, or,
// once vmax is inlined into the products' epilogue, as uninitialized. The
// reports come from the including kernel's functions, hence file scope.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/attention.h"

namespace jaxops::cpu::attention_internal {

using bfloat16 = Eigen::bfloat16;
using float16 = Eigen::half;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kInf = std::numeric_limits<float>::infinity();

// Query rows per tile (a multiple of every lane count) and keys per tile of
// the forward-shaped passes.
inline constexpr int64_t kRowTile = 64;
inline constexpr int64_t kKeyTile = 64;

// ---------------------------------------------------------------------------
// SIMD: GCC/Clang vector types, with x86 intrinsics where they beat the generic
// lowering (fused multiply-add, max, exp2's rounding and scaling).

#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
inline constexpr int kMaxVecsPerStrip = 4;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int kLanes = 8;
inline constexpr int kMaxVecsPerStrip = 2;
#else
inline constexpr int kLanes = 4;
inline constexpr int kMaxVecsPerStrip = 2;
#endif

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline VecF vload(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }
inline VecI vloadi(const int32_t* p) {
  VecI v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Broadcasts (not VecF{} + x: adding 0.0f is not an identity for -0.0f, so the
// compiler keeps an extra add in the inner loops).
inline VecF vsplat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)  // the condition of kLanes == 8
  return _mm256_set1_ps(x);
#else
  VecF v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}
inline VecI vsplati(int32_t x) {
  VecI v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
}

inline VecF vfma(VecF a, VecF b, VecF c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline VecF vmax(VecF a, VecF b) {
#if defined(__AVX512F__)
  return _mm512_max_ps(a, b);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_max_ps(a, b);
#else
  return a > b ? a : b;
#endif
}

inline float vsum(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
#endif
}

// 2^x for x <= ~0, exactly 0 below -126 (so masked -inf scores give 0).
// Relative error 2e-8 (near-minimax degree-6 polynomial on [-1/2, 1/2]).
inline VecF vexp2(VecF x) {
  const VecF c6 = vsplat(1.533758477307856e-4f), c5 = vsplat(1.3399870367720723e-3f),
             c4 = vsplat(9.618519805371761e-3f), c3 = vsplat(5.550329014658928e-2f),
             c2 = vsplat(0.24022646248340607f), c1 = vsplat(0.6931471824645996f),
             c0 = vsplat(1.0f);
#if defined(__AVX512F__)
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
  VecF n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VecF f = x - n;
  VecF poly = vfma(vfma(vfma(vfma(vfma(vfma(c6, f, c5), f, c4), f, c3), f, c2), f, c1), f, c0);
  return _mm512_scalef_ps(poly, n);
#else
  VecI tiny = x < vsplat(-126.0f);
  x = vmax(x, vsplat(-126.0f));
  const VecF round_magic = vsplat(12582912.0f);  // 1.5 * 2^23: adds round to integer
  VecF n = (x + round_magic) - round_magic;
  VecF f = x - n;
  VecF poly = vfma(vfma(vfma(vfma(vfma(vfma(c6, f, c5), f, c4), f, c3), f, c2), f, c1), f, c0);
  // Vector casts between same-sized vector types reinterpret the bits (a
  // reference cast would break strict aliasing, which GCC warns of at -O3).
  VecI bits = (VecI)poly + (__builtin_convertvector(n, VecI) << 23);
  bits &= ~tiny;
  return (VecF)bits;
#endif
}

// ---------------------------------------------------------------------------
// Conversions between storage types and float32 rows.

// Rows are short (a head's H values) and converted in the inner loops:
// explicit vectors, not a memcpy call or a loop left to the auto-vectoriser
// (which gives up on it once inlined into an OpenMP region).
inline void widen_row(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

inline void widen_row(const bfloat16* src, float* dst, int64_t n) {
  typedef uint16_t VecU16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t VecU32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VecU16 half;
    std::memcpy(&half, bits + i, sizeof(half));
    const VecU32 widened = __builtin_convertvector(half, VecU32) << 16;
    std::memcpy(dst + i, &widened, sizeof(widened));
  }
  for (; i < n; ++i) {
    const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &widened, sizeof(float));
  }
}

inline void widen_row(const float16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void narrow_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// ---------------------------------------------------------------------------
// Register-blocked products C[m, n] = A[m, k] B[k, n] with n a multiple of
// kLanes. A is read element by element through two strides (broadcast), B is
// row-major with contiguous rows, C row-major. The update, and what the
// per-column vector `col[n]` holds for it:
//   kOverwrite     C = A B                       (col unused)
//   kOverwriteMax  C = A B, col = max(col, max over the rows of C)
//                  (the forward's tile maximum, taken while C is in registers
//                  instead of in another pass over the tile)
//   kAdd           C += A B                      (col unused)
//   kScaleAdd      C = C * col + A B             (col: the online-softmax rescale)
//
// A paired product (the forward-mode kernel) also takes the tangents dA and
// dB of its operands, laid out as A and B, and computes the tangent of C by
// the product rule, dC = A dB + dA B (or one of the two terms: TangentTerms),
// with the same update as C (col's maximum is C's alone). Each element of A
// and B loaded into a register then serves two or three FMAs instead of one.

enum class Update { kOverwrite, kOverwriteMax, kAdd, kScaleAdd };

enum TangentTerms : int {
  kNoTangent = 0,
  kTangentOfB = 1,  // dC = A dB
  kTangentOfA = 2,  // dC = dA B
  kTangentsOfBoth = kTangentOfA | kTangentOfB,
};

template <int MR, int NV, Update U, int D>
inline void gemm_block(int64_t kdim, const float* a, const float* da, int64_t a_rs,
                       int64_t a_cs, const float* b, const float* db, int64_t ldb, float* c,
                       float* dc, int64_t ldc, float* col) {
  constexpr bool kOfA = (D & kTangentOfA) != 0, kOfB = (D & kTangentOfB) != 0;
  constexpr int kTangentRows = D == kNoTangent ? 1 : MR;
  VecF acc[MR][NV];
  VecF dacc[kTangentRows][NV];
  VecF scale[NV];
  if constexpr (U == Update::kScaleAdd) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) scale[v] = vload(col + v * kLanes);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (U == Update::kOverwrite || U == Update::kOverwriteMax) {
        acc[r][v] = VecF{};
        if constexpr (D != kNoTangent) dacc[r][v] = VecF{};
      } else if constexpr (U == Update::kAdd) {
        acc[r][v] = vload(c + r * ldc + v * kLanes);
        if constexpr (D != kNoTangent) dacc[r][v] = vload(dc + r * ldc + v * kLanes);
      } else {
        acc[r][v] = vload(c + r * ldc + v * kLanes) * scale[v];
        if constexpr (D != kNoTangent) dacc[r][v] = vload(dc + r * ldc + v * kLanes) * scale[v];
      }
    }
  }
  for (int64_t p = 0; p < kdim; ++p) {
    VecF bv[NV], dbv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = vload(b + p * ldb + v * kLanes);
      if constexpr (kOfB) dbv[v] = vload(db + p * ldb + v * kLanes);
    }
    const float* ap = a + p * a_cs;
    const float* dap = kOfA ? da + p * a_cs : nullptr;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const VecF av = vsplat(ap[r * a_rs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        acc[r][v] = vfma(av, bv[v], acc[r][v]);
        if constexpr (kOfB) dacc[r][v] = vfma(av, dbv[v], dacc[r][v]);
      }
      if constexpr (kOfA) {
        const VecF dav = vsplat(dap[r * a_rs]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) dacc[r][v] = vfma(dav, bv[v], dacc[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      vstore(c + r * ldc + v * kLanes, acc[r][v]);
      if constexpr (D != kNoTangent) vstore(dc + r * ldc + v * kLanes, dacc[r][v]);
    }
  }
  if constexpr (U == Update::kOverwriteMax) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      VecF block_max = vload(col + v * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) block_max = vmax(block_max, acc[r][v]);
      vstore(col + v * kLanes, block_max);
    }
  }
}

// Rows per register block: the accumulators (MR * NV, twice that for a paired
// product), the NV loaded B vectors (and dB's) and the broadcasts fit the
// register file (32 vector registers with AVX-512, 16 otherwise).
template <int NV, int D = kNoTangent>
constexpr int rows_per_block() {
  if constexpr (D != kNoTangent) {
    if constexpr (kLanes == 16) return NV == 1 ? 12 : NV == 2 ? 6 : NV == 3 ? 4 : 2;
    return NV == 1 ? 5 : 2;
  } else if constexpr (kLanes == 16) {
    return NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 16;
  } else {
    return NV == 2 ? 6 : 12;
  }
}

// Column strips of a paired product: at most 2 vectors wide with AVX-512
// (6 x 2 blocks: 24 accumulators, 36 FMAs per 4 loads and 12 broadcasts),
// 1 otherwise.
inline constexpr int kMaxVecsPerPairedStrip = kLanes == 16 ? 2 : 1;

// Rows 0 .. m in register blocks: of MR rows while they last, then of 4, 2
// and 1. Calls block(rows, i) for the block of rows i .. i + rows, with rows
// a std::integral_constant.
template <int MR, typename Block>
inline void for_each_row_block(int64_t m, Block&& block) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) block(std::integral_constant<int, MR>{}, i);
  for (; i + 4 <= m; i += 4) block(std::integral_constant<int, 4>{}, i);
  if (i + 2 <= m) {
    block(std::integral_constant<int, 2>{}, i);
    i += 2;
  }
  if (i < m) block(std::integral_constant<int, 1>{}, i);
}

template <int NV, Update U, int D>
inline void gemm_strip(int64_t m, int64_t kdim, const float* a, const float* da, int64_t a_rs,
                       int64_t a_cs, const float* b, const float* db, int64_t ldb, float* c,
                       float* dc, int64_t ldc, float* col) {
  for_each_row_block<rows_per_block<NV, D>()>(m, [&](auto rows, int64_t i) {
    gemm_block<decltype(rows)::value, NV, U, D>(
        kdim, a + i * a_rs, D & kTangentOfA ? da + i * a_rs : nullptr, a_rs, a_cs, b, db, ldb,
        c + i * ldc, D == kNoTangent ? nullptr : dc + i * ldc, ldc, col);
  });
}

// The paired product with the tangent terms D, in column strips.
template <Update U, int D>
inline void gemm_with_tangent(int64_t m, int64_t n, int64_t kdim, const float* a,
                              const float* da, int64_t a_rs, int64_t a_cs, const float* b,
                              const float* db, int64_t ldb, float* c, float* dc, int64_t ldc,
                              float* col) {
  constexpr int kMaxVecs = D == kNoTangent ? kMaxVecsPerStrip : kMaxVecsPerPairedStrip;
  for (int64_t j = 0; j < n;) {
    const int64_t vecs = std::min<int64_t>(kMaxVecs, (n - j) / kLanes);
    float* cs = col ? col + j : nullptr;
    const float* dbs = D & kTangentOfB ? db + j : nullptr;
    float* dcs = D == kNoTangent ? nullptr : dc + j;
    switch (vecs) {
      case 4:
        if constexpr (kMaxVecs >= 4) {
          gemm_strip<4, U, D>(m, kdim, a, da, a_rs, a_cs, b + j, dbs, ldb, c + j, dcs, ldc, cs);
        }
        break;
      case 3:
        if constexpr (kMaxVecs >= 3) {
          gemm_strip<3, U, D>(m, kdim, a, da, a_rs, a_cs, b + j, dbs, ldb, c + j, dcs, ldc, cs);
        }
        break;
      case 2:
        if constexpr (kMaxVecs >= 2) {
          gemm_strip<2, U, D>(m, kdim, a, da, a_rs, a_cs, b + j, dbs, ldb, c + j, dcs, ldc, cs);
        }
        break;
      default:
        gemm_strip<1, U, D>(m, kdim, a, da, a_rs, a_cs, b + j, dbs, ldb, c + j, dcs, ldc, cs);
        break;
    }
    j += vecs * kLanes;
  }
}

template <Update U>
inline void gemm(int64_t m, int64_t n, int64_t kdim, const float* a, int64_t a_rs, int64_t a_cs,
                 const float* b, int64_t ldb, float* c, int64_t ldc, float* col = nullptr) {
  gemm_with_tangent<U, kNoTangent>(m, n, kdim, a, nullptr, a_rs, a_cs, b, nullptr, ldb, c,
                                   nullptr, ldc, col);
}

// A paired product whose tangent terms (TangentTerms) are known at run time:
// absent tangents cost nothing.
template <Update U>
inline void paired_gemm(int terms, int64_t m, int64_t n, int64_t kdim, const float* a,
                        const float* da, int64_t a_rs, int64_t a_cs, const float* b,
                        const float* db, int64_t ldb, float* c, float* dc, int64_t ldc,
                        float* col = nullptr) {
  switch (terms) {
    case kTangentOfA:
      gemm_with_tangent<U, kTangentOfA>(m, n, kdim, a, da, a_rs, a_cs, b, db, ldb, c, dc, ldc, col);
      break;
    case kTangentOfB:
      gemm_with_tangent<U, kTangentOfB>(m, n, kdim, a, da, a_rs, a_cs, b, db, ldb, c, dc, ldc, col);
      break;
    case kTangentsOfBoth:
      gemm_with_tangent<U, kTangentsOfBoth>(m, n, kdim, a, da, a_rs, a_cs, b, db, ldb, c, dc, ldc,
                                            col);
      break;
    default:
      gemm_with_tangent<U, kNoTangent>(m, n, kdim, a, da, a_rs, a_cs, b, db, ldb, c, dc, ldc, col);
      break;
  }
}

// ---------------------------------------------------------------------------
// Problem geometry and the attended key interval of each query row.

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
constexpr int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

struct Geometry {
  int64_t B, T, S, N, K, H, G, Hp;
  int64_t offset;  // *p.query_offset: the operand is host memory here, read once per call
  bool causal;
  int64_t window_left, window_right;
  const int32_t* q_lengths;
  const int32_t* kv_lengths;

  explicit Geometry(const AttentionParams& p)
      : B(p.batch), T(p.q_len), S(p.kv_len), N(p.num_heads), K(p.num_kv_heads),
        H(p.head_dim), G(p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0),
        Hp(round_up(p.head_dim, kLanes)), offset(*p.query_offset), causal(p.is_causal),
        window_left(p.window_left), window_right(p.window_right),
        q_lengths(p.q_seq_lengths), kv_lengths(p.kv_seq_lengths) {}

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
};

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

// Keys j0 .. j0 + jn of one kv head converted to float rows of stride ld
// (zero-padded from H to ld).
template <typename T>
inline void load_kv_tile(const Geometry& g, const T* src, int64_t b, int64_t kh, int64_t j0,
                  int64_t jn, float* dst, int64_t ld) {
  for (int64_t j = 0; j < jn; ++j) {
    widen_row(src + ((b * g.S + j0 + j) * g.K + kh) * g.H, dst + j * ld, g.H);
    std::fill(dst + j * ld + g.H, dst + (j + 1) * ld, 0.0f);
  }
}

// Asks for `rows` rows of row_bytes, stride_bytes apart, to be brought into
// the L2 cache while the current tile is computed. Hardware prefetchers do not
// cross a 4 KiB page, so rows a page or more apart (a head's keys when K * H
// elements reach 4 KiB, as at (1, 4096, 8, 128) in f32) each start a page
// nobody prefetches. Measured at (1, 4096, 8, 128) f32 on 2 threads: no
// change in the machine's fast periods, and the forward 16-32% faster in its
// slow-memory ones (125-150 GFLOP/s without, 165-180 with); with closer rows
// (H = 64) it was 1-3% slower, hence the condition.
inline void prefetch_rows(const void* first, int64_t rows, int64_t stride_bytes, int64_t row_bytes) {
  constexpr int64_t kPageBytes = 4096, kLineBytes = 64;
  if (stride_bytes < kPageBytes) return;
  const char* row = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r, row += stride_bytes) {
    for (int64_t at = 0; at < row_bytes; at += kLineBytes) __builtin_prefetch(row + at, 0, 2);
  }
}

// prefetch_rows for keys j0 .. j0 + jn of one kv head of a [B, S, K, H] tensor.
template <typename T>
inline void prefetch_kv_rows(const Geometry& g, const T* x, int64_t b, int64_t kh, int64_t j0,
                             int64_t jn) {
  prefetch_rows(x + ((b * g.S + j0) * g.K + kh) * g.H, jn,
                g.K * g.H * static_cast<int64_t>(sizeof(T)),
                g.H * static_cast<int64_t>(sizeof(T)));
}

// The same in K and V.
template <typename T>
inline void prefetch_kv_tile(const Geometry& g, const T* k, const T* v, int64_t b, int64_t kh,
                             int64_t j0, int64_t jn) {
  prefetch_kv_rows(g, k, b, kh, j0, jn);
  prefetch_kv_rows(g, v, b, kh, j0, jn);
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

// Turns scores st[j][i] = q_i . k_j of keys j0.. into log2-unit logits: the
// scale (unless `scaled`: the queries were multiplied by it already), bias,
// boolean mask, and (unless the tile lies inside every row's interval) the
// [lo, hi) interval of each row.
inline void scores_to_logits(const AttentionParams& p, int64_t b, const int64_t* n,
                             const int64_t* t, int64_t rows, const int32_t* lo,
                             const int32_t* hi, bool inside, bool scaled, int64_t j0, int64_t jn,
                             int64_t width, float* st) {
  if (!scaled) {
    const VecF c = vsplat(p.scale * kLog2e);
    for (int64_t j = 0; j < jn; ++j) {
      for (int64_t v = 0; v < width; v += kLanes) vstore(st + j * width + v, vload(st + j * width + v) * c);
    }
  }
  if (p.bias || p.mask) apply_bias_and_mask(p, b, n, t, rows, j0, jn, st, width);
  if (!inside) {
    const VecF masked = vsplat(-kInf);
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

inline int thread_count(const AttentionParams& p) {
  return p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
}

// What a tile of Br rows r0.. of kv head kh attends.
struct RowTile {
  int64_t rows;                // rows of the tile that exist (the rest pad it to Br)
  int64_t q_valid, kv_valid;   // valid query rows and keys of its batch
  int64_t key_begin, key_end;  // the keys its rows attend; empty when none does
  int64_t max_lo, min_hi;      // keys in [max_lo, min_hi) lie in every row's interval

  bool attends() const { return key_begin < key_end; }
  bool inside(int64_t j0, int64_t jn) const { return max_lo <= j0 && min_hi >= j0 + jn; }
};

// Fills each row's query index t[i], head n[i] and attended key interval
// [lo[i], hi[i]) for i < Br; padding rows repeat the last row.
inline RowTile plan_row_tile(const Geometry& g, int64_t b, int64_t kh, int64_t r0, int64_t Br,
                             int64_t* t, int64_t* n, int32_t* lo, int32_t* hi) {
  RowTile tile;
  tile.rows = std::min(Br, g.T * g.G - r0);
  tile.q_valid = g.q_valid(b);
  tile.kv_valid = g.kv_valid(b);
  int64_t t_first = -1, t_last = -1;
  for (int64_t i = 0; i < Br; ++i) {
    const int64_t r = r0 + std::min(i, tile.rows - 1);
    t[i] = r / g.G;
    n[i] = kh * g.G + r % g.G;
    if (i < tile.rows && t[i] < tile.q_valid) {
      lo[i] = static_cast<int32_t>(g.lo(t[i]));
      hi[i] = static_cast<int32_t>(g.hi(t[i], tile.kv_valid));
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

// Asks for the tile's rows (i < rows) of a [B, T, N, H] tensor to be brought
// into the L1 cache, for reading or (kForWrite) writing. The row loops that
// read (transpose_query_tile) or write a tile's rows otherwise wait for one
// row's cache misses after another; asked for together, the misses overlap.
template <bool kForWrite, typename T>
inline void prefetch_tile_rows(const Geometry& g, const T* x, int64_t b, const int64_t* t,
                               const int64_t* n, int64_t rows) {
  constexpr int64_t kLineBytes = 64;
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = reinterpret_cast<const char*>(x + ((b * g.T + t[i]) * g.N + n[i]) * g.H);
    for (int64_t at = 0; at < g.H * static_cast<int64_t>(sizeof(T)); at += kLineBytes) {
      __builtin_prefetch(row + at, kForWrite ? 1 : 0, 3);
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
      widen_row(x + ((b * g.T + t[i]) * g.N + n[i]) * g.H, row, g.H);
      for (int64_t h = 0; h < g.H; ++h) xt[h * Br + i] = row[h] * scale;
    } else {
      for (int64_t h = 0; h < g.H; ++h) xt[h * Br + i] = 0.0f;
    }
  }
}

// Keys j0 .. j0 + jn of one kv head of a [B, S, K, H] tensor as float rows:
// float inputs where they are, others converted into buf. Returns the first
// row; *ld is the row stride.
template <typename T>
inline const float* kv_tile_as_float(const Geometry& g, const T* x, int64_t b, int64_t kh,
                                     int64_t j0, int64_t jn, float* buf, int64_t* ld) {
  if constexpr (std::is_same_v<T, float>) {
    *ld = g.K * g.H;
    return x + ((b * g.S + j0) * g.K + kh) * g.H;
  } else {
    load_kv_tile(g, x, b, kh, j0, jn, buf, g.H);
    *ld = g.H;
    return buf;
  }
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

// Online softmax over one tile of logits st[j][i] (log2 units, jn keys): updates
// the running max m, the shift, the rescale alpha of earlier accumulators and
// the running sum l, and turns st into probabilities. With `max_known` the
// tile's maximum is in s.tile_max already.
//
// kWithTangent (the forward-mode kernel): dst[j][i] holds the logits'
// tangents (log2 units) and becomes e * ds, the probabilities times the
// tangents in natural units, and mu[i] accumulates their sum, rescaled by
// alpha like l. A key the row does not attend has e = 0 and adds nothing,
// whatever its tangent holds (a non-finite bias tangent at a masked key).
template <bool kWithTangent = false>
inline void online_softmax(int64_t jn, int64_t Br, bool max_known, float* st,
                           const SoftmaxRows& s, float* dst = nullptr, float* mu = nullptr) {
  for (int64_t c = 0; c < Br; c += kLanes) {
    VecF tile_max = vsplat(-kInf);
    if (max_known) {
      tile_max = vload(s.tile_max + c);
    } else {
      for (int64_t j = 0; j < jn; ++j) tile_max = vmax(tile_max, vload(st + j * Br + c));
    }
    const VecF m_old = vload(s.m + c);
    const VecF m_new = vmax(m_old, tile_max);
    const VecF shift = m_new == vsplat(-kInf) ? VecF{} : m_new;
    vstore(s.m + c, m_new);
    vstore(s.shift + c, shift);
    vstore(s.alpha + c, vexp2(m_old - shift));
    VecF sum{}, tangent_sum{};
    for (int64_t j = 0; j < jn; ++j) {
      const VecF prob = vexp2(vload(st + j * Br + c) - shift);
      vstore(st + j * Br + c, prob);
      sum += prob;
      if constexpr (kWithTangent) {
        const VecF weighted = prob * (vload(dst + j * Br + c) * vsplat(kLn2));
        const VecF attended = prob > VecF{} ? weighted : VecF{};
        vstore(dst + j * Br + c, attended);
        tangent_sum += attended;
      }
    }
    vstore(s.l + c, vfma(vload(s.l + c), vload(s.alpha + c), sum));
    if constexpr (kWithTangent) {
      vstore(mu + c, vfma(vload(mu + c), vload(s.alpha + c), tangent_sum));
    }
  }
}

// Natural-log logsumexp of a row from its softmax statistics (log2 units).
inline float row_logsumexp(float shift, float l) { return (shift + std::log2(l)) * kLn2; }

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
template <typename Carve, typename Item>
inline void run_row_tile_items(const Geometry& g, int64_t Br, int threads, void* workspace,
                               Carve carve, Item item) {
  const int64_t row_tiles = ceil_div(g.T * g.G, Br);
  const int64_t items = g.B * g.K * row_tiles;
#pragma omp parallel num_threads(threads)
  {
    Arena arena(workspace);
    auto s = carve(arena);
    for (int i = 0; i < omp_get_thread_num(); ++i) s = carve(arena);
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < items; ++index) {
      const int64_t group = index / row_tiles;
      const int64_t tile = row_tiles - 1 - index % row_tiles;
      item(s, group / g.K, group % g.K, tile * Br);
    }
  }
}

}  // namespace jaxops::cpu::attention_internal
