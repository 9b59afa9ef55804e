// CUDA kernel for one fused AdamW step on one parameter leaf. No XLA, no Python.
//
// The same operation, arguments and math as cpu/adamw.h (keep the two in step),
// plus the stream to launch on: T is float, __half or __nv_bfloat16 (params,
// grads, out); m and v are float32; `scalars` = {lr, 1 - b1^t, 1 - b2^t} is a
// device array (the step count is traced). out may alias params or grads, and
// m_out / v_out may alias m / v. Returns cudaGetLastError() after the launch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/adamw.h"

namespace jaxops::cuda {

using ::jaxops::params::AdamWHyperparameters;

template <typename T>
cudaError_t adamw(cudaStream_t stream, const T* grads, const T* params, const float* m,
                  const float* v, const float* scalars, T* out, float* m_out, float* v_out,
                  int64_t n, AdamWHyperparameters hyper, bool apply_updates);

#define JAXOPS_CUDA_ADAMW_DECLARE(T)                                                           \
  extern template cudaError_t adamw<T>(cudaStream_t, const T*, const T*, const float*,         \
                                       const float*, const float*, T*, float*, float*, int64_t, \
                                       AdamWHyperparameters, bool);

JAXOPS_CUDA_ADAMW_DECLARE(float)
JAXOPS_CUDA_ADAMW_DECLARE(__half)
JAXOPS_CUDA_ADAMW_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_ADAMW_DECLARE

}  // namespace jaxops::cuda
