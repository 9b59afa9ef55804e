// The sparse tensor-core instruction of the 2:4 sparse linear layer's
// bfloat16/float16 forward (cuda/sparse.cu), and the conversion of jaxops'
// packed metadata (params/sparse.h) to the instruction's.
//
// mma.sp m16n8k32 (sm_80+): D[16 x 8] = A[16 x 32] B[32 x 8] + C, A 2:4 sparse
// and held compressed (16 x 16) with a 4-bit metadata nibble per chunk of 4
// columns: the in-chunk indices of the chunk's two kept elements, the first in
// bits 0-1, the second in bits 2-3. That is jaxops' packing already (the
// positions of values 2c and 2c + 1 of a row, low bits first), so a row's 8
// chunks of a 32-wide tile are 4 consecutive metadata bytes. Two things differ:
//   - the hardware needs the two indices strictly ascending (0b0100, 0b1000,
//     0b1100, 0b1001, 0b1101, 0b1110; anything else is undefined behaviour),
//     while jaxops allows any order and equal positions, which add up. Every
//     nibble is canonicalised on the fly as it is loaded, and the values of its
//     chunk with it: descending pairs swap, an equal pair becomes its sum next
//     to a zero (rounded to T once, as the reference decompress sums in T), and
//     the zero nibble of padding becomes 0b0100 over two zero values.
//   - the register layout: each lane holds the metadata of 4 chunks of two
//     rows (see mma_sp_m16n8k32), gathered from the packed rows in the tile
//     load. No conversion kernel and no converted copy: the metadata is 1/8 of
//     the values' bytes and the canonicalisation is a few integer operations
//     per nibble, so converting on load costs less than a second pass, and the
//     op keeps one packed format (the CPU kernels and the gradients read it as is).
//
// On the harness (tests/cuda_harness) the instruction is emulated with the same
// per-lane layouts (include/sparse_mma_emulation.h), so everything around it
// (fragment loads, metadata conversion, stores) runs there as on a GPU.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/float_convert.cuh"

#include <cuda_runtime_api.h>

#ifdef JAXOPS_CUDA_HARNESS
#include "sparse_mma_emulation.h"
#endif

namespace jaxops::cuda::sparse_mma {

// Whether the current device has sparse tensor cores (sm_80+). A build may
// include older architectures (JAXOPS_CUDA_ARCHITECTURES=75, a T4): there the
// launcher takes the SIMT forward, and the tensor-core kernel, compiled to a
// trap for them, is never launched.
inline bool device_has_sparse_mma() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  return major >= 8;
}

// The tile of one instruction: 16 outputs x 8 rows of x x 32 inputs.
constexpr int kOut = 16;
constexpr int kRows = 8;
constexpr int kK = 32;
constexpr int kGroupsPerTile = kK / 4;

__device__ __forceinline__ uint32_t bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// A .b32 register of two 16-bit elements, `low` at the lower index.
template <typename T>
__device__ __forceinline__ uint32_t pack(T low, T high) {
  return bits(low) | bits(high) << 16;
}

// The hardware's nibble for jaxops' nibble (first position in bits 0-1, second
// in bits 2-3): ascending, distinct.
__device__ __forceinline__ uint32_t canonical_nibble(uint32_t nibble) {
  const uint32_t first = nibble & 3u, second = nibble >> 2 & 3u;
  if (first < second) return nibble & 0xfu;
  if (first > second) return second | first << 2;
  const uint32_t other = first ^ 1u;  // a partner in the same chunk
  return first < other ? first | other << 2 : other | first << 2;
}

// Canonicalises 4 nibbles (a row's 4 chunks) at once.
__device__ __forceinline__ uint32_t canonical_nibbles(uint32_t nibbles) {
  uint32_t out = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) out |= canonical_nibble(nibbles >> (4 * c)) << (4 * c);
  return out;
}

// The values of a chunk in the order of canonical_nibble(nibble), as a register.
template <typename T>
__device__ __forceinline__ uint32_t canonical_values(uint32_t nibble, T first_value,
                                                     T second_value) {
  const uint32_t first = nibble & 3u, second = nibble >> 2 & 3u;
  if (first < second) return pack(first_value, second_value);
  if (first > second) return pack(second_value, first_value);
  const T sum = from_float<T>(to_float(first_value) + to_float(second_value));
  const T zero = from_float<T>(0.f);
  // The position is the higher of its pair (with first ^ 1) when it is odd.
  return first & 1u ? pack(zero, sum) : pack(sum, zero);
}

// acc += A B for the calling lane's registers (l = lane, g = l >> 2, t = l & 3):
//   a[0], a[1]: the 2 kept values of chunk t of rows g and g + 8;
//   a[2], a[3]: the same of chunk t + 4;
//   b[j]: B rows 2t + 8j and 2t + 8j + 1 of column g;
//   acc[i]: D row g + 8 (i >> 1), column 2t + (i & 1);
//   metadata (sparsity selector 0: lanes with t = 0, 1 supply it): chunks
//     4t .. 4t + 3 of row g in bits 0-15 and of row g + 8 in bits 16-31
//     (lanes with t = 2, 3 may pass anything).
// Every lane of the warp must call it together (a warp-synchronous instruction).
template <typename T>
__device__ __forceinline__ void mma_sp_m16n8k32(float (&acc)[4], const uint32_t (&a)[4],
                                                const uint32_t (&b)[4], uint32_t metadata) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                "mma.sp takes bfloat16 or float16 operands");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::sparse_mma_m16n8k32<T, 0>(acc, a, b, acc, metadata);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no mma.sp below sm_80; device_has_sparse_mma keeps the launcher away
#else
// CUDA 12.5+ names the ascending-metadata form (all canonical metadata is) and
// warns about the plain one.
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 5)
#define JAXOPS_MMA_SP "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32."
#else
#define JAXOPS_MMA_SP "mma.sp.sync.aligned.m16n8k32.row.col.f32."
#endif
#define JAXOPS_MMA_SP_OPERANDS                                                              \
  " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n" \
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                              \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),      \
        "r"(b[3]), "r"(metadata)
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(JAXOPS_MMA_SP "bf16.bf16.f32" JAXOPS_MMA_SP_OPERANDS);
  } else {
    asm volatile(JAXOPS_MMA_SP "f16.f16.f32" JAXOPS_MMA_SP_OPERANDS);
  }
#undef JAXOPS_MMA_SP_OPERANDS
#undef JAXOPS_MMA_SP
#endif
}

}  // namespace jaxops::cuda::sparse_mma
