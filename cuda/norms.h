// CUDA kernels for layer_norm, rms_norm and add_rms_norm. No XLA, no Python.
//
// Same math as cpu/norms.h: rows = product of the leading dims, cols = last dim,
// row-major contiguous; T is float, __half or __nv_bfloat16; statistics and
// accumulation in f32; mean/rstd are f32 [rows]. weight/bias may be nullptr
// (identity scale / zero shift), dweight/dbias are nullptr when absent.
//
// Backward: rows are split into `groups` equal contiguous groups (groups > 1 comes
// from vmap over per-example weights) and each group into `parts_per_group`
// contiguous parts. Part t = g * parts_per_group + p writes its f32 column sums to
// workspace[t][k][:] (k = 0: dweight, k = 1: dbias), then a second kernel adds the
// parts of each group in order: deterministic, no atomics.
//
// Every function launches on `stream` and returns the launch's cudaError_t
// (cudaErrorInvalidValue for sizes it cannot handle).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace jaxops::cuda {

// y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(biased var + epsilon).
template <typename T>
cudaError_t layer_norm_fwd(cudaStream_t stream, const T* x, const T* weight,
                           const T* bias, T* y, float* mean, float* rstd,
                           int64_t rows, int64_t cols, float epsilon);

// dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd with g = dy * weight;
// dweight[g] = sum of dy * xhat, dbias[g] = sum of dy over the rows of group g.
// workspace: f32 [groups * parts_per_group, 2, cols].
template <typename T>
cudaError_t layer_norm_bwd(cudaStream_t stream, const T* dy, const T* x,
                           const T* weight, const float* mean, const float* rstd,
                           T* dx, T* dweight, T* dbias, float* workspace,
                           int64_t rows, int64_t cols, int64_t groups,
                           int64_t parts_per_group);

// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + epsilon).
template <typename T>
cudaError_t rms_norm_fwd(cudaStream_t stream, const T* x, const T* weight, T* y,
                         float* rstd, int64_t rows, int64_t cols, float epsilon);

// dx = (g - xhat * mean(g * xhat)) * rstd + dresidual with g = dy * weight,
// xhat = x * rstd; dresidual may be nullptr. workspace: f32 [groups * parts, 1, cols].
template <typename T>
cudaError_t rms_norm_bwd(cudaStream_t stream, const T* dy, const T* x,
                         const T* weight, const float* rstd, const T* dresidual,
                         T* dx, T* dweight, float* workspace, int64_t rows,
                         int64_t cols, int64_t groups, int64_t parts_per_group);

// h = x + residual rounded to T, y = rms_norm(h) * weight. h may alias x or
// residual (each element is read before it is written, by the same thread).
template <typename T>
cudaError_t add_rms_norm_fwd(cudaStream_t stream, const T* x, const T* residual,
                             const T* weight, T* y, T* h, float* rstd,
                             int64_t rows, int64_t cols, float epsilon);

#define JAXOPS_CUDA_NORMS_DECLARE(T)                                            \
  extern template cudaError_t layer_norm_fwd<T>(                                \
      cudaStream_t, const T*, const T*, const T*, T*, float*, float*, int64_t,  \
      int64_t, float);                                                          \
  extern template cudaError_t layer_norm_bwd<T>(                                \
      cudaStream_t, const T*, const T*, const T*, const float*, const float*,   \
      T*, T*, T*, float*, int64_t, int64_t, int64_t, int64_t);                  \
  extern template cudaError_t rms_norm_fwd<T>(cudaStream_t, const T*,           \
                                              const T*, T*, float*, int64_t,    \
                                              int64_t, float);                  \
  extern template cudaError_t rms_norm_bwd<T>(                                  \
      cudaStream_t, const T*, const T*, const T*, const float*, const T*, T*,   \
      T*, float*, int64_t, int64_t, int64_t, int64_t);                          \
  extern template cudaError_t add_rms_norm_fwd<T>(                              \
      cudaStream_t, const T*, const T*, const T*, T*, T*, float*, int64_t,      \
      int64_t, float);

JAXOPS_CUDA_NORMS_DECLARE(float)
JAXOPS_CUDA_NORMS_DECLARE(__half)
JAXOPS_CUDA_NORMS_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_NORMS_DECLARE

}  // namespace jaxops::cuda
