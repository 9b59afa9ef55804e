// Test-only: the sm_80 instructions of cuda/mma.cuh emulated on the CPU with
// the PTX ISA's exact per-lane layouts (see that file for them and for the
// sections of the ISA they come from), so that a kernel's own fragment loads,
// conversions and stores run here as on a GPU:
//   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 and
//   mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: warp collectives; the
//     last lane to arrive computes the 16 x 8 product from every lane's
//     registers (products exact in float, summed in float onto C; TF32
//     operands are the registers' top 19 bits, as the tensor cores read them);
//   ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16: each lane that
//     supplies a row address reads its 16 bytes itself (so the sanitizers see
//     the read where it happens), then the collective hands out the fragments;
//   cp.async.cg.shared.global (16 bytes, zero fill past src_bytes),
//     cp.async.commit_group and cp.async.wait_group: really asynchronous, at
//     the strictest timing the PTX ISA allows: the source is read at issue,
//     the destination is poisoned (0xff bytes, NaN in every float type) at
//     issue and written only by the issuing thread's cp.async.wait_group that
//     covers its group (tests/cuda_harness/runtime.cc). An ldmatrix of a
//     destination still pending fails the launch, and so does a misaligned
//     address, so a missing wait or barrier fails in CI, not on a GPU.
// Every instruction is counted (jaxops_harness_mma_syncs, _ldmatrices,
// _cp_asyncs), so a test can tell which path a kernel took.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda_on_cpu.h"

namespace jaxops_harness {

// The operand types of mma.sync the harness counts, in the order of
// jaxops_harness_mma_syncs's argument.
enum class MmaOperand { kHalf = 0, kBfloat16 = 1, kTf32 = 2 };
void count_mma_sync(MmaOperand operand);
void count_ldmatrix();

// cp.async bookkeeping of the calling CUDA thread and its block (runtime.cc).
void cp_async_16(void* dst, const void* src, int src_bytes, Site site = Site::here());
void cp_async_commit();
void cp_async_wait(int pending, Site site = Site::here());
// Fails the launch when the 16 bytes at `row` are the destination of a
// cp.async that no cp.async.wait_group has covered yet.
void check_not_pending(const void* row, const char* op, Site site);
// Fails the launch with `message` (a misused instruction).
[[noreturn]] void fail_launch(const std::string& message);

struct MmaLane {
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
};

inline float tf32_operand(uint32_t bits) {
  float x;
  const uint32_t kept = (bits & 0x7f800000u) == 0x7f800000u ? bits : bits & 0xffffe000u;
  std::memcpy(&x, &kept, 4);
  return x;
}

// D = A B + C for one m16n8k16 (kTf32 false; kToFloat reads a 16-bit element)
// or m16n8k8 TF32 instruction from every lane's registers.
template <bool kTf32, float (*kToFloat)(unsigned short)>
void complete_mma(const Collective& op) {
  constexpr int kK = kTf32 ? 8 : 16;
  float a[16][kK], b[kK][8], acc[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& in = *static_cast<const MmaLane*>(op.in[lane]);
    const int g = lane >> 2, t = lane & 3;
    if constexpr (kTf32) {
      for (int i = 0; i < 4; ++i) a[g + 8 * (i & 1)][t + 4 * (i >> 1)] = tf32_operand(in.a[i]);
      for (int i = 0; i < 2; ++i) b[t + 4 * i][g] = tf32_operand(in.b[i]);
    } else {
      for (int i = 0; i < 8; ++i) {
        const uint32_t reg = in.a[i >> 1];
        const auto half = static_cast<unsigned short>(i & 1 ? reg >> 16 : reg & 0xffffu);
        a[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >> 2)] = kToFloat(half);
      }
      for (int i = 0; i < 4; ++i) {
        const uint32_t reg = in.b[i >> 1];
        const auto half = static_cast<unsigned short>(i & 1 ? reg >> 16 : reg & 0xffffu);
        b[2 * t + (i & 1) + 8 * (i >> 1)][g] = kToFloat(half);
      }
    }
    for (int i = 0; i < 4; ++i) acc[g + 8 * (i >> 1)][2 * t + (i & 1)] = in.c[i];
  }
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      float sum = acc[i][j];
      for (int k = 0; k < kK; ++k) sum += a[i][k] * b[k][j];
      acc[i][j] = sum;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<float*>(op.out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) d[i] = acc[g + 8 * (i >> 1)][2 * t + (i & 1)];
  }
  count_mma_sync(kTf32 ? MmaOperand::kTf32
                 : kToFloat == &half_bits_to_float ? MmaOperand::kHalf
                                                   : MmaOperand::kBfloat16);
}

template <typename Half>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                  Site site = Site::here()) {
  constexpr bool kBf16 = std::is_same<Half, __nv_bfloat16>::value;
  static_assert(kBf16 || std::is_same<Half, __half>::value, "m16n8k16 takes f16 or bf16 here");
  const MmaLane in{a, b, d};
  float result[4];
  warp_collective(kBf16 ? "mma.sync.m16n8k16.bf16" : "mma.sync.m16n8k16.f16", site, 0xffffffffu,
                  &in, result,
                  &complete_mma<false, kBf16 ? bfloat16_bits_to_float : half_bits_to_float>);
  for (int i = 0; i < 4; ++i) d[i] = result[i];
}

inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                             Site site = Site::here()) {
  const MmaLane in{a, b, d};
  float result[4];
  warp_collective("mma.sync.m16n8k8.tf32", site, 0xffffffffu, &in, result,
                  &complete_mma<true, half_bits_to_float>);
  for (int i = 0; i < 4; ++i) d[i] = result[i];
}

// One 16-byte row of an ldmatrix, as a lane read it.
struct LdmatrixRow {
  uint16_t e[8];
};

template <int kMatrices, bool kTrans>
void complete_ldmatrix(const Collective& op) {
  for (int lane = 0; lane < 32; ++lane) {
    uint32_t* r = static_cast<uint32_t*>(op.out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int m = 0; m < kMatrices; ++m) {
      const auto row = [&](int i) { return *static_cast<const LdmatrixRow*>(op.in[8 * m + i]); };
      const uint32_t low = kTrans ? row(2 * t).e[g] : row(g).e[2 * t];
      const uint32_t high = kTrans ? row(2 * t + 1).e[g] : row(g).e[2 * t + 1];
      r[m] = low | high << 16;
    }
  }
  count_ldmatrix();
}

template <int kMatrices, bool kTrans>
void ldmatrix(uint32_t (&r)[kMatrices], const void* row_address, Site site = Site::here()) {
  const char* name = kTrans ? "ldmatrix.m8n8.trans" : "ldmatrix.m8n8";
  LdmatrixRow row{};
  if (this_thread().lane < 8 * kMatrices) {
    if (reinterpret_cast<uintptr_t>(row_address) % 16 != 0) {
      fail_launch(std::string(name) + " at " + site.file + ":" + std::to_string(site.line) +
                  ": lane " + std::to_string(this_thread().lane) +
                  "'s row address is not 16-byte aligned");
    }
    check_not_pending(row_address, name, site);
    std::memcpy(&row, row_address, sizeof row);
  }
  uint32_t result[kMatrices];
  warp_collective(name, site, 0xffffffffu, &row, result, &complete_ldmatrix<kMatrices, kTrans>);
  for (int m = 0; m < kMatrices; ++m) r[m] = result[m];
}

}  // namespace jaxops_harness
