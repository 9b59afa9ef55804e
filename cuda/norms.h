// CUDA kernels for layer_norm, rms_norm and add_rms_norm: forward, backward and
// forward-mode derivative (JVP). No XLA, no Python.
//
// The same operations, arguments and math as cpu/norms.h (keep the two in step),
// plus the stream to launch on: rows = product of the leading axes, cols = the
// last axis, row-major; T is float, __half or __nv_bfloat16; statistics and
// accumulation in float32. `weight` / `bias` may be nullptr (identity scale /
// zero shift); so may `dweight` / `dbias`, and then those sums are not computed.
// In the JVP kernels the tangents dx / dweight / dbias may be nullptr: zero.
//
// Weight gradients: the rows are split into `groups` equal contiguous groups and
// each group into `parts` contiguous pieces. Block t = g * parts + p reduces its
// piece into workspace[t] ([groups * parts, sums, cols] float32), then a second
// kernel adds the pieces of each group in order: deterministic, no atomics. The
// pieces are the backward's parallelism: a few per SM.
//
// Every function launches on `stream` and returns cudaGetLastError() after its
// launches (cudaErrorInvalidValue for sizes it cannot handle).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/norms.h"

namespace jaxops::cuda {

using ::jaxops::params::NormShape;
using ::jaxops::params::WeightGradLayout;

// y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(biased var + epsilon).
template <typename T>
cudaError_t layer_norm_fwd(cudaStream_t stream, const T* x, const T* weight, const T* bias, T* y,
                           float* mean, float* rstd, NormShape shape, float epsilon);

// dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd with g = dy * weight;
// dweight[g] = sum of dy * xhat, dbias[g] = sum of dy over the rows of group g.
// workspace: [groups * parts, 2, cols]. dx must not alias dy or x.
template <typename T>
cudaError_t layer_norm_bwd(cudaStream_t stream, const T* dy, const T* x, const T* weight,
                           const float* mean, const float* rstd, T* dx, T* dweight, T* dbias,
                           float* workspace, NormShape shape, WeightGradLayout layout);

// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + epsilon).
template <typename T>
cudaError_t rms_norm_fwd(cudaStream_t stream, const T* x, const T* weight, T* y, float* rstd,
                         NormShape shape, float epsilon);

// dx = (g - xhat * mean(g * xhat)) * rstd + dresidual with g = dy * weight,
// xhat = x * rstd; `dresidual` (nullable) is a gradient that reaches x by another
// path (add_rms_norm's backward is rms_norm_bwd on h with dresidual = the
// cotangent of h) and may alias dx. workspace: [groups * parts, 1, cols].
template <typename T>
cudaError_t rms_norm_bwd(cudaStream_t stream, const T* dy, const T* x, const T* weight,
                         const float* rstd, const T* dresidual, T* dx, T* dweight,
                         float* workspace, NormShape shape, WeightGradLayout layout);

// h = x + residual (rounded to T, so the norm sees exactly the h it returns),
// y = rms_norm(h) * weight. h may alias x or residual.
template <typename T>
cudaError_t add_rms_norm_fwd(cudaStream_t stream, const T* x, const T* residual, const T* weight,
                             T* y, T* h, float* rstd, NormShape shape, float epsilon);

// The tangent of layer_norm's y from the forward's mean and rstd:
// dy = dxhat * weight + xhat * dweight + dbias with xhat = (x - mean) * rstd and
// dxhat = rstd * (dx - mean(dx) - xhat * mean(xhat * dx)).
template <typename T>
cudaError_t layer_norm_jvp(cudaStream_t stream, const T* x, const T* weight, const float* mean,
                           const float* rstd, const T* dx, const T* dweight, const T* dbias,
                           T* dy, NormShape shape);

// The tangent of rms_norm's y from the forward's rstd: dy = dxhat * weight +
// xhat * dweight with xhat = x * rstd, dxhat = rstd * (dx - xhat * mean(xhat * dx)).
template <typename T>
cudaError_t rms_norm_jvp(cudaStream_t stream, const T* x, const T* weight, const float* rstd,
                         const T* dx, const T* dweight, T* dy, NormShape shape);

#define JAXOPS_CUDA_NORMS_DECLARE(T)                                                             \
  extern template cudaError_t layer_norm_fwd<T>(cudaStream_t, const T*, const T*, const T*, T*, \
                                                float*, float*, NormShape, float);               \
  extern template cudaError_t layer_norm_bwd<T>(cudaStream_t, const T*, const T*, const T*,     \
                                                const float*, const float*, T*, T*, T*, float*,  \
                                                NormShape, WeightGradLayout);                    \
  extern template cudaError_t rms_norm_fwd<T>(cudaStream_t, const T*, const T*, T*, float*,     \
                                              NormShape, float);                                 \
  extern template cudaError_t rms_norm_bwd<T>(cudaStream_t, const T*, const T*, const T*,       \
                                              const float*, const T*, T*, T*, float*, NormShape, \
                                              WeightGradLayout);                                 \
  extern template cudaError_t add_rms_norm_fwd<T>(cudaStream_t, const T*, const T*, const T*,   \
                                                  T*, T*, float*, NormShape, float);             \
  extern template cudaError_t layer_norm_jvp<T>(cudaStream_t, const T*, const T*, const float*, \
                                                const float*, const T*, const T*, const T*, T*,  \
                                                NormShape);                                      \
  extern template cudaError_t rms_norm_jvp<T>(cudaStream_t, const T*, const T*, const float*,   \
                                              const T*, const T*, T*, NormShape);

JAXOPS_CUDA_NORMS_DECLARE(float)
JAXOPS_CUDA_NORMS_DECLARE(__half)
JAXOPS_CUDA_NORMS_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_NORMS_DECLARE

}  // namespace jaxops::cuda
