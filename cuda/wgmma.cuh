// The sm_90a warpgroup matrix products (wgmma), one device function each:
// wgmma.mma_async m64nNk16 with bfloat16 or float16 operands and m64nNk8 with
// TF32 operands, float32 accumulators, A from shared memory (SS) or from
// registers (RS), B from shared memory; wgmma.fence, wgmma.commit_group and
// wgmma.wait_group; the 64-bit shared-memory matrix descriptor and the
// swizzle of the 16-byte chunks that the descriptor's modes read through.
// A sibling of mma.cuh (the sm_80 warp products), in the same style.
//
// Under nvcc each is its inline PTX, which exists only for sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL: compile Hopper kernels with -arch=sm_90a); any
// other architecture compiles the instructions to a trap, and the launchers keep
// other devices away. Under the CPU harness (tests/cuda_harness) each is
// emulated with its PTX ISA semantics (include/wgmma_emulation.h): the product
// is a collective of the 128 threads of the warpgroup, A and B are read from
// shared memory through the descriptor (LBO, SBO, swizzle) as the hardware
// reads them, and the accumulator is pending until the wgmma.wait_group that
// covers it: reading or writing it earlier fails the launch, as does a product
// issued without a wgmma.fence after the accumulator was last touched.
//
// Fragments (PTX ISA, wgmma "Register Fragments", checked against CuTe's
// SM90 GMMA atoms by tests/test_cute_oracle.py). Thread t of the warpgroup
// (t = threadIdx.x % 128), warp w = t / 32, lane l = t % 32:
//   accumulator D (64 x N, f32), element i of N / 2:
//     row 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2;
//   register A, 16-bit types (64 x 16): register r holds elements 2r (low
//     half) and 2r + 1; element i of 8 at row 16 w + l / 4 + 8 ((i / 2) % 2),
//     column 2 (l % 4) + i % 2 + 8 (i / 4) (each warp's 16 rows are the
//     m16n8k16 A fragment of mma.sync);
//   register A, TF32 (64 x 8): register i at row 16 w + l / 4 + 8 (i % 2),
//     column l % 4 + 4 (i / 2).
//
// Shared-memory operands (PTX ISA, wgmma "Shared Memory Matrix Layout" and
// "Matrix Descriptor Format"; CuTe's make_gmma_desc). A is M x K (M = 64), B is
// K x N; "MN" below is M for A and N for B. Memory is made of core matrices of 8
// rows of 16 bytes. With E bytes an element and T = 16 / E elements in 16 bytes
// (8 for 16-bit types, 4 for TF32), the byte offset of element (mn, k) from the
// descriptor's start address, before the swizzle, is
//   K-major ("not transposed": k contiguous):
//     none:  16 (mn % 8) + SBO (mn / 8) + LBO (k / T) + E (k % T)
//     swizzle of 16 W bytes (W = 2, 4, 8 for 32B, 64B, 128B):
//            16 W (mn % 8) + SBO (mn / 8) + 16 (k / T) + E (k % T)
//            (LBO unused: the K chunks are adjacent within the swizzled row)
//   MN-major ("transposed": mn contiguous; 16-bit types only):
//     none:  SBO (mn / T) + E (mn % T) + 16 (k % 8) + LBO (k / 8)
//     swizzle of 16 W bytes:
//            16 ((mn / T) % W) + LBO (mn / T / W) + E (mn % T)
//            + 16 W (k % 8) + SBO (k / 8)
// and the hardware then swizzles the absolute shared-memory byte address a:
// the 16-byte chunk bits a[4, 4 + b) are XORed with a[7, 7 + b), b = 3, 2, 1
// for 128B, 64B, 32B (CuTe's Swizzle<b, 4, 3>). So a tile written through
// swizzled_offset() from a base aligned to the pattern (1024 bytes for 128B,
// 512 for 64B, 256 for 32B) is read back right, also by a descriptor whose start
// moved along K inside the swizzled row (advance_descriptor).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifdef JAXOPS_CUDA_HARNESS
#include "wgmma_emulation.h"
#endif

#if !defined(JAXOPS_CUDA_HARNESS) && defined(__CUDA_ARCH__) && \
    !(__CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL))
// wgmma exists only on sm_90a: any other device code traps.
#define JAXOPS_WGMMA_UNAVAILABLE 1
#endif

