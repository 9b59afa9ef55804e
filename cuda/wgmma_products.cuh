// The wgmma.mma_async products of wgmma.cuh (included at its end; see it for
// the layouts and the harness emulation). Each product's PTX names every
// accumulator register: the operand lists below are spelled by the
// preprocessor, the register list "%0, %1, ..." of N / 2 floats from runs of ten
// (JAXOPS_WG_P10(t) is "%t0, ..., %t9"), the "+f" constraints likewise, and the
// operands after the accumulators ("%R" ... "%R+6", R = N / 2) as literals per N.
#pragma once

#include "wgmma.cuh"

#ifdef JAXOPS_CUDA_HARNESS
#include "wgmma_emulation_products.h"
#endif

// "%t0, %t1, ..., %t(k-1)": k operand names of the tens digit(s) t (empty for 0..9).
#define JAXOPS_WG_P1(t) "%" #t "0"
#define JAXOPS_WG_P2(t) JAXOPS_WG_P1(t) ", %" #t "1"
#define JAXOPS_WG_P3(t) JAXOPS_WG_P2(t) ", %" #t "2"
#define JAXOPS_WG_P4(t) JAXOPS_WG_P3(t) ", %" #t "3"
#define JAXOPS_WG_P5(t) JAXOPS_WG_P4(t) ", %" #t "4"
#define JAXOPS_WG_P6(t) JAXOPS_WG_P5(t) ", %" #t "5"
#define JAXOPS_WG_P7(t) JAXOPS_WG_P6(t) ", %" #t "6"
#define JAXOPS_WG_P8(t) JAXOPS_WG_P7(t) ", %" #t "7"
#define JAXOPS_WG_P9(t) JAXOPS_WG_P8(t) ", %" #t "8"
#define JAXOPS_WG_P10(t) JAXOPS_WG_P9(t) ", %" #t "9"
// "+f"(d.x[t0]), ..., "+f"(d.x[t(k-1)]).
#define JAXOPS_WG_F(i) "+f"(d.x[i])
#define JAXOPS_WG_C1(t) JAXOPS_WG_F(t##0)
#define JAXOPS_WG_C2(t) JAXOPS_WG_C1(t), JAXOPS_WG_F(t##1)
#define JAXOPS_WG_C3(t) JAXOPS_WG_C2(t), JAXOPS_WG_F(t##2)
#define JAXOPS_WG_C4(t) JAXOPS_WG_C3(t), JAXOPS_WG_F(t##3)
#define JAXOPS_WG_C5(t) JAXOPS_WG_C4(t), JAXOPS_WG_F(t##4)
#define JAXOPS_WG_C6(t) JAXOPS_WG_C5(t), JAXOPS_WG_F(t##5)
#define JAXOPS_WG_C7(t) JAXOPS_WG_C6(t), JAXOPS_WG_F(t##6)
#define JAXOPS_WG_C8(t) JAXOPS_WG_C7(t), JAXOPS_WG_F(t##7)
#define JAXOPS_WG_C9(t) JAXOPS_WG_C8(t), JAXOPS_WG_F(t##8)
#define JAXOPS_WG_C10(t) JAXOPS_WG_C9(t), JAXOPS_WG_F(t##9)
// Per N: the register list, the constraints and the names of the seven operands
// that follow the accumulators, passed to F with the product's own arguments.
#define JAXOPS_WG_REGS_8 JAXOPS_WG_P4()
#define JAXOPS_WG_CONS_8 JAXOPS_WG_C4()
#define JAXOPS_WG_N8(F, ...) F("8", JAXOPS_WG_REGS_8, JAXOPS_WG_CONS_8, "4", "5", "6", "7", "8", "9", "10", __VA_ARGS__)
#define JAXOPS_WG_REGS_16 JAXOPS_WG_P8()
#define JAXOPS_WG_CONS_16 JAXOPS_WG_C8()
#define JAXOPS_WG_N16(F, ...) F("16", JAXOPS_WG_REGS_16, JAXOPS_WG_CONS_16, "8", "9", "10", "11", "12", "13", "14", __VA_ARGS__)
#define JAXOPS_WG_REGS_32 JAXOPS_WG_P10() ", " JAXOPS_WG_P6(1)
#define JAXOPS_WG_CONS_32 JAXOPS_WG_C10(), JAXOPS_WG_C6(1)
#define JAXOPS_WG_N32(F, ...) F("32", JAXOPS_WG_REGS_32, JAXOPS_WG_CONS_32, "16", "17", "18", "19", "20", "21", "22", __VA_ARGS__)
#define JAXOPS_WG_REGS_64 JAXOPS_WG_P10() ", " JAXOPS_WG_P10(1) ", " JAXOPS_WG_P10(2) ", " JAXOPS_WG_P2(3)
#define JAXOPS_WG_CONS_64 JAXOPS_WG_C10(), JAXOPS_WG_C10(1), JAXOPS_WG_C10(2), JAXOPS_WG_C2(3)
#define JAXOPS_WG_N64(F, ...) F("64", JAXOPS_WG_REGS_64, JAXOPS_WG_CONS_64, "32", "33", "34", "35", "36", "37", "38", __VA_ARGS__)
#define JAXOPS_WG_REGS_96 JAXOPS_WG_P10() ", " JAXOPS_WG_P10(1) ", " JAXOPS_WG_P10(2) ", " JAXOPS_WG_P10(3) ", " JAXOPS_WG_P8(4)
#define JAXOPS_WG_CONS_96 JAXOPS_WG_C10(), JAXOPS_WG_C10(1), JAXOPS_WG_C10(2), JAXOPS_WG_C10(3), JAXOPS_WG_C8(4)
#define JAXOPS_WG_N96(F, ...) F("96", JAXOPS_WG_REGS_96, JAXOPS_WG_CONS_96, "48", "49", "50", "51", "52", "53", "54", __VA_ARGS__)
#define JAXOPS_WG_REGS_128 JAXOPS_WG_P10() ", " JAXOPS_WG_P10(1) ", " JAXOPS_WG_P10(2) ", " JAXOPS_WG_P10(3) ", " JAXOPS_WG_P10(4) ", " JAXOPS_WG_P10(5) ", " JAXOPS_WG_P4(6)
#define JAXOPS_WG_CONS_128 JAXOPS_WG_C10(), JAXOPS_WG_C10(1), JAXOPS_WG_C10(2), JAXOPS_WG_C10(3), JAXOPS_WG_C10(4), JAXOPS_WG_C10(5), JAXOPS_WG_C4(6)
#define JAXOPS_WG_N128(F, ...) F("128", JAXOPS_WG_REGS_128, JAXOPS_WG_CONS_128, "64", "65", "66", "67", "68", "69", "70", __VA_ARGS__)
#define JAXOPS_WG_REGS_192 JAXOPS_WG_P10() ", " JAXOPS_WG_P10(1) ", " JAXOPS_WG_P10(2) ", " JAXOPS_WG_P10(3) ", " JAXOPS_WG_P10(4) ", " JAXOPS_WG_P10(5) ", " JAXOPS_WG_P10(6) ", " JAXOPS_WG_P10(7) ", " JAXOPS_WG_P10(8) ", " JAXOPS_WG_P6(9)
#define JAXOPS_WG_CONS_192 JAXOPS_WG_C10(), JAXOPS_WG_C10(1), JAXOPS_WG_C10(2), JAXOPS_WG_C10(3), JAXOPS_WG_C10(4), JAXOPS_WG_C10(5), JAXOPS_WG_C10(6), JAXOPS_WG_C10(7), JAXOPS_WG_C10(8), JAXOPS_WG_C6(9)
#define JAXOPS_WG_N192(F, ...) F("192", JAXOPS_WG_REGS_192, JAXOPS_WG_CONS_192, "96", "97", "98", "99", "100", "101", "102", __VA_ARGS__)
#define JAXOPS_WG_REGS_256 JAXOPS_WG_P10() ", " JAXOPS_WG_P10(1) ", " JAXOPS_WG_P10(2) ", " JAXOPS_WG_P10(3) ", " JAXOPS_WG_P10(4) ", " JAXOPS_WG_P10(5) ", " JAXOPS_WG_P10(6) ", " JAXOPS_WG_P10(7) ", " JAXOPS_WG_P10(8) ", " JAXOPS_WG_P10(9) ", " JAXOPS_WG_P10(10) ", " JAXOPS_WG_P10(11) ", " JAXOPS_WG_P8(12)
#define JAXOPS_WG_CONS_256 JAXOPS_WG_C10(), JAXOPS_WG_C10(1), JAXOPS_WG_C10(2), JAXOPS_WG_C10(3), JAXOPS_WG_C10(4), JAXOPS_WG_C10(5), JAXOPS_WG_C10(6), JAXOPS_WG_C10(7), JAXOPS_WG_C10(8), JAXOPS_WG_C10(9), JAXOPS_WG_C10(10), JAXOPS_WG_C10(11), JAXOPS_WG_C8(12)
#define JAXOPS_WG_N256(F, ...) F("256", JAXOPS_WG_REGS_256, JAXOPS_WG_CONS_256, "128", "129", "130", "131", "132", "133", "134", __VA_ARGS__)

