// Layer norm, RMS norm and add + RMS norm over the last axis, forward,
// backward and forward-mode derivative (JVP). Rows = product of the leading
// axes, cols = the last axis, row-major. T is float, bfloat16 or float16;
// statistics and accumulation are float32.
//
// `weight` / `bias` may be nullptr (identity scale / zero shift); so may
// `dweight` / `dbias`, and then those sums are not computed. In the JVP kernels
// the tangents dx / dweight / dbias may be nullptr too: a zero tangent.
//
// Weight gradients: the rows are split into `groups` equal contiguous groups
// (groups > 1 comes from vmap: one weight gradient per example), and
// dweight/dbias have shape [groups, cols]. Each group is cut into `parts` pieces
// reduced independently into `workspace` and then summed in a fixed order, so the
// result is race-free and identical for any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params/norms.h"

namespace jaxops::cpu {

using ::jaxops::params::NormShape;
using ::jaxops::params::WeightGradLayout;

// Floats of workspace the backward kernels need: [groups * parts, sums, cols].
size_t norm_bwd_workspace_floats(NormShape shape, WeightGradLayout layout, int sums);

template <typename T>
void layer_norm_fwd(const T* x, const T* weight, const T* bias, T* y, float* mean, float* rstd,
                    NormShape shape, float epsilon);

template <typename T>
void layer_norm_bwd(const T* dy, const T* x, const T* weight, const float* mean, const float* rstd,
                    T* dx, T* dweight, T* dbias, float* workspace, NormShape shape,
                    WeightGradLayout layout);

template <typename T>
void rms_norm_fwd(const T* x, const T* weight, T* y, float* rstd, NormShape shape, float epsilon);

// `dresidual` (nullable) is a gradient that reaches x by another path and is
// added to dx: add_rms_norm's backward is rms_norm_bwd on h = x + residual with
// dresidual = the cotangent of h.
template <typename T>
void rms_norm_bwd(const T* dy, const T* x, const T* weight, const float* rstd, const T* dresidual,
                  T* dx, T* dweight, float* workspace, NormShape shape, WeightGradLayout layout);

// h = x + residual (rounded to T, so the norm sees exactly the h it returns),
// y = rms_norm(h) * weight.
template <typename T>
void add_rms_norm_fwd(const T* x, const T* residual, const T* weight, T* y, T* h, float* rstd,
                      NormShape shape, float epsilon);

// The tangent of layer_norm's y, given the forward's mean and rstd:
// xhat = (x - mean) * rstd,
// dxhat = rstd * (dx - mean(dx) - xhat * mean(xhat * dx)),
// dy = dxhat * weight + xhat * dweight + dbias.
template <typename T>
void layer_norm_jvp(const T* x, const T* weight, const float* mean, const float* rstd, const T* dx,
                    const T* dweight, const T* dbias, T* dy, NormShape shape);

// The tangent of rms_norm's y, given the forward's rstd: xhat = x * rstd,
// dxhat = rstd * (dx - xhat * mean(xhat * dx)), dy = dxhat * weight + xhat * dweight.
// add_rms_norm's tangent is this on h with dx = dx + dresidual.
template <typename T>
void rms_norm_jvp(const T* x, const T* weight, const float* rstd, const T* dx, const T* dweight,
                  T* dy, NormShape shape);

}  // namespace jaxops::cpu