namespace jaxops::cuda::wgmma {

// The descriptor's swizzle mode, bits 62-63, as the PTX ISA encodes it.
enum class Swizzle : uint32_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// Which index is contiguous in shared memory: the ISA's imm-trans-a/b is 0 for
// K-major and 1 for MN-major ("transposed").
enum class Major : int { kK = 0, kMN = 1 };

// b of CuTe's Swizzle<b, 4, 3>: log2 of the 16-byte chunks in a swizzled row.
__host__ __device__ constexpr uint32_t swizzle_bits(Swizzle s) {
  return s == Swizzle::k128B ? 3u : s == Swizzle::k64B ? 2u : s == Swizzle::k32B ? 1u : 0u;
}

// Bytes of one swizzled row (16 W), 16 without a swizzle.
__host__ __device__ constexpr uint32_t swizzle_row_bytes(Swizzle s) {
  return 16u << swizzle_bits(s);
}

// The byte at `byte_offset` from a pattern-aligned base, as the hardware places
// it: bits [4, 4 + b) XOR bits [7, 7 + b). An involution, so it maps both ways.
__host__ __device__ constexpr uint32_t swizzled_offset(Swizzle s, uint32_t byte_offset) {
  const uint32_t mask = (1u << swizzle_bits(s)) - 1u;
  return byte_offset ^ (((byte_offset >> 7) & mask) << 4);
}

// The matrix descriptor: start address >> 4 in bits 0-13, leading-dimension
// byte offset >> 4 in 16-29, stride-dimension byte offset >> 4 in 32-45, base
// offset in 49-51 (0 here: tiles are aligned to their swizzle pattern) and the
// swizzle mode in 62-63. Addresses and offsets are 16-byte multiples below 256 KiB.
__host__ __device__ constexpr uint64_t make_descriptor(uint32_t smem_byte_address, Swizzle swizzle,
                                                       uint32_t leading_byte_offset,
                                                       uint32_t stride_byte_offset) {
  return (uint64_t{(smem_byte_address >> 4) & 0x3fffu}) |
         (uint64_t{(leading_byte_offset >> 4) & 0x3fffu} << 16) |
         (uint64_t{(stride_byte_offset >> 4) & 0x3fffu} << 32) |
         (uint64_t{static_cast<uint32_t>(swizzle) & 3u} << 62);
}

// The descriptor of the same layout `bytes` further on (a multiple of 16): what a
// kernel does between k-steps (32 bytes per k16 step of a 16-bit K-major tile in
// a swizzled row, or the next core matrices). Only the start address moves.
__host__ __device__ constexpr uint64_t advance_descriptor(uint64_t desc, uint32_t bytes) {
  const uint64_t start = (desc + (bytes >> 4)) & 0x3fffu;
  return (desc & ~uint64_t{0x3fffu}) | start;
}

// The fields of a descriptor, in bytes (the emulation and the tests read them).
struct DescriptorFields {
  uint32_t start_address;
  uint32_t leading_byte_offset;
  uint32_t stride_byte_offset;
  uint32_t base_offset;
  Swizzle swizzle;
};

__host__ __device__ constexpr DescriptorFields decode_descriptor(uint64_t desc) {
  return {static_cast<uint32_t>(desc & 0x3fffu) << 4,
          static_cast<uint32_t>((desc >> 16) & 0x3fffu) << 4,
          static_cast<uint32_t>((desc >> 32) & 0x3fffu) << 4,
          static_cast<uint32_t>((desc >> 49) & 7u),
          static_cast<Swizzle>(static_cast<uint32_t>(desc >> 62) & 3u)};
}

// The byte offset of element (mn, k) from the descriptor's start address, before
// the swizzle (the canonical layouts at the top of this file).
__host__ __device__ constexpr uint32_t canonical_offset(Major major, Swizzle s,
                                                        uint32_t element_bytes,
                                                        uint32_t leading_byte_offset,
                                                        uint32_t stride_byte_offset, uint32_t mn,
                                                        uint32_t k) {
  const uint32_t per_chunk = 16u / element_bytes;  // T
  const uint32_t w = 1u << swizzle_bits(s);
  if (major == Major::kK) {
    const uint32_t row = (mn % 8) * (s == Swizzle::kNone ? 16u : 16u * w);
    const uint32_t chunk = (k / per_chunk) * (s == Swizzle::kNone ? leading_byte_offset : 16u);
    return row + (mn / 8) * stride_byte_offset + chunk + (k % per_chunk) * element_bytes;
  }
  const uint32_t chunk = mn / per_chunk, inside = (mn % per_chunk) * element_bytes;
  if (s == Swizzle::kNone) {
    return chunk * stride_byte_offset + inside + (k % 8) * 16 + (k / 8) * leading_byte_offset;
  }
  return (chunk % w) * 16 + (chunk / w) * leading_byte_offset + inside + (k % 8) * 16 * w +
         (k / 8) * stride_byte_offset;
}

// (row, column) of a fragment element in its matrix.
struct RowCol {
  int row;
  int col;
};

// Element i of the accumulator of thread t (0..127) of the warpgroup.
__host__ __device__ constexpr RowCol accumulator_coord(int t, int i) {
  return {16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2), 8 * (i / 4) + 2 * (t % 4) + i % 2};
}