// The products' N: every N the attention kernels take (and the small ones for
// tests). Calls F for the accumulator's N.
#define JAXOPS_WG_FOR_N(F, ...)                                                      \
  if constexpr (N == 8) { JAXOPS_WG_N8(F, __VA_ARGS__) }                            \
  else if constexpr (N == 16) { JAXOPS_WG_N16(F, __VA_ARGS__) }                     \
  else if constexpr (N == 32) { JAXOPS_WG_N32(F, __VA_ARGS__) }                     \
  else if constexpr (N == 64) { JAXOPS_WG_N64(F, __VA_ARGS__) }                     \
  else if constexpr (N == 96) { JAXOPS_WG_N96(F, __VA_ARGS__) }                     \
  else if constexpr (N == 128) { JAXOPS_WG_N128(F, __VA_ARGS__) }                   \
  else if constexpr (N == 192) { JAXOPS_WG_N192(F, __VA_ARGS__) }                   \
  else { JAXOPS_WG_N256(F, __VA_ARGS__) }

// SS, 16-bit: d, desc-a (%R), desc-b (%R+1), scale-d (%R+2), imm-scale-a/b 1,
// imm-trans-a (%R+3), imm-trans-b (%R+4).
#define JAXOPS_WG_SS16(n, regs, cons, i0, i1, i2, i3, i4, i5, i6, type)                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" i2 ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" n "k16.f32." type "." type " {" regs  \
               "}, %" i0 ", %" i1 ", p, 1, 1, %" i3 ", %" i4 ";\n}\n"                     \
               : cons                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(scale), "n"(static_cast<int>(kMajorA)),   \
                 "n"(static_cast<int>(kMajorB)));
