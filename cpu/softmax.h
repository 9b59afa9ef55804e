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
#include <vector>

namespace jaxops::cpu {

struct SoftmaxShape {
  int64_t rows;
  int64_t cols;
};

// An optional operand broadcast against x (a boolean mask or an additive bias).
// Its element for (row, col) of x is data[row_offset(row) + col * col_stride],
// with x's leading axes (merged where the operand broadcasts alike, so the
// usual cases cost a division or two per row) given by row_sizes/row_strides.
template <typename T>
struct BroadcastOperand {
  const T* data = nullptr;  // nullptr: absent
  std::vector<int64_t> row_sizes;    // x's leading axes (merged), outermost first
  std::vector<int64_t> row_strides;  // the operand's stride along each (0: broadcast)
  int64_t col_stride = 1;            // 0 when the operand's last axis has size 1

  int64_t row_offset(int64_t row) const {
    int64_t offset = 0;
    for (size_t i = row_sizes.size(); i-- > 0;) {
      offset += (row % row_sizes[i]) * row_strides[i];
      row /= row_sizes[i];
    }
    return offset;
  }
};

// Causal visibility over the last two axes: row i of each [queries, cols] block
// sees columns j <= i + query_offset. queries == 0 means no causal limit.
struct CausalLimit {
  int64_t queries = 0;
  int64_t query_offset = 0;
};

enum class SoftmaxOutput { kProbabilities, kLogProbabilities };

// y = softmax(x + bias) or log_softmax(x + bias) over the visible columns.
// `where` holds 0/1 bytes (XLA's PRED).
template <typename T>
void softmax_fwd(const T* x, const BroadcastOperand<uint8_t>& where,
                 const BroadcastOperand<T>& bias, T* y, SoftmaxShape shape, SoftmaxOutput output,
                 CausalLimit causal);

// dx = y * (dy - sum(y * dy)), y the softmax output (0 where invisible).
template <typename T>
void softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape);

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
