// CUDA kernels for cross-entropy: forward, backward and forward-mode derivative
// (JVP). No XLA, no Python.
//
// The same operations, arguments and math as cpu/cross_entropy.h (keep the two
// in step), plus the stream to launch on: logits [rows, vocab] row-major, T is
// float, __half or __nv_bfloat16, Label is int32_t or int64_t, float32
// arithmetic. A row labelled ignore_index has loss 0 and gradient 0, any other
// label outside [0, vocab) loss NaN and gradient 0; neither row is read, and
// both get lse 0. A warp or a block handles a row, streamed in chunks
// (cuda/row_tile.cuh); vocabularies of more than 2^30 are refused.
//
// Every function launches on `stream` and returns cudaGetLastError() after its
// launch (cudaErrorInvalidValue for shapes it cannot handle).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/cross_entropy.h"

namespace jaxops::cuda {

using ::jaxops::params::CrossEntropyOptions;
using ::jaxops::params::CrossEntropyShape;

// loss and lse per row (float32).
template <typename T, typename Label>
cudaError_t cross_entropy_fwd(cudaStream_t stream, const T* logits, const Label* labels,
                              float* loss, float* lse, CrossEntropyShape shape,
                              CrossEntropyOptions options);

// dlogits = dloss[row] * dloss/dlogits from the forward's lse. dlogits may be
// logits (in place).
template <typename T, typename Label>
cudaError_t cross_entropy_bwd(cudaStream_t stream, const T* logits, const Label* labels,
                              const float* lse, const float* dloss, T* dlogits,
                              CrossEntropyShape shape, CrossEntropyOptions options);

// The loss and its gradient for a unit cotangent on every row, in one launch.
// dlogits may be logits (in place).
template <typename T, typename Label>
cudaError_t cross_entropy_fwd_grad(cudaStream_t stream, const T* logits, const Label* labels,
                                   float* loss, T* dlogits, CrossEntropyShape shape,
                                   CrossEntropyOptions options);

// The loss's tangent for the logits' tangent dlogits, from the forward's lse:
// dloss = (1 + 2 z_loss lse) sum(p * dlogits) - eps mean(dlogits)
//         - (1 - eps) dlogits[label]; 0 on the rows the forward does not compute.
template <typename T, typename Label>
cudaError_t cross_entropy_jvp(cudaStream_t stream, const T* logits, const Label* labels,
                              const float* lse, const T* dlogits, float* dloss,
                              CrossEntropyShape shape, CrossEntropyOptions options);

#define JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(T, Label)                                           \
  extern template cudaError_t cross_entropy_fwd<T, Label>(cudaStream_t, const T*, const Label*, \
                                                          float*, float*, CrossEntropyShape,    \
                                                          CrossEntropyOptions);                 \
  extern template cudaError_t cross_entropy_bwd<T, Label>(                                    \
      cudaStream_t, const T*, const Label*, const float*, const float*, T*, CrossEntropyShape, \
      CrossEntropyOptions);                                                                   \
  extern template cudaError_t cross_entropy_fwd_grad<T, Label>(                               \
      cudaStream_t, const T*, const Label*, float*, T*, CrossEntropyShape, CrossEntropyOptions); \
  extern template cudaError_t cross_entropy_jvp<T, Label>(                                    \
      cudaStream_t, const T*, const Label*, const float*, const T*, float*, CrossEntropyShape, \
      CrossEntropyOptions);

JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(float, int32_t)
JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(float, int64_t)
JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(__half, int32_t)
JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(__half, int64_t)
JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(__nv_bfloat16, int32_t)
JAXOPS_CUDA_CROSS_ENTROPY_DECLARE(__nv_bfloat16, int64_t)

#undef JAXOPS_CUDA_CROSS_ENTROPY_DECLARE

}  // namespace jaxops::cuda