// RS, 16-bit: d, {a0..a3} (%R..%R+3), desc-b (%R+4), scale-d (%R+5), 1, 1, imm-trans-b (%R+6).
#define JAXOPS_WG_RS16(n, regs, cons, i0, i1, i2, i3, i4, i5, i6, type)                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" i5 ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" n "k16.f32." type "." type " {" regs  \
               "}, {%" i0 ", %" i1 ", %" i2 ", %" i3 "}, %" i4 ", p, 1, 1, %" i6 ";\n}\n" \
               : cons                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale),    \
                 "n"(static_cast<int>(kMajorB)));
// SS, TF32 (K-major only): d, desc-a (%R), desc-b (%R+1), scale-d (%R+2), 1, 1.
#define JAXOPS_WG_SS_TF32(n, regs, cons, i0, i1, i2, i3, i4, i5, i6, unused)          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" i2 ", 0;\n"                       \
               "wgmma.mma_async.sync.aligned.m64n" n "k8.f32.tf32.tf32 {" regs "}, %" i0 \
               ", %" i1 ", p, 1, 1;\n}\n"                                              \
               : cons                                                                 \
               : "l"(desc_a), "l"(desc_b), "r"(scale));
// RS, TF32: d, {a0..a3} (%R..%R+3), desc-b (%R+4), scale-d (%R+5), 1, 1.
#define JAXOPS_WG_RS_TF32(n, regs, cons, i0, i1, i2, i3, i4, i5, i6, unused)              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" i5 ", 0;\n"                           \
               "wgmma.mma_async.sync.aligned.m64n" n "k8.f32.tf32.tf32 {" regs "}, {%" i0 \
               ", %" i1 ", %" i2 ", %" i3 "}, %" i4 ", p, 1, 1;\n}\n"                      \
               : cons                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale));

namespace jaxops::cuda::wgmma {

template <int N>
constexpr bool kProductN = N == 8 || N == 16 || N == 32 || N == 64 || N == 96 || N == 128 ||
                           N == 192 || N == 256;

// d = A B + (scale_d ? d : 0), m64nNk16, A (64 x 16) and B (16 x N) in shared
// memory by descriptor; T = __nv_bfloat16 or __half. kMajorA / kMajorB: K-major
// (Q, K: the rows of the matrices in memory run along K) or MN-major (V for
// P V: rows of B run along N). Every thread of the warpgroup calls it together,
// after a fence(); d is pending until a wait_group that covers it.
template <typename T, Major kMajorA = Major::kK, Major kMajorB = Major::kK, int N>
__device__ __forceinline__ void mma_ss(Accumulator<N>& d, uint64_t desc_a, uint64_t desc_b,
                                       bool scale_d) {
  static_assert(kHalfType<T>, "m64nNk16 takes bfloat16 or float16 operands");
  static_assert(kProductN<N>, "N is one of 8, 16, 32, 64, 96, 128, 192, 256");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_ss<N, T>(d.x, d.state, desc_a, desc_b, scale_d,
                                 kMajorA == Major::kMN, kMajorB == Major::kMN);
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  const uint32_t scale = scale_d ? 1u : 0u;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    JAXOPS_WG_FOR_N(JAXOPS_WG_SS16, "bf16")
  } else {
    JAXOPS_WG_FOR_N(JAXOPS_WG_SS16, "f16")
  }
#endif
}

