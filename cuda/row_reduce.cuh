// Device helpers of the row-wise kernels (softmax, cross-entropy): conversions
// between the storage types and float32, and reductions over the threads of a
// block that handles one row. Every thread receives the same bits from a
// reduction (butterflies combine the same pairs in every lane, and every thread
// combines the per-warp results in the same order), so per-row values derived
// from them agree across the block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/fast_math.cuh"
#include "cuda/float_convert.cuh"

namespace jaxops::cuda::row_reduce {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kMaxThreads = 1024;
constexpr int kMaxWarps = kMaxThreads / kWarpSize;

// Combines values of the whole block with `op` (commutative). blockDim.x is a
// multiple of 32. `scratch` holds a value per warp and is free again on return.
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V value, Op op, V* scratch) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, value.shuffled(offset));
  }
  if (blockDim.x > kWarpSize) {
    const int warp = threadIdx.x / kWarpSize;
    if (threadIdx.x % kWarpSize == 0) scratch[warp] = value;
    __syncthreads();
    value = scratch[0];
    const int warps = blockDim.x / kWarpSize;
    for (int w = 1; w < warps; ++w) value = op(value, scratch[w]);
    __syncthreads();  // scratch is reused by the next reduction
  }
  return value;
}

struct Sum {
  float sum;
  __device__ __forceinline__ Sum shuffled(int offset) const {
    return {__shfl_xor_sync(kFullWarp, sum, offset)};
  }
};

__device__ __forceinline__ float block_sum(float value) {
  __shared__ Sum scratch[kMaxWarps];
  return block_reduce(Sum{value}, [](Sum a, Sum b) { return Sum{a.sum + b.sum}; }, scratch).sum;
}

// exp(a - b) in three instructions: the difference, its product with log2(e),
// fast_exp2. The difference is taken first so that the error stays relative to
// it: folding b * log2(e) into an FMA would add b's rounding, large for large b.
__device__ __forceinline__ float exp_of_difference(float a, float b) {
  return fast_exp2((a - b) * kLog2e);
}

// A running maximum m and sum s of exp(v - m) over a set of values: the
// online softmax normaliser. -inf values leave it unchanged; a NaN value makes s
// NaN, and NaN then survives every combination.
struct MaxSum {
  float max;
  float sum;

  __device__ __forceinline__ static MaxSum empty() { return {-CUDART_INF_F, 0.f}; }
  __device__ __forceinline__ void add(float v) {
    if (v == -CUDART_INF_F) return;
    if (v > max) {
      sum = sum * expf(max - v) + 1.f;
      max = v;
    } else {
      sum += expf(v - max);
    }
  }
  __device__ __forceinline__ MaxSum shuffled(int offset) const {
    return {__shfl_xor_sync(kFullWarp, max, offset), __shfl_xor_sync(kFullWarp, sum, offset)};
  }
};

// The normaliser of the values a thread holds: their max (NaN ignored) and the
// sum of exp(v - shift), one ex2 per value, shift = the max (or 0 when the max
// is -inf, which would give -inf - -inf = NaN). -inf adds nothing; NaN or +inf
// make the sum NaN. kReplace: v becomes exp(v - shift), which a softmax scales
// by exp(shift - row max) / row sum instead of taking a second ex2.
template <bool kReplace = false, int N>
__device__ __forceinline__ MaxSum max_sum_of(float (&v)[N]) {
  float max = -CUDART_INF_F;
#pragma unroll
  for (int e = 0; e < N; ++e) max = fmaxf(max, v[e]);
  const float shift = max == -CUDART_INF_F ? 0.f : max;
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float term = exp_of_difference(v[e], shift);
    if (kReplace) v[e] = term;
    sum += term;
  }
  return {max, sum};
}

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -CUDART_INF_F) return {m, a.sum + b.sum};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum block_max_sum(MaxSum value) {
  __shared__ MaxSum scratch[kMaxWarps];
  return block_reduce(value, [](MaxSum a, MaxSum b) { return combine(a, b); }, scratch);
}

// Threads for a block that reduces rows of `cols` elements: about 8 elements
// a thread, between one warp and `max_threads`.
inline int threads_for_row(long long cols, int max_threads) {
  int threads = kWarpSize;
  while (threads < max_threads && threads * 8LL < cols) threads *= 2;
  return threads;
}

}  // namespace jaxops::cuda::row_reduce
