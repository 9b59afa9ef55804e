// Test-only: the wgmma.mma_async products of cuda/wgmma_products.cuh on the CPU
// (the model is in wgmma_emulation.h). Included by wgmma_products.cuh after the
// layout functions of cuda/wgmma.cuh, which the emulation reads shared memory by.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "wgmma_emulation.h"

namespace jaxops_harness {

// One thread's operands of a product.
struct WgmmaLane {
  uint64_t desc_a;
  uint64_t desc_b;
  const uint32_t* a;  // registers (RS), else nullptr
  const float* c;
  bool scale_d;
};

// The operand matrix of a descriptor, with the pointers the emulation reads it by.
struct WgmmaOperand {
  uint64_t desc;
  bool mn_major;
  int element_bytes;
};

// The host pointer to element (mn, k) of an operand in shared memory: the
// canonical layout's offset from the start, then the hardware's swizzle of the
// absolute shared address. Empty message when the element lies in the block's
// dynamic shared memory.
const unsigned char* wgmma_element(const WgmmaOperand& op, uint32_t mn, uint32_t k,
                                   std::string* error);
// Each thread's share of the operand checks (bounds, TMA loads in flight),
// outside the collective.
void wgmma_check_operand(const char* name, const WgmmaOperand& op, int rows_mn, int k_extent);
// The collective: every thread of the warpgroup deposits `in` and `out`; the
// last to arrive runs `complete` over all of them (a non-empty result fails the
// launch); the others wait until it has. Then the caller's accumulator is
// pending in its thread's current group.
using WgmmaCompleter = std::string (*)(const WgmmaLane* const* in, float* const* out);
void wgmma_collective(const char* name, WgmmaAccumulatorState& state, const WgmmaLane& in,
                      float* out, WgmmaCompleter complete);
void count_wgmma(int kind);  // 0 f16, 1 bf16, 2 tf32

inline float wgmma_operand_value(const unsigned char* p, int kind) {
  if (kind == 2) {  // TF32: the top 19 bits, as mma_emulation's tf32_operand
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits &= 0xffffe000u;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return kind == 1 ? bfloat16_bits_to_float(bits) : half_bits_to_float(bits);
}

template <typename T>
constexpr int wgmma_kind() {
  return std::is_same<T, float>::value ? 2 : std::is_same<T, __nv_bfloat16>::value ? 1 : 0;
}

// D = A B + (scale-d ? C : 0) for the 128 threads' operands, m64nNk(16 or 8).
template <int N, typename T, bool kRegisterA, bool kTransA, bool kTransB>
std::string complete_wgmma(const WgmmaLane* const* in, float* const* out) {
  constexpr int kKind = wgmma_kind<T>();
  constexpr int kBytes = kKind == 2 ? 4 : 2, kK = kKind == 2 ? 8 : 16;
  const WgmmaLane& first = *in[0];
  for (int t = 1; t < 128; ++t) {
    if ((!kRegisterA && in[t]->desc_a != first.desc_a) || in[t]->desc_b != first.desc_b ||
        in[t]->scale_d != first.scale_d) {
      return "thread " + std::to_string(t) +
             " of the warpgroup gives other descriptors or scale-d than thread 0";
    }
  }
  static float a[64][kK], b[kK][N], d[64][N];
  std::string error;
  if constexpr (kRegisterA) {
    for (int t = 0; t < 128; ++t) {
      for (int i = 0; i < (kKind == 2 ? 4 : 8); ++i) {
        if constexpr (kKind == 2) {
          const auto rc = jaxops::cuda::wgmma::register_a_tf32_coord(t, i);
          a[rc.row][rc.col] =
              wgmma_operand_value(reinterpret_cast<const unsigned char*>(&in[t]->a[i]), 2);
        } else {
          const auto rc = jaxops::cuda::wgmma::register_a_coord(t, i);
          const uint16_t half = static_cast<uint16_t>(in[t]->a[i / 2] >> (16 * (i % 2)));
          a[rc.row][rc.col] = wgmma_operand_value(reinterpret_cast<const unsigned char*>(&half),
                                                  kKind);
        }
      }
    }
  } else {
    const WgmmaOperand op{first.desc_a, kTransA, kBytes};
    for (int m = 0; m < 64; ++m) {
      for (int k = 0; k < kK; ++k) {
        const unsigned char* p = wgmma_element(op, m, k, &error);
        if (p == nullptr) return "A: " + error;
        a[m][k] = wgmma_operand_value(p, kKind);
      }
    }
  }
  const WgmmaOperand op_b{first.desc_b, kTransB, kBytes};
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < kK; ++k) {
      const unsigned char* p = wgmma_element(op_b, n, k, &error);
      if (p == nullptr) return "B: " + error;
      b[k][n] = wgmma_operand_value(p, kKind);
    }
  }
  for (int t = 0; t < 128; ++t) {
    for (int i = 0; i < N / 2; ++i) {
      const auto rc = jaxops::cuda::wgmma::accumulator_coord(t, i);
      d[rc.row][rc.col] = first.scale_d ? in[t]->c[i] : 0.f;
    }
  }
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < N; ++n) {
      float sum = d[m][n];
      for (int k = 0; k < kK; ++k) sum += a[m][k] * b[k][n];
      d[m][n] = sum;
    }
  }
  for (int t = 0; t < 128; ++t) {
    for (int i = 0; i < N / 2; ++i) {
      const auto rc = jaxops::cuda::wgmma::accumulator_coord(t, i);
      out[t][i] = d[rc.row][rc.col];
    }
  }
  count_wgmma(kKind);
  return {};
}

