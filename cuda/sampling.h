// CUDA kernel for sampling one token per row (jaxops.sample). No XLA, no Python.
//
// The same operation, arguments and arithmetic as cpu/sampling.h (keep the two
// in step; the per-row rules are params/sampling.h), plus the stream to launch
// on: logits [batch, vocab] row-major, T is float, __half or __nv_bfloat16,
// float32 arithmetic. One block handles a row: each filter's boundary is a
// bitwise binary search on the order keys, one block-wide count (top-k) or
// weight sum (top-p) per bit; the draw scans contiguous chunks of the row, one
// per thread, after a scan of the chunks' kept weights. No sort, no scratch
// memory beyond the block's shared reductions; every reduction combines in a
// fixed order, so the token does not depend on thread scheduling.
//
// Returns cudaGetLastError() after the launch (cudaErrorInvalidValue for a
// shape it cannot handle).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/sampling.h"

namespace jaxops::cuda {

using ::jaxops::params::SampleShape;

template <typename T>
cudaError_t sample(cudaStream_t stream, const T* logits, const float* row_floats,
                   const int32_t* top_k, int32_t* tokens, SampleShape shape);

#define JAXOPS_CUDA_SAMPLING_DECLARE(T)                                                    \
  extern template cudaError_t sample<T>(cudaStream_t, const T*, const float*, const int32_t*, \
                                        int32_t*, SampleShape);

JAXOPS_CUDA_SAMPLING_DECLARE(float)
JAXOPS_CUDA_SAMPLING_DECLARE(__half)
JAXOPS_CUDA_SAMPLING_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_SAMPLING_DECLARE

}  // namespace jaxops::cuda
