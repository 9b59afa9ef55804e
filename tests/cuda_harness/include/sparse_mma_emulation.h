// Test-only: the sparse tensor-core instruction
//   mma.sp.sync.aligned.m16n8k32.row.col.f32.{f16,bf16}.{f16,bf16}.f32 d, a, b, c, e, selector;
// emulated on the CPU with the PTX ISA's per-lane register layouts (section
// "Matrix fragments for multiply-accumulate operation with sparse matrix A",
// m16n8k32 with .f16/.bf16), so that a kernel's fragment loads, metadata and
// stores run here exactly as they are laid out for the GPU. Like wmma in
// cuda_on_cpu.h it is a warp collective: every lane deposits its registers,
// the last to arrive computes the whole 16 x 8 x 32 product.
//
// Per lane l (group g = l >> 2, thread t = l % 4 in the group):
//   a: 4 .b32 = 8 elements a0..a7 (low half first) of the 16 x 16 compressed A:
//      row g + 8 * ((i >> 1) & 1), compressed column 2t + (i & 1) + 8 * (i >> 2)
//      (the dense m16n8k16 A layout over the compressed columns).
//   b: 4 .b32 = 8 elements b0..b7 of the dense 32 x 8 B:
//      row 2t + (i & 1) + 8 * (i >> 1), column g.
//   c, d: 4 floats: row g + 8 * (i >> 1), column 2t + (i & 1).
//   e: the metadata. Compressed columns 2c, 2c + 1 of row r are the kept
//      elements of chunk c (dense columns 4c .. 4c + 3); their in-chunk indices
//      are 2-bit fields i0 (bits 0-1) and i1 (bits 2-3) of a 4-bit nibble, and
//      i0 < i1 is required (other nibbles, 0b0000, 0b0101, 0b1010, 0b1111 and
//      the descending ones, are undefined behaviour on the GPU: the emulation
//      fails the launch with a report instead). Lanes 4g + 2 * selector (chunks
//      0-3) and 4g + 2 * selector + 1 (chunks 4-7) of every group supply them:
//      row g in bits 0-15, row g + 8 in bits 16-31, chunk c & 3 at bits 4 (c & 3).
// Products are exact in float, summed in float onto c (the GPU's summation
// order differs; both are within the tests' tolerances). Only the kept
// elements meet B: the metadata selects the rows of B each compressed column
// multiplies, and the other rows are never read, so a NaN or an infinity
// there does not reach d. That is how the sparse tensor cores are described
// (they gather the selected rows; there are no pruned zeros to multiply); not
// checked on a GPU. The kernels do not depend on it: the dense product's NaN
// at pruned columns comes from sparse_linear_pruned_nan_kernel either way.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_on_cpu.h"

namespace jaxops_harness {

// Counts emulated mma.sp instructions (tests check that a kernel took this path).
void count_sparse_mma();

struct SparseMmaLane {
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
  uint32_t e;
};

template <float (*kToFloat)(unsigned short)>
float register_half(uint32_t reg, int high) {
  return kToFloat(static_cast<unsigned short>(high ? reg >> 16 : reg & 0xffffu));
}

template <float (*kToFloat)(unsigned short), int kSelector>
void complete_sparse_mma(const Collective& op) {
  // b_row[r][k]: the row of B that compressed column k of row r multiplies.
  float a[16][16], b[32][8], acc[16][8];
  int b_row[16][16];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& in = *static_cast<const SparseMmaLane*>(op.in[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 8; ++i) {
      a[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >> 2)] =
          register_half<kToFloat>(in.a[i >> 1], i & 1);
      b[2 * t + (i & 1) + 8 * (i >> 1)][g] = register_half<kToFloat>(in.b[i >> 1], i & 1);
    }
    for (int i = 0; i < 4; ++i) acc[g + 8 * (i >> 1)][2 * t + (i & 1)] = in.c[i];
  }
  for (int r = 0; r < 16; ++r) {
    for (int chunk = 0; chunk < 8; ++chunk) {
      const int lane = 4 * (r & 7) + 2 * kSelector + (chunk >> 2);
      const uint32_t e = static_cast<const SparseMmaLane*>(op.in[lane])->e;
      const unsigned nibble = e >> (16 * (r >> 3) + 4 * (chunk & 3)) & 0xfu;
      const int i0 = nibble & 3, i1 = nibble >> 2;
      if (i0 >= i1) {
        throw std::runtime_error(std::string("mma.sp at ") + op.site.file + ":" +
                                 std::to_string(op.site.line) + ": metadata nibble " +
                                 std::to_string(nibble) + " of row " + std::to_string(r) +
                                 ", chunk " + std::to_string(chunk) + " (lane " +
                                 std::to_string(lane) +
                                 ") is not two ascending indices (undefined on the GPU)");
      }
      b_row[r][2 * chunk] = 4 * chunk + i0;
      b_row[r][2 * chunk + 1] = 4 * chunk + i1;
    }
  }
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      float sum = acc[i][j];
      for (int k = 0; k < 16; ++k) sum += a[i][k] * b[b_row[i][k]][j];
      acc[i][j] = sum;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<float*>(op.out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) d[i] = acc[g + 8 * (i >> 1)][2 * t + (i & 1)];
  }
  count_sparse_mma();
}

// d = A b + c for the 16-bit element type Half (__half or __nv_bfloat16), with
// the registers of the calling lane; d may alias c.
template <typename Half, int kSelector>
void sparse_mma_m16n8k32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                         const float (&c)[4], uint32_t e, Site site = Site::here()) {
  static_assert(kSelector == 0 || kSelector == 1, "m16n8k32 .f16/.bf16 takes selector 0 or 1");
  constexpr bool kBf16 = std::is_same<Half, __nv_bfloat16>::value;
  static_assert(kBf16 || std::is_same<Half, __half>::value, "mma.sp takes f16 or bf16 here");
  const SparseMmaLane in{a, b, c, e};
  float result[4];
  warp_collective(kBf16 ? "mma.sp.m16n8k32.bf16" : "mma.sp.m16n8k32.f16", site, 0xffffffffu,
                  &in, result,
                  &complete_sparse_mma<kBf16 ? bfloat16_bits_to_float : half_bits_to_float,
                                       kSelector>);
  for (int i = 0; i < 4; ++i) d[i] = result[i];
}

}  // namespace jaxops_harness
