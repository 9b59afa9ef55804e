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

__device__ __forceinline__ int64_t visible_prefix(int64_t row, int64_t cols, CausalLimit causal) {
  if (causal.queries == 0) return cols;
  const int64_t limit = row % causal.queries + causal.query_offset + 1;
  return limit < 0 ? 0 : (limit > cols ? cols : limit);
}

// x + bias, or -inf where the mask hides the column; an absent x or bias is 0.
template <typename T>
struct MaskedRow {
  const T* x;
  const uint8_t* where;
  int64_t where_stride;
  const T* bias;
  int64_t bias_stride;

  __device__ __forceinline__ float operator()(int64_t c) const {
    float v = x != nullptr ? to_float(x[c]) : 0.f;
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
                         where.data ? where.data + where.row_offset(row) : nullptr,
                         where.col_stride,
                         bias.data ? bias.data + bias.row_offset(row) : nullptr,
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
      // 0 * inv_sum: a NaN row is NaN in its causally invisible columns too.
      float v = log_output ? invisible : 0.f * inv_sum;
      if (c < n) v = log_output ? z(c) - lse : expf(z(c) - stats.max) * inv_sum;
      out[c] = from_float<T>(v);
    }
  }
}

// The linear maps of a row that the backward (g = the cotangent dy) and the
// JVP (g = the input's tangent dx + dbias) apply: out_c = out(y_c, g_c, s) with
// s the row sum of term(y_c, g_c). Softmax's Jacobian is symmetric, so its VJP
// and JVP are one map; log_softmax's are each other's
// transpose.
// Columns with y = 0 are masked ones (by a mask, or causally hidden), whose
// tangent or cotangent may be non-finite, and whose row sum s is NaN in a
// NaN row: they take no part and get 0, as the references' masked columns
// do (0 * NaN would be NaN). The backward and the JVP are the same map.
struct SoftmaxLinearMap {
  __device__ static float term(float y, float g) { return y != 0.f ? y * g : 0.f; }
  __device__ static float out(float y, float g, float s) { return y != 0.f ? y * (g - s) : 0.f; }
};

struct LogSoftmaxVjp {
  __device__ static float term(float y, float g) { return y != -CUDART_INF_F ? g : 0.f; }
  __device__ static float out(float y, float g, float s) {
    return y != -CUDART_INF_F ? g - expf(y) * s : 0.f;  // NaN y: NaN
  }
};

struct LogSoftmaxJvp {
  __device__ static float term(float y, float g) { return y != -CUDART_INF_F ? expf(y) * g : 0.f; }
  __device__ static float out(float y, float g, float s) { return y != -CUDART_INF_F ? g - s : 0.f; }
};

// out = Map(y, g + g_broadcast), either term of g absent (0); past a row's
// causal prefix (if any) out = 0: in a NaN row y is NaN there, so the guard on y
// cannot hide those columns.
template <typename T, typename Map>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_linear_map_kernel(const T* __restrict__ y, const T* __restrict__ g,
                              BroadcastOperand<T> g_broadcast, T* __restrict__ out, int64_t rows,
                              int64_t cols, CausalLimit causal) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* y_row = y + row * cols;
    const MaskedRow<T> g_row{
        g != nullptr ? g + row * cols : nullptr, nullptr, 0,
        g_broadcast.data ? g_broadcast.data + g_broadcast.row_offset(row) : nullptr,
        g_broadcast.col_stride};
    const int64_t n = visible_prefix(row, cols, causal);
    float partial = 0.f;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      partial += Map::term(to_float(y_row[c]), g_row(c));
    }
    const float s = block_sum(partial);
    T* out_row = out + row * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      out_row[c] = from_float<T>(c < n ? Map::out(to_float(y_row[c]), g_row(c), s) : 0.f);
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

template <typename Map, typename T>
cudaError_t softmax_linear_map(cudaStream_t stream, const T* y, const T* g,
                               BroadcastOperand<T> g_broadcast, T* out, SoftmaxShape shape,
                               CausalLimit causal = {}) {
  if (shape.cols < 1 || shape.rows < 0 || causal.queries < 0 || !valid_broadcast(g_broadcast)) {
    return cudaErrorInvalidValue;
  }
  if (shape.rows == 0) return cudaSuccess;
  return launch_kernel(softmax_linear_map_kernel<T, Map>, grid_for(shape.rows),
                       block_for(shape.cols), stream, y, g, g_broadcast, out, shape.rows,
                       shape.cols, causal);
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
cudaError_t softmax_bwd(cudaStream_t stream, const T* dy, const T* y, T* dx, SoftmaxShape shape,
                        CausalLimit causal) {
  return softmax_linear_map<SoftmaxLinearMap>(stream, y, dy, BroadcastOperand<T>{}, dx, shape,
                                              causal);
}

template <typename T>
cudaError_t log_softmax_bwd(cudaStream_t stream, const T* dy, const T* y, T* dx,
                            SoftmaxShape shape) {
  return softmax_linear_map<LogSoftmaxVjp>(stream, y, dy, BroadcastOperand<T>{}, dx, shape);
}

template <typename T>
cudaError_t softmax_jvp(cudaStream_t stream, const T* y, const T* dx, BroadcastOperand<T> dbias,
                        T* dy, SoftmaxShape shape) {
  return softmax_linear_map<SoftmaxLinearMap>(stream, y, dx, dbias, dy, shape);
}

template <typename T>
cudaError_t log_softmax_jvp(cudaStream_t stream, const T* y, const T* dx,
                            BroadcastOperand<T> dbias, T* dy, SoftmaxShape shape) {
  return softmax_linear_map<LogSoftmaxJvp>(stream, y, dx, dbias, dy, shape);
}

#define JAXOPS_CUDA_SOFTMAX_INSTANTIATE(T)                                                 \
  template cudaError_t softmax_fwd<T>(cudaStream_t, const T*, BroadcastOperand<uint8_t>,   \
                                      BroadcastOperand<T>, T*, SoftmaxShape, SoftmaxOutput, \
                                      CausalLimit);                                         \
  template cudaError_t softmax_bwd<T>(cudaStream_t, const T*, const T*, T*, SoftmaxShape,  \
                                      CausalLimit);                                         \
  template cudaError_t log_softmax_bwd<T>(cudaStream_t, const T*, const T*, T*, SoftmaxShape); \
  template cudaError_t softmax_jvp<T>(cudaStream_t, const T*, const T*, BroadcastOperand<T>, T*, \
                                      SoftmaxShape);                                           \
  template cudaError_t log_softmax_jvp<T>(cudaStream_t, const T*, const T*, BroadcastOperand<T>, \
                                          T*, SoftmaxShape);

JAXOPS_CUDA_SOFTMAX_INSTANTIATE(float)
JAXOPS_CUDA_SOFTMAX_INSTANTIATE(__half)
JAXOPS_CUDA_SOFTMAX_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
