// CUDA kernels for the activations (GELU, SiLU) and the gated ones (SwiGLU,
// GeGLU), forward and backward, on flat arrays of n elements. No XLA, no Python.
//
// The same operations, arguments and math as cpu/activations.h (keep the two in
// step), plus the stream to launch on: T is float, __half or __nv_bfloat16; the
// math is float32 (CUDA's expf and erfcf, accurate to a few ulps) and results
// are rounded to T once. Outputs may alias their same-shaped inputs. Every
// function returns cudaGetLastError() after its launch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/activations.h"

namespace jaxops::cuda {

using ::jaxops::params::Activation;

template <typename T>
cudaError_t activation_fwd(cudaStream_t stream, Activation activation, const T* x, T* y,
                           int64_t n);

template <typename T>
cudaError_t activation_bwd(cudaStream_t stream, Activation activation, const T* dy, const T* x,
                           T* dx, int64_t n);

template <typename T>
cudaError_t gated_activation_fwd(cudaStream_t stream, Activation activation, const T* gate,
                                 const T* up, T* y, int64_t n);

template <typename T>
cudaError_t gated_activation_bwd(cudaStream_t stream, Activation activation, const T* dy,
                                 const T* gate, const T* up, T* dgate, T* dup, int64_t n);

#define JAXOPS_CUDA_ACTIVATIONS_DECLARE(T)                                                      \
  extern template cudaError_t activation_fwd<T>(cudaStream_t, Activation, const T*, T*,         \
                                                int64_t);                                       \
  extern template cudaError_t activation_bwd<T>(cudaStream_t, Activation, const T*, const T*,   \
                                                T*, int64_t);                                   \
  extern template cudaError_t gated_activation_fwd<T>(cudaStream_t, Activation, const T*,       \
                                                      const T*, T*, int64_t);                   \
  extern template cudaError_t gated_activation_bwd<T>(cudaStream_t, Activation, const T*,       \
                                                      const T*, const T*, T*, T*, int64_t);

JAXOPS_CUDA_ACTIVATIONS_DECLARE(float)
JAXOPS_CUDA_ACTIVATIONS_DECLARE(__half)
JAXOPS_CUDA_ACTIVATIONS_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_ACTIVATIONS_DECLARE

}  // namespace jaxops::cuda
