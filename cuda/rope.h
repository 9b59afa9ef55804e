// CUDA kernel for rotary position embedding. No XLA, no Python.
//
// The same operation, arguments and math as cpu/rope.h (keep the two in step),
// plus the stream to launch on: x [batch, seq, heads, head_dim], positions int32
// [position_rows (1 or batch), seq], T is float, __half or __nv_bfloat16.
// Frequencies are float32(theta^(-2i / rotary_dim)) from double precision, the
// angle float32(position) * frequency, and its sin/cos are taken in double and
// rounded, as on the CPU (the same argument reduction: exact for |angle| < 5e7).
// The cos/sin table goes to `workspace`
// (position_rows * seq * rotary_dim floats). y must not alias x.
// Returns cudaGetLastError() after the launches.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/rope.h"

namespace jaxops::cuda {

using ::jaxops::params::RopeShape;

template <typename T>
cudaError_t rope(cudaStream_t stream, const T* x, const int32_t* positions, T* y,
                 float* workspace, RopeShape shape, double theta, bool interleaved, bool inverse);

#define JAXOPS_CUDA_ROPE_DECLARE(T)                                                          \
  extern template cudaError_t rope<T>(cudaStream_t, const T*, const int32_t*, T*, float*,    \
                                      RopeShape, double, bool, bool);

JAXOPS_CUDA_ROPE_DECLARE(float)
JAXOPS_CUDA_ROPE_DECLARE(__half)
JAXOPS_CUDA_ROPE_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_ROPE_DECLARE

}  // namespace jaxops::cuda
