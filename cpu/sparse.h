// The 2:4 structured-sparse linear layer (packed layout: params/sparse.h).
// x [rows, in], y [rows, out] row-major; T is float, bfloat16 or float16;
// every product accumulates in float32.
#pragma once

#include <cstdint>

#include "params/sparse.h"

namespace jaxops::cpu {

using ::jaxops::params::SparseLinearShape;

// y = x W^T (+ bias, when bias is not null).
template <typename T>
void sparse_linear_fwd(const T* x, const T* values, const uint8_t* metadata, const T* bias, T* y,
                       SparseLinearShape shape);

// dx = dy W: dy [rows, out] -> dx [rows, in] (zero at the dropped positions' terms).
template <typename T>
void sparse_linear_dx(const T* dy, const T* values, const uint8_t* metadata, T* dx,
                      SparseLinearShape shape);

// dvalues [out, in / 2]: (dy^T x) sampled at the kept positions only; the dense
// [out, in] product is never formed.
template <typename T>
void sparse_linear_dvalues(const T* dy, const T* x, const uint8_t* metadata, T* dvalues,
                           SparseLinearShape shape);

}  // namespace jaxops::cpu
