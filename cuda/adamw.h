// CUDA kernel for one fused AdamW step on one parameter leaf. No XLA, no Python.
//
// The same operation, arguments and math as cpu/adamw.h (keep the two in step),
// plus the stream to launch on: T is float, __half or __nv_bfloat16 (params,
// grads, out); M (the first moment) float, __nv_bfloat16 or __half; v is float32;
// `scalars` (layout: params/adamw.h) is a device array, so traced
// hyper-parameters change without a recompile. out may alias params or grads,
// and m_out / v_out may alias m / v. Returns cudaGetLastError() after the launch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/adamw.h"

namespace jaxops::cuda {

using ::jaxops::params::AdamWOptions;

template <typename T, typename M>
cudaError_t adamw(cudaStream_t stream, const T* grads, const T* params, const M* m,
                  const float* v, const float* scalars, T* out, M* m_out, float* v_out,
                  int64_t n, AdamWOptions options);

#define JAXOPS_CUDA_ADAMW_DECLARE(T, M)                                                      \
  extern template cudaError_t adamw<T, M>(cudaStream_t, const T*, const T*, const M*,        \
                                          const float*, const float*, T*, M*, float*,        \
                                          int64_t, AdamWOptions);

JAXOPS_CUDA_ADAMW_DECLARE(float, float)
JAXOPS_CUDA_ADAMW_DECLARE(__half, float)
JAXOPS_CUDA_ADAMW_DECLARE(__nv_bfloat16, float)
JAXOPS_CUDA_ADAMW_DECLARE(float, __nv_bfloat16)
JAXOPS_CUDA_ADAMW_DECLARE(__half, __nv_bfloat16)
JAXOPS_CUDA_ADAMW_DECLARE(__nv_bfloat16, __nv_bfloat16)

#undef JAXOPS_CUDA_ADAMW_DECLARE

}  // namespace jaxops::cuda
