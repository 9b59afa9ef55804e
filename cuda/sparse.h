// CUDA kernels of the 2:4 structured-sparse linear layer. No XLA, no Python.
//
// The same operations, arguments and semantics as cpu/sparse.h (keep the two in
// step; packed layout: params/sparse.h), plus the stream to launch on. T is
// float, __half or __nv_bfloat16; every product accumulates in float32. The
// __half/__nv_bfloat16 forward runs on sparse tensor cores (mma.sp, sm_80+;
// cuda/sparse_mma.cuh); the float32 forward and dx, dvalues are SIMT kernels.
// Every function returns cudaGetLastError() after its launches.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/sparse.h"

namespace jaxops::cuda {

using ::jaxops::params::SparseLinearShape;

// y = x W^T (+ bias when not null). float32: one warp per output feature and
// block of 8 rows of x, the lanes striding over the packed row (coalesced reads
// of the values and metadata). __half/__nv_bfloat16: a warp per 16 outputs and
// 32 rows of x, mma.sp over 32 inputs at a time, the metadata converted to the
// hardware's layout (and its unordered or repeated positions canonicalised) as
// the tiles load.
template <typename T>
cudaError_t sparse_linear_fwd(cudaStream_t stream, const T* x, const T* values,
                              const uint8_t* metadata, const T* bias, T* y,
                              SparseLinearShape shape);

// dx = dy W: a thread per (row, group of 4 inputs), summing over out.
template <typename T>
cudaError_t sparse_linear_dx(cudaStream_t stream, const T* dy, const T* values,
                             const uint8_t* metadata, T* dx, SparseLinearShape shape);

// dvalues = (dy^T x) at the kept positions: a thread per packed value, summing over rows.
template <typename T>
cudaError_t sparse_linear_dvalues(cudaStream_t stream, const T* dy, const T* x,
                                  const uint8_t* metadata, T* dvalues, SparseLinearShape shape);

#define JAXOPS_CUDA_SPARSE_DECLARE(T)                                                         \
  extern template cudaError_t sparse_linear_fwd<T>(cudaStream_t, const T*, const T*,           \
                                                   const uint8_t*, const T*, T*,               \
                                                   SparseLinearShape);                         \
  extern template cudaError_t sparse_linear_dx<T>(cudaStream_t, const T*, const T*,            \
                                                  const uint8_t*, T*, SparseLinearShape);      \
  extern template cudaError_t sparse_linear_dvalues<T>(cudaStream_t, const T*, const T*,       \
                                                       const uint8_t*, T*, SparseLinearShape);

JAXOPS_CUDA_SPARSE_DECLARE(float)
JAXOPS_CUDA_SPARSE_DECLARE(__half)
JAXOPS_CUDA_SPARSE_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_SPARSE_DECLARE

}  // namespace jaxops::cuda