template <typename T>
const char* wgmma_name(bool register_a) {
  constexpr int kKind = wgmma_kind<T>();
  if (kKind == 2) return register_a ? "wgmma.mma_async.k8.tf32 (RS)" : "wgmma.mma_async.k8.tf32 (SS)";
  if (kKind == 1) return register_a ? "wgmma.mma_async.k16.bf16 (RS)" : "wgmma.mma_async.k16.bf16 (SS)";
  return register_a ? "wgmma.mma_async.k16.f16 (RS)" : "wgmma.mma_async.k16.f16 (SS)";
}

template <int N, typename T>
void wgmma_ss(float* d, WgmmaAccumulatorState& state, uint64_t desc_a, uint64_t desc_b,
              bool scale_d, bool trans_a, bool trans_b) {
  constexpr int kBytes = wgmma_kind<T>() == 2 ? 4 : 2, kK = kBytes == 4 ? 8 : 16;
  const char* name = wgmma_name<T>(false);
  wgmma_check_operand(name, {desc_a, trans_a, kBytes}, 64, kK);
  wgmma_check_operand(name, {desc_b, trans_b, kBytes}, N, kK);
  const WgmmaLane in{desc_a, desc_b, nullptr, d, scale_d};
  float result[N / 2];
  WgmmaCompleter complete = !trans_a ? (!trans_b ? &complete_wgmma<N, T, false, false, false>
                                                 : &complete_wgmma<N, T, false, false, true>)
                                     : (!trans_b ? &complete_wgmma<N, T, false, true, false>
                                                 : &complete_wgmma<N, T, false, true, true>);
  wgmma_collective(name, state, in, result, complete);
  std::memcpy(d, result, sizeof result);
}

template <int N, typename T>
void wgmma_rs(float* d, WgmmaAccumulatorState& state, const uint32_t (&a)[4], uint64_t desc_b,
              bool scale_d, bool trans_b) {
  constexpr int kBytes = wgmma_kind<T>() == 2 ? 4 : 2, kK = kBytes == 4 ? 8 : 16;
  const char* name = wgmma_name<T>(true);
  wgmma_check_operand(name, {desc_b, trans_b, kBytes}, N, kK);
  const WgmmaLane in{0, desc_b, a, d, scale_d};
  float result[N / 2];
  WgmmaCompleter complete = !trans_b ? &complete_wgmma<N, T, true, false, false>
                                     : &complete_wgmma<N, T, true, false, true>;
  wgmma_collective(name, state, in, result, complete);
  std::memcpy(d, result, sizeof result);
}

}  // namespace jaxops_harness
