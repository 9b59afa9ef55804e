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
// gradient is 0. The derivatives compute from x and the forward's float32 row
// statistics, never from y rounded to T.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params/softmax.h"

namespace jaxops::cpu {

// The parameters (params/softmax.h), shared with the CUDA kernels and the handlers.
using ::jaxops::params::BroadcastOperand;
using ::jaxops::params::CausalLimit;
using ::jaxops::params::kStatsPerRow;
using ::jaxops::params::SoftmaxInput;
using ::jaxops::params::SoftmaxOutput;
using ::jaxops::params::SoftmaxShape;

// y = softmax(x + bias) or log_softmax(x + bias) over the visible columns, and
// each row's statistics for the derivatives (params/softmax.h) in `stats`
// (kStatsPerRow floats a row). `where` holds 0/1 bytes (XLA's PRED).
template <typename T>
void softmax_fwd(const T* x, const BroadcastOperand<uint8_t>& where,
                 const BroadcastOperand<T>& bias, T* y, float* stats, SoftmaxShape shape,
                 SoftmaxOutput output, CausalLimit causal);

// The derivatives take the forward's input and statistics (`input`) and
// recompute its float32 probabilities p = exp(z - m) / sum: p is 0 exactly at
// an invisible column (masked, -inf after the bias, or past the causal limit),
// also in a NaN row, and such a column gets 0. With a causal limit
// (causal_softmax's; queries == 0: none) input has no mask or bias.

// dx = p * (dy - sum(p * dy)) over the columns where p != 0; 0 elsewhere.
template <typename T>
void softmax_bwd(const T* dy, const SoftmaxInput<T>& input, T* dx, SoftmaxShape shape,
                 CausalLimit causal);

// log_softmax's: dx = dy - p * sum(dy) over the visible columns; 0 elsewhere.
template <typename T>
void log_softmax_bwd(const T* dy, const SoftmaxInput<T>& input, T* dx, SoftmaxShape shape);

// The tangent of softmax's y, from the tangent t = dx + dbias of the forward's
// input (dx nullable, dbias broadcast as the forward's bias; absent terms are
// 0): dy = p * (t - sum(p * t)) over the columns where p != 0, and 0 where
// p == 0 (invisible columns, whose t may be non-finite, take no part).
template <typename T>
void softmax_jvp(const SoftmaxInput<T>& input, const T* dx, const BroadcastOperand<T>& dbias,
                 T* dy, SoftmaxShape shape, CausalLimit causal);

// The tangent of log_softmax's y (t as for softmax_jvp): dy = t - sum(p * t)
// over the visible columns, and 0 elsewhere.
template <typename T>
void log_softmax_jvp(const SoftmaxInput<T>& input, const T* dx, const BroadcastOperand<T>& dbias,
                     T* dy, SoftmaxShape shape);

}  // namespace jaxops::cpu