// d = A B + (scale_d ? d : 0), m64nNk16 with A from registers: a[r] of thread t
// holds elements 2r (low half) and 2r + 1 of register_a_coord(t, .). A must not
// change until a wait_group covers the product.
template <typename T, Major kMajorB = Major::kK, int N>
__device__ __forceinline__ void mma_rs(Accumulator<N>& d, const uint32_t (&a)[4],
                                       uint64_t desc_b, bool scale_d) {
  static_assert(kHalfType<T>, "m64nNk16 takes bfloat16 or float16 operands");
  static_assert(kProductN<N>, "N is one of 8, 16, 32, 64, 96, 128, 192, 256");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_rs<N, T>(d.x, d.state, a, desc_b, scale_d, kMajorB == Major::kMN);
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  const uint32_t scale = scale_d ? 1u : 0u;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    JAXOPS_WG_FOR_N(JAXOPS_WG_RS16, "bf16")
  } else {
    JAXOPS_WG_FOR_N(JAXOPS_WG_RS16, "f16")
  }
#endif
}

// d = A B + (scale_d ? d : 0), m64nNk8 with TF32 operands (float32 bit patterns
// in shared memory, of which the tensor cores read the top 19 bits), both K-major:
// the ISA has no transpose for TF32.
template <int N>
__device__ __forceinline__ void mma_ss_tf32(Accumulator<N>& d, uint64_t desc_a, uint64_t desc_b,
                                            bool scale_d) {
  static_assert(kProductN<N>, "N is one of 8, 16, 32, 64, 96, 128, 192, 256");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_ss<N, float>(d.x, d.state, desc_a, desc_b, scale_d, false, false);
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  const uint32_t scale = scale_d ? 1u : 0u;
  JAXOPS_WG_FOR_N(JAXOPS_WG_SS_TF32, 0)
#endif
}

// m64nNk8 TF32 with A from registers (register_a_tf32_coord), B K-major by descriptor.
template <int N>
__device__ __forceinline__ void mma_rs_tf32(Accumulator<N>& d, const uint32_t (&a)[4],
                                            uint64_t desc_b, bool scale_d) {
  static_assert(kProductN<N>, "N is one of 8, 16, 32, 64, 96, 128, 192, 256");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_rs<N, float>(d.x, d.state, a, desc_b, scale_d, false);
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  const uint32_t scale = scale_d ? 1u : 0u;
  JAXOPS_WG_FOR_N(JAXOPS_WG_RS_TF32, 0)
#endif
}

}  // namespace jaxops::cuda::wgmma

#undef JAXOPS_WG_P1
#undef JAXOPS_WG_P2
#undef JAXOPS_WG_P3
#undef JAXOPS_WG_P4
#undef JAXOPS_WG_P5
#undef JAXOPS_WG_P6
#undef JAXOPS_WG_P7
#undef JAXOPS_WG_P8
#undef JAXOPS_WG_P9
#undef JAXOPS_WG_P10
#undef JAXOPS_WG_F
#undef JAXOPS_WG_C1
#undef JAXOPS_WG_C2
#undef JAXOPS_WG_C3
#undef JAXOPS_WG_C4
#undef JAXOPS_WG_C5
#undef JAXOPS_WG_C6
#undef JAXOPS_WG_C7
#undef JAXOPS_WG_C8
#undef JAXOPS_WG_C9
#undef JAXOPS_WG_C10
#undef JAXOPS_WG_REGS_8
#undef JAXOPS_WG_CONS_8
#undef JAXOPS_WG_N8
#undef JAXOPS_WG_REGS_16
#undef JAXOPS_WG_CONS_16
#undef JAXOPS_WG_N16
#undef JAXOPS_WG_REGS_32
#undef JAXOPS_WG_CONS_32
#undef JAXOPS_WG_N32
#undef JAXOPS_WG_REGS_64
#undef JAXOPS_WG_CONS_64
#undef JAXOPS_WG_N64
#undef JAXOPS_WG_REGS_96
#undef JAXOPS_WG_CONS_96
#undef JAXOPS_WG_N96
#undef JAXOPS_WG_REGS_128
#undef JAXOPS_WG_CONS_128
#undef JAXOPS_WG_N128
#undef JAXOPS_WG_REGS_192
#undef JAXOPS_WG_CONS_192
#undef JAXOPS_WG_N192
#undef JAXOPS_WG_REGS_256
#undef JAXOPS_WG_CONS_256
#undef JAXOPS_WG_N256
#undef JAXOPS_WG_FOR_N
#undef JAXOPS_WG_SS16
#undef JAXOPS_WG_RS16
#undef JAXOPS_WG_SS_TF32
#undef JAXOPS_WG_RS_TF32
