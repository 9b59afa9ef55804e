// The sm_80+ instructions of the tensor-core attention kernels, one device
// function each: the warp-level products mma.sync (m16n8k16 with bfloat16 or
// float16 operands, m16n8k8 with TF32 operands; float32 accumulators), the
// shared-memory fragment loads ldmatrix (x1/x2/x4, with and without .trans) and
// the asynchronous 16-byte copies cp.async.cg with their commit and wait groups.
//
// Under nvcc each is its inline PTX. Under the CPU harness (tests/cuda_harness)
// each is emulated with the PTX ISA's exact per-lane fragment layouts and its
// hazards (include/mma_emulation.h): mma.sync and ldmatrix are warp collectives
// (every lane must arrive, else the launch fails), and a cp.async destination
// holds poison until the cp.async.wait_group that covers it, a read of it by
// ldmatrix before then failing the launch. So the kernels' own fragment
// bookkeeping, pipelines and barriers are what run in CI.
//
// Layouts, for lane l with g = l >> 2 (groupID) and t = l & 3
// (threadID_in_group), from the PTX ISA, section 9.7.14.5 "Matrix fragments
// for mma.m16n8k16 with floating point type" and "for mma.m16n8k8" (.tf32):
//   m16n8k16 (.bf16/.f16): A (16 x 16, row) a[r] holds elements 2r, 2r + 1
//     (low half first) of a0..a7: element i at row g + 8 ((i >> 1) & 1),
//     column 2t + (i & 1) + 8 (i >> 2). B (16 x 8, col) b[r] holds b(2r),
//     b(2r + 1): element i at row 2t + (i & 1) + 8 (i >> 1), column g.
//   m16n8k8 (.tf32): a[i] at row g + 8 (i & 1), column t + 4 (i >> 1);
//     b[i] at row t + 4 i, column g.
//   C and D (16 x 8, f32), both shapes: c[i] at row g + 8 (i >> 1), column
//     2t + (i & 1).
//   ldmatrix .m8n8 .b16 (section 9.7.14.5.15): lanes 8m .. 8m + 7 give the
//     row addresses (16 bytes each, 16-byte aligned) of matrix m; register m
//     of lane l then holds elements 2t, 2t + 1 of row g of matrix m, or with
//     .trans elements g of rows 2t and 2t + 1.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#ifdef JAXOPS_CUDA_HARNESS
#include "mma_emulation.h"
#endif

// mma.sync m16n8k16 and m16n8k8 .tf32 and cp.async are sm_80 instructions: a
// build that includes older architectures compiles them to a trap there, and
// the launchers keep such devices away (attention_kernels::device_has_tensor_cores).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define JAXOPS_MMA_BELOW_SM80 1
#endif

namespace jaxops::cuda::mma {

template <typename T>
constexpr bool kHalfType = std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

// d += A B, m16n8k16, T = __half or __nv_bfloat16. Every lane of the warp calls it together.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
  static_assert(kHalfType<T>, "m16n8k16 takes bfloat16 or float16 operands");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::mma_m16n8k16<T>(d, a, b);
#elif defined(JAXOPS_MMA_BELOW_SM80)
  __trap();
#else
#define JAXOPS_MMA_OPERANDS                                                               \
  " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" JAXOPS_MMA_OPERANDS);
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" JAXOPS_MMA_OPERANDS);
  }
#undef JAXOPS_MMA_OPERANDS
#endif
}

// d += A B, m16n8k8 with TF32 operands: the registers hold float32 bit patterns,
// of which the tensor cores read the TF32 bits (round them first, tf32_bits).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::mma_m16n8k8_tf32(d, a, b);
#elif defined(JAXOPS_MMA_BELOW_SM80)
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
      " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// float32 rounded to TF32 (cvt.rna.tf32.f32: to nearest, ties away from zero),
// as the bits of a TF32 operand register.
__device__ __forceinline__ uint32_t tf32_bits(float x) {
  return __float_as_uint(nvcuda::wmma::__float_to_tf32(x));
}

#ifndef JAXOPS_CUDA_HARNESS
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16: kMatrices 8 x 8 matrices of
// 16-bit elements; `row` is this lane's row address (lanes 0 .. 8 kMatrices - 1).
template <int kMatrices, bool kTrans>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[kMatrices], const void* row) {
  static_assert(kMatrices == 1 || kMatrices == 2 || kMatrices == 4, "x1, x2 or x4");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::ldmatrix<kMatrices, kTrans>(r, row);
#else
  const uint32_t address = shared_address(row);
  if constexpr (kMatrices == 1) {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                   : "=r"(r[0]) : "r"(address));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                   : "=r"(r[0]) : "r"(address));
    }
  } else if constexpr (kMatrices == 2) {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(r[0]), "=r"(r[1]) : "r"(address));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(r[0]), "=r"(r[1]) : "r"(address));
    }
  } else {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    }
  }
#endif
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: 16 bytes from global
// to shared memory, both 16-byte aligned, the bytes past src_bytes (0 or 16
// here) zero, in the background: dst is undefined until a cp_async_wait that
// covers the group the copy was committed in.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::cp_async_16(dst, src, src_bytes);
#elif defined(JAXOPS_MMA_BELOW_SM80)
  __trap();
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(shared_address(dst)), "l"(src), "r"(src_bytes) : "memory");
#endif
}

// cp.async.commit_group: the calling thread's copies since the last commit form a group.
__device__ __forceinline__ void cp_async_commit() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::cp_async_commit();
#elif defined(JAXOPS_MMA_BELOW_SM80)
  __trap();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// cp.async.wait_group kPending: the calling thread's groups but the kPending
// most recent ones have landed (visible to the other threads after a barrier).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::cp_async_wait(kPending);
#elif defined(JAXOPS_MMA_BELOW_SM80)
  __trap();
#else
  asm volatile("cp.async.wait_group %0;\n" :: "n"(kPending) : "memory");
#endif
}

}  // namespace jaxops::cuda::mma
