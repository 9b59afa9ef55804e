#include "cuda/softmax.h"

#include <algorithm>
#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_reduce;

constexpr int kMaxRowThreads = 512;
// Rows beyond the grid are taken by the same blocks in turn.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename T>
__device__ __forceinline__ int64_t row_offset(const BroadcastOperand<T>& operand, int64_t row) {
  int64_t offset = 0;
  for (int i = operand.axes - 1; i >= 0; --i) {
    offset += (row % operand.row_sizes[i]) * operand.row_strides[i];
    row /= operand.row_sizes[i];
  }
  return offset;
}

__device__ __forceinline__ int64_t visible_prefix(int64_t row, int64_t cols, CausalLimit causal) {
  if (causal.queries == 0) return cols;
  const int64_t limit = row % causal.queries + causal.query_offset + 1;
  return limit < 0 ? 0 : (limit > cols ? cols : limit);
}

// x + bias, or -inf where the mask hides the column.
template <typename T>
struct MaskedRow {
  const T* x;
  const uint8_t* where;
  int64_t where_stride;
  const T* bias;
  int64_t bias_stride;

  __device__ __forceinline__ float operator()(int64_t c) const {
    float v = to_float(x[c]);
    if (bias != nullptr) v += to_float(bias[c * bias_stride]);
    if (where != nullptr && !where[c * where_stride]) v = -CUDART_INF_F;
    return v;
  }
};

template <typename T>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_fwd_kernel(const T* __restrict__ x, BroadcastOperand<uint8_t> where,
                       BroadcastOperand<T> bias, T* __restrict__ y, int64_t rows, int64_t cols,
                       bool log_output, CausalLimit causal) {
  const float invisible = log_output ? -CUDART_INF_F : 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t n = visible_prefix(row, cols, causal);
    const MaskedRow<T> z{x + row * cols,
                         where.data ? where.data + row_offset(where, row) : nullptr,
                         where.col_stride,
                         bias.data ? bias.data + row_offset(bias, row) : nullptr,
                         bias.col_stride};
    MaxSum stats = MaxSum::empty();
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) stats.add(z(c));
    stats = block_max_sum(stats);
    T* out = y + row * cols;
    if (stats.max == -CUDART_INF_F) {
      // No visible column; a NaN among the columns still poisons the row.
      const float fill = stats.sum != stats.sum ? CUDART_NAN_F : invisible;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = from_float<T>(fill);
      continue;
    }
    const float inv_sum = 1.f / stats.sum;
    const float lse = stats.max + logf(stats.sum);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float v = invisible;
      if (c < n) v = log_output ? z(c) - lse : expf(z(c) - stats.max) * inv_sum;
      out[c] = from_float<T>(v);
    }
  }
}

template <typename T, bool kLog>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                       int64_t rows, int64_t cols) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* g = dy + row * cols;
    const T* p = y + row * cols;
    float partial = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float pc = to_float(p[c]);
      if constexpr (kLog) {
        if (pc > -CUDART_INF_F) partial += to_float(g[c]);
      } else {
        partial += pc * to_float(g[c]);
      }
    }
    const float total = block_sum(partial);
    T* out = dx + row * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float pc = to_float(p[c]);
      const float gc = to_float(g[c]);
      float v;
      if constexpr (kLog) {
        v = pc > -CUDART_INF_F ? gc - expf(pc) * total : 0.f;
      } else {
        v = pc * (gc - total);
      }
      out[c] = from_float<T>(v);
    }
  }
}

dim3 grid_for(int64_t rows) { return dim3(static_cast<unsigned>(std::min(rows, kMaxBlocks))); }

dim3 block_for(int64_t cols) { return dim3(threads_for_row(cols, kMaxRowThreads)); }

template <typename T>
bool valid_broadcast(const BroadcastOperand<T>& operand) {
  if (operand.data == nullptr) return true;
  if (operand.axes < 0 || operand.axes > kMaxBroadcastAxes) return false;
  for (int i = 0; i < operand.axes; ++i) {
    if (operand.row_sizes[i] < 1) return false;
  }
  return true;
}

}  // namespace

template <typename T>
cudaError_t softmax_fwd(cudaStream_t stream, const T* x, BroadcastOperand<uint8_t> where,
                        BroadcastOperand<T> bias, T* y, SoftmaxShape shape, SoftmaxOutput output,
                        CausalLimit causal) {
  if (shape.cols < 1 || shape.rows < 0 || causal.queries < 0 || !valid_broadcast(where) ||
      !valid_broadcast(bias)) {
    return cudaErrorInvalidValue;
  }
  if (shape.rows == 0) return cudaSuccess;
  return launch_kernel(softmax_fwd_kernel<T>, grid_for(shape.rows), block_for(shape.cols), stream,
                       x, where, bias, y, shape.rows, shape.cols,
                       output == SoftmaxOutput::kLogProbabilities, causal);
}

template <typename T>
cudaError_t softmax_bwd(cudaStream_t stream, const T* dy, const T* y, T* dx, SoftmaxShape shape) {
  if (shape.cols < 1 || shape.rows < 0) return cudaErrorInvalidValue;
  if (shape.rows == 0) return cudaSuccess;
  return launch_kernel(softmax_bwd_kernel<T, false>, grid_for(shape.rows), block_for(shape.cols),
                       stream, dy, y, dx, shape.rows, shape.cols);
}

template <typename T>
cudaError_t log_softmax_bwd(cudaStream_t stream, const T* dy, const T* y, T* dx,
                            SoftmaxShape shape) {
  if (shape.cols < 1 || shape.rows < 0) return cudaErrorInvalidValue;
  if (shape.rows == 0) return cudaSuccess;
  return launch_kernel(softmax_bwd_kernel<T, true>, grid_for(shape.rows), block_for(shape.cols),
                       stream, dy, y, dx, shape.rows, shape.cols);
}

#define JAXOPS_CUDA_SOFTMAX_INSTANTIATE(T)                                                 \
  template cudaError_t softmax_fwd<T>(cudaStream_t, const T*, BroadcastOperand<uint8_t>,   \
                                      BroadcastOperand<T>, T*, SoftmaxShape, SoftmaxOutput, \
                                      CausalLimit);                                         \
  template cudaError_t softmax_bwd<T>(cudaStream_t, const T*, const T*, T*, SoftmaxShape); \
  template cudaError_t log_softmax_bwd<T>(cudaStream_t, const T*, const T*, T*, SoftmaxShape);

JAXOPS_CUDA_SOFTMAX_INSTANTIATE(float)
JAXOPS_CUDA_SOFTMAX_INSTANTIATE(__half)
JAXOPS_CUDA_SOFTMAX_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
