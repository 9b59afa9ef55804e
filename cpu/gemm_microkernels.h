// Register-blocked float32 matrix products (GEMM micro-kernels) over the SIMD
// layer (cpu/simd.h), for the attention kernels: the forward's score and
// output products, the backward's gradient products and the forward-mode
// kernel's paired products (a value and its tangent in one pass).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/simd.h"

namespace jaxops::cpu::microkernels {

using namespace simd;

// Column strips of a product: at most this many vectors wide (the
// accumulators of a strip's row block stay in the register file).
inline constexpr int kMaxVecsPerStrip = kLanes == 16 ? 4 : 2;

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

}  // namespace jaxops::cpu::microkernels