// Element i (0..7, register i / 2, low half first) of the 16-bit A fragment of thread t.
__host__ __device__ constexpr RowCol register_a_coord(int t, int i) {
  return {16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2), 2 * (t % 4) + i % 2 + 8 * (i / 4)};
}

// Register i (0..3) of the TF32 A fragment of thread t.
__host__ __device__ constexpr RowCol register_a_tf32_coord(int t, int i) {
  return {16 * (t / 32) + (t % 32) / 4 + 8 * (i % 2), (t % 4) + 4 * (i / 2)};
}

template <int N>
constexpr bool kValidN = N >= 8 && N <= 256 && N % 8 == 0;

// The per-thread f32 accumulator fragment of an m64nN product: N / 2 floats
// (layout: accumulator_coord). Under the harness every access goes through
// operator[], which fails the launch while the fragment belongs to a wgmma
// that no wgmma.wait_group has covered.
template <int N>
struct Accumulator {
  static_assert(kValidN<N>, "m64nN: N is a multiple of 8 in [8, 256]");
  static constexpr int kSize = N / 2;
#ifdef JAXOPS_CUDA_HARNESS
  float x[kSize];
  mutable jaxops_harness::WgmmaAccumulatorState state;
  float& operator[](int i) {
    jaxops_harness::wgmma_access(state, i);
    return x[i];
  }
  const float& operator[](int i) const {
    jaxops_harness::wgmma_access(state, i);
    return x[i];
  }
#else
  float x[kSize];
  __device__ __forceinline__ float& operator[](int i) { return x[i]; }
  __device__ __forceinline__ const float& operator[](int i) const { return x[i]; }
#endif
};

template <typename T>
constexpr bool kHalfType = std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

#ifndef JAXOPS_CUDA_HARNESS
// The 32-bit shared-memory address of a generic pointer to shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#else
inline uint32_t shared_address(const void* p) { return jaxops_harness::wgmma_shared_address(p); }
#endif

// wgmma.fence.sync.aligned: orders this thread's earlier register accesses (of
// accumulators and A fragments) before the next wgmma.mma_async. Needed before
// the first product and after touching an accumulator or A registers.
__device__ __forceinline__ void fence() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_fence();
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

// wgmma.commit_group.sync.aligned: this thread's products since the last
// commit form a group.
__device__ __forceinline__ void commit_group() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_commit_group();
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving accesses of the accumulator's registers across
// the asynchronous region (the asm claims to rewrite them), as CUTLASS's
// warpgroup_fence_operand does.
template <int N>
__device__ __forceinline__ void fence_operand(Accumulator<N>& d) {
#if !defined(JAXOPS_CUDA_HARNESS) && !defined(JAXOPS_WGMMA_UNAVAILABLE)
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(d.x[i])::"memory");
#else
  (void)d;
#endif
}

// wgmma.wait_group.sync.aligned kPending: every group of this thread but the
// kPending most recent ones has completed. The accumulators passed are then
// fenced (fence_operand), so that reads of them stay after the wait.
template <int kPending, typename... Accumulators>
__device__ __forceinline__ void wait_group(Accumulators&... accumulators) {
  static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group takes 0..7");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::wgmma_wait_group(kPending);
#elif defined(JAXOPS_WGMMA_UNAVAILABLE)
  __trap();
#else
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
  (fence_operand(accumulators), ...);
}

}  // namespace jaxops::cuda::wgmma

#include "wgmma_products.cuh"
