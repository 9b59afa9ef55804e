// The parameters of softmax, log_softmax and causal_softmax, one set for the CPU
// kernels (cpu/softmax.h), the CUDA kernels (cuda/softmax.h) and the FFI
// handlers that fill them (xla_ffi/softmax_common.h).
#pragma once

#include <cstdint>

#include "params/host_device.h"

namespace jaxops::params {

// Rows = product of the leading axes, cols = the last axis, row-major.
struct SoftmaxShape {
  int64_t rows;
  int64_t cols;
};

// Leading-axis groups a broadcast mask or bias can have after merging (the
// handler merges axes that broadcast alike, so the usual masks need one or
// two); the handlers reject more. Fixed so that the operand is a plain value
// a CUDA kernel takes as a launch argument.
constexpr int kMaxBroadcastAxes = 8;

// An optional operand broadcast against x (a boolean mask or an additive bias).
// Its element for (row, col) of x is data[row_offset(row) + col * col_stride],
// with x's leading axes (merged where the operand broadcasts alike) given by
// row_sizes/row_strides, outermost first.
template <typename T>
struct BroadcastOperand {
  const T* data = nullptr;  // nullptr: absent
  int axes = 0;             // entries used of row_sizes and row_strides
  int64_t row_sizes[kMaxBroadcastAxes] = {};
  int64_t row_strides[kMaxBroadcastAxes] = {};  // 0: broadcast along that group
  int64_t col_stride = 1;                       // 0 when the operand's last axis has size 1

  JAXOPS_HOST_DEVICE int64_t row_offset(int64_t row) const {
    int64_t offset = 0;
    for (int i = axes - 1; i >= 0; --i) {
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

// Per row, the float32 statistics the forward saves for the derivatives:
// stats[kStatsPerRow * row + 0] = m, the maximum of z = x + bias over the row's
// visible columns, and [... + 1] = 1 / sum(exp(z - m)) over them, so that
// p = exp(z - m) * that is the forward's float32 probability at a visible
// column. (In a row without a visible column: m = -inf, and 0, or NaN when the
// row holds a NaN; no derivative reads them there.)
constexpr int kStatsPerRow = 2;

// What the backward and tangent kernels read instead of the rounded output:
// the forward's input (x, and its mask and bias as the forward's handler
// passed them) and its row statistics. The kernels recompute p in float32 from
// them, and know a -inf column (p = 0, no gradient) even in a NaN row.
template <typename T>
struct SoftmaxInput {
  const T* x = nullptr;
  BroadcastOperand<uint8_t> where;  // absent: every column allowed
  BroadcastOperand<T> bias;         // absent: 0
  const float* stats = nullptr;     // kStatsPerRow floats a row
};

}  // namespace jaxops::params
