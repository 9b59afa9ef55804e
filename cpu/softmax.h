// Softmax and log-softmax over the last axis, forward, backward and
// forward-mode derivative (JVP).
// Rows = product of the leading axes, cols = the last axis, row-major; T is
// float, bfloat16 or float16 and all arithmetic is float32.
//
// A column is *visible* in its row when the mask (if any) allows it, the causal
// limit (if any) allows it, and x + bias there is not -inf. Softmax is taken over
// the visible columns only; invisible columns give probability 0 and
// log-probability -inf, and a row with no visible column gives all 0 / all -inf
// (never NaN). Backward passes treat invisible columns as constants: their
// gradient is 0.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params/softmax.h"

namespace jaxops::cpu {

// The parameters (params/softmax.h), shared with the CUDA kernels and the handlers.
using ::jaxops::params::BroadcastOperand;
using ::jaxops::params::CausalLimit;
using ::jaxops::params::SoftmaxOutput;
using ::jaxops::params::SoftmaxShape;

// y = softmax(x + bias) or log_softmax(x + bias) over the visible columns.
// `where` holds 0/1 bytes (XLA's PRED).
template <typename T>
void softmax_fwd(const T* x, const BroadcastOperand<uint8_t>& where,
                 const BroadcastOperand<T>& bias, T* y, SoftmaxShape shape, SoftmaxOutput output,
                 CausalLimit causal);

// dx = y * (dy - sum(y * dy)) over the columns where y != 0 and, with a causal
// limit (causal_softmax's; queries == 0: none), inside the row's visible
// prefix; dx = 0 elsewhere, also in a NaN row.
template <typename T>
void softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape, CausalLimit causal);

// dx = dy - exp(y) * sum(dy) over columns where y > -inf; dx = 0 elsewhere.
template <typename T>
void log_softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape);

// The tangent of softmax's y, from y and the tangent t = dx + dbias of the
// forward's input (dx nullable, dbias broadcast as the forward's bias; absent
// terms are 0): dy = y * (t - sum(y * t)) over the columns where y != 0, and 0
// where y == 0 (masked columns, whose t may be non-finite, take no part).
template <typename T>
void softmax_jvp(const T* y, const T* dx, const BroadcastOperand<T>& dbias, T* dy,
                 SoftmaxShape shape);

// The tangent of log_softmax's y (t as for softmax_jvp): dy = t - sum(exp(y) * t)
// over the columns where y > -inf, and 0 elsewhere.
template <typename T>
void log_softmax_jvp(const T* y, const T* dx, const BroadcastOperand<T>& dbias, T* dy,
                     SoftmaxShape shape);

}  // namespace jaxops::cpu
