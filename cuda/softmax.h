// CUDA kernels for softmax, log_softmax and causal_softmax: forward, backward
// and forward-mode derivative (JVP). No XLA, no Python.
//
// The same operations, arguments and math as cpu/softmax.h (keep the two in
// step), plus the stream to launch on: rows = product of the leading axes, cols
// = the last axis, row-major; T is float, __half or __nv_bfloat16; float32
// arithmetic. Invisible columns (masked out, beyond the causal limit, or -inf
// after the bias) give 0 / -inf and no gradient; a row with no visible column
// is all 0 / all -inf. A warp or a block handles a row, held in registers
// (cuda/row_tile.cuh); rows of more than 2^30 columns are refused.
//
// Every function launches on `stream` and returns cudaGetLastError() after its
// launch (cudaErrorInvalidValue for layouts it cannot handle).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/softmax.h"

namespace jaxops::cuda {

// The parameters (params/softmax.h), shared with the CPU kernels and the handlers.
using ::jaxops::params::BroadcastOperand;
using ::jaxops::params::CausalLimit;
using ::jaxops::params::kMaxBroadcastAxes;
using ::jaxops::params::kStatsPerRow;
using ::jaxops::params::SoftmaxInput;
using ::jaxops::params::SoftmaxOutput;
using ::jaxops::params::SoftmaxShape;

// `where` holds 0/1 bytes (XLA's PRED). Also writes each row's statistics for
// the derivatives (params/softmax.h) to `stats`, kStatsPerRow floats a row.
template <typename T>
cudaError_t softmax_fwd(cudaStream_t stream, const T* x, BroadcastOperand<uint8_t> where,
                        BroadcastOperand<T> bias, T* y, float* stats, SoftmaxShape shape,
                        SoftmaxOutput output, CausalLimit causal);

// The derivatives recompute the forward's float32 probabilities p from its
// input and statistics (`input`), never from the rounded y: p is 0 exactly at
// an invisible column (also in a NaN row), which gets 0. With a causal limit
// (causal.queries == 0: none) input has no mask or bias.

// dx = p * (dy - sum(p * dy)) over the columns where p != 0; 0 elsewhere.
template <typename T>
cudaError_t softmax_bwd(cudaStream_t stream, const T* dy, SoftmaxInput<T> input, T* dx,
                        SoftmaxShape shape, CausalLimit causal);

// dx = dy - p * sum(dy) over the visible columns; 0 elsewhere.
template <typename T>
cudaError_t log_softmax_bwd(cudaStream_t stream, const T* dy, SoftmaxInput<T> input, T* dx,
                            SoftmaxShape shape);

// The tangent of softmax's y from the input's tangent t = dx + dbias (dx
// nullable, dbias broadcast as the forward's bias; absent terms are 0):
// dy = p * (t - sum(p * t)) over the columns where p != 0, 0 where p == 0.
template <typename T>
cudaError_t softmax_jvp(cudaStream_t stream, SoftmaxInput<T> input, const T* dx,
                        BroadcastOperand<T> dbias, T* dy, SoftmaxShape shape, CausalLimit causal);

// The tangent of log_softmax's y (t as for softmax_jvp): dy = t - sum(p * t)
// over the visible columns, 0 elsewhere.
template <typename T>
cudaError_t log_softmax_jvp(cudaStream_t stream, SoftmaxInput<T> input, const T* dx,
                            BroadcastOperand<T> dbias, T* dy, SoftmaxShape shape);

#define JAXOPS_CUDA_SOFTMAX_DECLARE(T)                                                       \
  extern template cudaError_t softmax_fwd<T>(cudaStream_t, const T*,                         \
                                             BroadcastOperand<uint8_t>, BroadcastOperand<T>,  \
                                             T*, float*, SoftmaxShape, SoftmaxOutput,         \
                                             CausalLimit);                                    \
  extern template cudaError_t softmax_bwd<T>(cudaStream_t, const T*, SoftmaxInput<T>, T*,    \
                                             SoftmaxShape, CausalLimit);                      \
  extern template cudaError_t log_softmax_bwd<T>(cudaStream_t, const T*, SoftmaxInput<T>,    \
                                                 T*, SoftmaxShape);                           \
  extern template cudaError_t softmax_jvp<T>(cudaStream_t, SoftmaxInput<T>, const T*,        \
                                             BroadcastOperand<T>, T*, SoftmaxShape,           \
                                             CausalLimit);                                    \
  extern template cudaError_t log_softmax_jvp<T>(cudaStream_t, SoftmaxInput<T>, const T*,    \
                                                 BroadcastOperand<T>, T*, SoftmaxShape);

JAXOPS_CUDA_SOFTMAX_DECLARE(float)
JAXOPS_CUDA_SOFTMAX_DECLARE(__half)
JAXOPS_CUDA_SOFTMAX_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_SOFTMAX_DECLARE

}  // namespace jaxops::cuda
