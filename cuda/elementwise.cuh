// Device helpers shared by the elementwise-style CUDA kernels (activations,
// rope, embedding, adamw): conversions between the storage types and float32,
// and grid-stride launch sizes.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/float_convert.cuh"

namespace jaxops::cuda::elementwise {

constexpr int kThreads = 256;
// Grid-stride loops: enough blocks to fill any current GPU several times over,
// few enough that each thread does a handful of items on large arrays.
constexpr int64_t kMaxBlocks = 4096;

inline unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace jaxops::cuda::elementwise
