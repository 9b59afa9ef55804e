// 16-byte packs: the loads and stores of the bandwidth-bound kernels (the
// row-wise and elementwise families). A pack is kVec consecutive elements moved
// by one instruction (LDG.E.128 / STG.E.128 when kVec * sizeof(T) = 16) and
// converted to or from the float32 every kernel computes in.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/float_convert.cuh"

namespace jaxops::cuda::pack_io {

constexpr int kPackBytes = 16;

// Elements of T in a 16-byte pack.
template <typename T>
constexpr int kPackElements = kPackBytes / static_cast<int>(sizeof(T));

// The type that moves `kBytes` bytes in one load/store instruction. Packs go
// through it (in a union with their elements): copied as an array or struct of
// T, a pack is moved element by element.
template <int kBytes>
struct Raw;
template <>
struct Raw<2> {
  using type = unsigned short;
};
template <>
struct Raw<4> {
  using type = unsigned int;
};
template <>
struct Raw<8> {
  using type = uint2;
};
template <>
struct Raw<16> {
  using type = uint4;
};

// Loads kVec consecutive elements (kVec * sizeof(T) bytes, aligned to that:
// 16 when vectorised) into float32.
template <typename T, int kVec>
__device__ __forceinline__ void load_pack(const T* p, float* out) {
  using RawPack = typename Raw<sizeof(T) * kVec>::type;
  union {
    RawPack raw;
    T values[kVec];
  } pack;
  pack.raw = *reinterpret_cast<const RawPack*>(p);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = to_float(pack.values[j]);
}

template <typename T, int kVec>
__device__ __forceinline__ void store_pack(T* p, const float* in) {
  using RawPack = typename Raw<sizeof(T) * kVec>::type;
  union {
    RawPack raw;
    T values[kVec];
  } pack;
#pragma unroll
  for (int j = 0; j < kVec; ++j) pack.values[j] = from_float<T>(in[j]);
  if constexpr (sizeof(RawPack) == 16) {
    // A plain 16-byte store is split into 4- or 2-byte stores in some loops;
    // the intrinsic keeps it one instruction.
    __stwb(reinterpret_cast<RawPack*>(p), pack.raw);
  } else {
    *reinterpret_cast<RawPack*>(p) = pack.raw;
  }
}

// True when every buffer is 16-byte aligned (null is aligned).
inline bool aligned(std::initializer_list<const void*> buffers) {
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % kPackBytes != 0) return false;
  }
  return true;
}

// True when rows of `elements` elements are whole packs and every buffer is
// 16-byte aligned: then every row of every buffer starts 16-byte aligned.
template <typename T>
bool can_vectorize(int64_t elements, std::initializer_list<const void*> buffers) {
  return elements % kPackElements<T> == 0 && aligned(buffers);
}

// Calls body with the pack width (elements per load: a 16-byte pack, or 1) as
// a compile-time constant.
template <typename T, typename Body>
cudaError_t with_pack_width(bool vectorize, Body&& body) {
  if (vectorize) return body(std::integral_constant<int, kPackElements<T>>());
  return body(std::integral_constant<int, 1>());
}

}  // namespace jaxops::cuda::pack_io
