#include "cuda/softmax.h"

#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"
#include "cuda/row_tile.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_tile;
using row_reduce::MaxSum;

// Layout (cuda/row_tile.cuh): a row per warp up to 32 * kElements columns,
// else a row per block of up to kMaxRowThreads threads; longer rows go chunk by
// chunk, the last chunk kept in registers. At most 64 registers a thread
// (kMinBlocksPerSm blocks of kMaxRowThreads), so that an SM holds 1024 threads
// and with them 64 KiB (float32) or 32 KiB (16-bit) of rows in registers:
// docs/cuda.md, "Bandwidth-bound kernels", has the plan.
constexpr int kMaxRowThreads = 512;
constexpr int kMinBlocksPerSm = 2;
constexpr int kWarpRowsPerBlock = 4;
// Column indices are int.
constexpr int64_t kMaxCols = int64_t{1} << 30;

// Elements a thread holds per chunk: the forward 16 of x (4 float32 or 2
// 16-bit packs: 32 16-bit elements would need more than 64 registers), the
// linear maps 8 of y and of g.
constexpr int kFwdElements = 16;
constexpr int kMapElements = 8;

__device__ __forceinline__ int visible_prefix(int64_t row, int cols, CausalLimit causal) {
  if (causal.queries == 0) return cols;
  const int64_t limit = row % causal.queries + causal.query_offset + 1;
  return static_cast<int>(limit < 0 ? 0 : (limit > cols ? cols : limit));
}

// A broadcast operand's elements along one row: at[c] = data[c * col_stride];
// null when the operand is absent.
template <typename T>
struct BroadcastRow {
  const T* data;
  int64_t col_stride;

  __device__ BroadcastRow(const BroadcastOperand<T>& operand, int64_t row)
      : data(operand.data ? operand.data + operand.row_offset(row) : nullptr),
        col_stride(operand.col_stride) {}
  __device__ __forceinline__ const T& at(int c) const { return data[c * col_stride]; }
};

// Loads this thread's part of a chunk of z = x + bias (an absent bias is 0),
// -inf where the mask hides a column and from the visible prefix `n` on (those
// columns are not read); packs entirely past n are not loaded. !kBroadcast:
// neither a mask nor a bias (the common case, without their per-element code).
template <typename T, int kVec, int kCount, bool kBroadcast>
__device__ __forceinline__ void load_visible(const T* x, const BroadcastRow<uint8_t>& where,
                                             const BroadcastRow<T>& bias, int base, int n,
                                             float (&z)[kCount * kVec]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int col = item_col<kVec>(base, i);
    if (col < n) {
      load_pack<T, kVec>(x + col, &z[i * kVec]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) z[i * kVec + j] = 0.f;
    }
  }
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int col = item_col<kVec>(base, i);
    // Whole packs inside the prefix (every pack without a causal limit) skip
    // the per-element test.
    if (!kBroadcast && col + kVec <= n) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float& v = z[i * kVec + j];
      if (col + j < n) {
        if (kBroadcast && bias.data != nullptr) v += to_float(bias.at(col + j));
        if (kBroadcast && where.data != nullptr && !where.at(col + j)) v = -CUDART_INF_F;
      } else {
        v = -CUDART_INF_F;
      }
    }
  }
}

template <typename T, int kVec, bool kBroadcast>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    softmax_fwd_kernel(const T* __restrict__ x, BroadcastOperand<uint8_t> where,
                       BroadcastOperand<T> bias, T* __restrict__ y, float* __restrict__ saved_stats,
                       int64_t rows, int cols, bool log_output, CausalLimit causal) {
  constexpr int kItemCount = kItems<kVec, kFwdElements>;
  constexpr int kElems = kItemCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const int n = visible_prefix(row, cols, causal);
  const T* x_row = x + row * cols;
  T* y_row = y + row * cols;
  const BroadcastRow<uint8_t> where_row(where, row);
  const BroadcastRow<T> bias_row(bias, row);
  const int chunk = blockDim.x * kElems;
  const int chunks = (cols + chunk - 1) / chunk;

  float* row_stats = saved_stats + kStatsPerRow * row;
  // A softmax keeps the last chunk's exp(z - the thread's shift) in z.
  float z[kElems];
  MaxSum stats = MaxSum::empty(), last;
  for (int c = 0; c < chunks; ++c) {
    load_visible<T, kVec, kItemCount, kBroadcast>(x_row, where_row, bias_row, c * chunk, n, z);
    const MaxSum part = c == chunks - 1 && !log_output ? row_reduce::max_sum_of<true>(z)
                                                       : row_reduce::max_sum_of(z);
    stats = row_reduce::combine(stats, part);
    last = part;
  }
  stats = row_reduce::block_max_sum(stats);
  // The derivatives' statistics (params/softmax.h); without a visible column
  // 0, or NaN when the row holds a NaN (0 * sum).
  if (threadIdx.x == 0) {
    row_stats[0] = stats.max;
    row_stats[1] = stats.max == -CUDART_INF_F ? 0.f * stats.sum : 1.f / stats.sum;
  }

  const float invisible = log_output ? -CUDART_INF_F : 0.f;
  // A log_softmax row with a NaN and no finite column takes the log path below,
  // whose lse is NaN: -inf at its -inf columns, NaN elsewhere.
  if (stats.max == -CUDART_INF_F && !(log_output && stats.sum != stats.sum)) {
    // No visible column; a NaN among the columns still poisons the row.
    float fill[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) fill[e] = stats.sum != stats.sum ? CUDART_NAN_F : invisible;
    for (int c = 0; c < chunks; ++c) store_chunk<T, kVec, kItemCount>(y_row, c * chunk, cols, fill);
    return;
  }
  const float inv_sum = 1.f / stats.sum;
  // Past the visible prefix: -inf, or 0 * inv_sum, so that a NaN row is NaN there too.
  const float hidden = log_output ? invisible : 0.f * inv_sum;
  const auto store_out = [&](int c, auto visible_value) {
#pragma unroll
    for (int i = 0; i < kItemCount; ++i) {
      const int col = item_col<kVec>(c * chunk, i);
      float* v = &z[i * kVec];
      if (col + kVec <= n) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = visible_value(v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = col + j < n ? visible_value(v[j]) : hidden;
      }
    }
    store_chunk<T, kVec, kItemCount>(y_row, c * chunk, cols, z);
  };
  // The last chunk is still in registers: write it first, re-read the others.
  if (log_output) {
    const float lse = stats.max + logf(stats.sum);
    // In a NaN row (lse NaN) an invisible column stays -inf, as in the reference.
    const bool nan_row = lse != lse;
    for (int c = chunks - 1; c >= 0; --c) {
      if (c != chunks - 1) {
        load_visible<T, kVec, kItemCount, kBroadcast>(x_row, where_row, bias_row, c * chunk, n, z);
      }
      store_out(c, [&](float v) { return nan_row && v == -CUDART_INF_F ? v : v - lse; });
    }
    return;
  }
  // z holds exp(z - shift) with the last chunk's shift (its max, or 0 when that
  // is -inf and every term is 0: then the scale is 0, or NaN in a NaN row).
  const float scale = last.max == -CUDART_INF_F
                          ? 0.f * inv_sum
                          : row_reduce::exp_of_difference(last.max, stats.max) * inv_sum;
  store_out(chunks - 1, [&](float e) { return e * scale; });
  for (int c = chunks - 2; c >= 0; --c) {
    load_visible<T, kVec, kItemCount, kBroadcast>(x_row, where_row, bias_row, c * chunk, n, z);
    store_out(c, [&](float v) { return row_reduce::exp_of_difference(v, stats.max) * inv_sum; });
  }
}

// The linear maps of a row that the backward (g = the cotangent dy) and the
// JVP (g = the input's tangent dx + dbias) apply, from z (the row's visible
// logits, -inf where invisible) and its statistics m, inv (params/softmax.h),
// which give the forward's float32 probability p = exp(z - m) * inv:
// out_c = out(z_c, g_c, s) with s the row sum of term(z_c, g_c). Softmax's
// Jacobian is symmetric, so its VJP and JVP are one map; log_softmax's are
// each other's transpose. An invisible column takes no part and gets 0: its
// tangent or cotangent may be non-finite, and in a NaN row s is NaN (0 * NaN
// would be NaN). p is 0 there by a select, not computed: z - m is NaN in a
// NaN row.
struct RowStats {
  float m, inv;
  __device__ __forceinline__ float probability(float z) const {
    return z != -CUDART_INF_F ? row_reduce::exp_of_difference(z, m) * inv : 0.f;
  }
};

// p * (g - sum(p * g)) over the columns where p != 0 (a NaN p counts).
struct SoftmaxLinearMap {
  __device__ static float term(float z, float g, RowStats st) {
    const float p = st.probability(z);
    return p != 0.f ? p * g : 0.f;
  }
  __device__ static float out(float z, float g, float s, RowStats st) {
    const float p = st.probability(z);
    return p != 0.f ? p * (g - s) : 0.f;
  }
};

// g - p * sum(g) over the visible columns.
struct LogSoftmaxVjp {
  __device__ static float term(float z, float g, RowStats) {
    return z != -CUDART_INF_F ? g : 0.f;
  }
  __device__ static float out(float z, float g, float s, RowStats st) {
    return z != -CUDART_INF_F ? g - st.probability(z) * s : 0.f;
  }
};

// g - sum(p * g) over the visible columns.
struct LogSoftmaxJvp {
  __device__ static float term(float z, float g, RowStats st) {
    return z != -CUDART_INF_F ? st.probability(z) * g : 0.f;
  }
  __device__ static float out(float z, float g, float s, RowStats) {
    return z != -CUDART_INF_F ? g - s : 0.f;
  }
};

// Loads this thread's part of a chunk of z (load_visible) and of g = g +
// g_broadcast (either absent: 0); packs entirely past the visible prefix n are
// not loaded (z = -inf, g = 0). kLogits: the input has a mask or a bias;
// kBroadcast: g_broadcast is present.
template <typename T, int kVec, int kCount, bool kLogits, bool kBroadcast>
__device__ __forceinline__ void load_map_operands(const T* x, const BroadcastRow<uint8_t>& where,
                                                  const BroadcastRow<T>& bias, const T* g,
                                                  const BroadcastRow<T>& g_broadcast, int base,
                                                  int n, float (&z)[kCount * kVec],
                                                  float (&g_v)[kCount * kVec]) {
  load_visible<T, kVec, kCount, kLogits>(x, where, bias, base, n, z);
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int col = item_col<kVec>(base, i);
    const bool loaded = col < n && g != nullptr;
    if (loaded) load_pack<T, kVec>(g + col, &g_v[i * kVec]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (!loaded) g_v[i * kVec + j] = 0.f;
    }
  }
  if constexpr (kBroadcast) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(base, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (col + j < n) g_v[i * kVec + j] += to_float(g_broadcast.at(col + j));
      }
    }
  }
}

// out = Map(p, g + g_broadcast), p recomputed from `input`, either term of g
// absent (0); past a row's causal prefix (if any) out = 0 (those columns are
// not read).
template <typename T, int kVec, typename Map, bool kLogits, bool kBroadcast>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    softmax_linear_map_kernel(SoftmaxInput<T> input, const T* __restrict__ g,
                              BroadcastOperand<T> g_broadcast, T* __restrict__ out, int64_t rows,
                              int cols, CausalLimit causal) {
  constexpr int kItemCount = kItems<kVec, kMapElements>;
  constexpr int kElems = kItemCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const int n = visible_prefix(row, cols, causal);
  const T* x_row = input.x + row * cols;
  const BroadcastRow<uint8_t> where_row(input.where, row);
  const BroadcastRow<T> bias_row(input.bias, row);
  const T* g_row = g != nullptr ? g + row * cols : nullptr;
  const BroadcastRow<T> g_broadcast_row(g_broadcast, row);
  const RowStats st{input.stats[kStatsPerRow * row], input.stats[kStatsPerRow * row + 1]};
  T* out_row = out + row * cols;
  const int chunk = blockDim.x * kElems;
  const int chunks = (cols + chunk - 1) / chunk;

  float z[kElems], g_v[kElems];
  float sum[1] = {0.f};
  const auto load = [&](int c) {
    load_map_operands<T, kVec, kItemCount, kLogits, kBroadcast>(
        x_row, where_row, bias_row, g_row, g_broadcast_row, c * chunk, n, z, g_v);
  };
  for (int c = 0; c < chunks; ++c) {
    load(c);
#pragma unroll
    for (int e = 0; e < kElems; ++e) sum[0] += Map::term(z[e], g_v[e], st);
  }
  row_sum(sum);
  for (int c = chunks - 1; c >= 0; --c) {
    if (c != chunks - 1) load(c);
#pragma unroll
    for (int i = 0; i < kItemCount; ++i) {
      const int col = item_col<kVec>(c * chunk, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int e = i * kVec + j;
        z[e] = col + j < n ? Map::out(z[e], g_v[e], sum[0], st) : 0.f;
      }
    }
    store_chunk<T, kVec, kItemCount>(out_row, c * chunk, cols, z);
  }
}

template <typename T>
bool valid_broadcast(const BroadcastOperand<T>& operand) {
  if (operand.data == nullptr) return true;
  if (operand.axes < 0 || operand.axes > kMaxBroadcastAxes) return false;
  for (int i = 0; i < operand.axes; ++i) {
    if (operand.row_sizes[i] < 1) return false;
  }
  return true;
}

bool valid_shape(SoftmaxShape shape, CausalLimit causal) {
  return shape.cols >= 1 && shape.cols <= kMaxCols && shape.rows >= 0 && causal.queries >= 0;
}

// Launches over the rows of `shape`: launch_row_groups, the broadcast operands
// read element by element.
template <typename T, int kElements, typename LaunchWith>
cudaError_t launch_rows(SoftmaxShape shape, std::initializer_list<const void*> buffers,
                        LaunchWith&& launch_with) {
  return launch_row_groups<T, kElements>(shape.rows, shape.cols, buffers, kWarpRowsPerBlock,
                                         kMaxRowThreads, launch_with);
}

template <typename Map, typename T>
cudaError_t softmax_linear_map(cudaStream_t stream, const SoftmaxInput<T>& input, const T* g,
                               BroadcastOperand<T> g_broadcast, T* out, SoftmaxShape shape,
                               CausalLimit causal = {}) {
  if (!valid_shape(shape, causal) || !valid_broadcast(input.where) ||
      !valid_broadcast(input.bias) || !valid_broadcast(g_broadcast) || input.x == nullptr ||
      input.stats == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool logits = input.where.data != nullptr || input.bias.data != nullptr;
  const bool broadcast = g_broadcast.data != nullptr;
  return launch_rows<T, kMapElements>(
      shape, {input.x, g, out}, [&](auto pack_width, RowLaunch launch) {
        constexpr int kVec = decltype(pack_width)::value;
        const auto kernel =
            logits ? (broadcast ? softmax_linear_map_kernel<T, kVec, Map, true, true>
                                : softmax_linear_map_kernel<T, kVec, Map, true, false>)
                   : (broadcast ? softmax_linear_map_kernel<T, kVec, Map, false, true>
                                : softmax_linear_map_kernel<T, kVec, Map, false, false>);
        return launch_kernel(kernel, launch.grid, launch.block, stream, input, g, g_broadcast,
                             out, shape.rows, static_cast<int>(shape.cols), causal);
      });
}

}  // namespace

template <typename T>
cudaError_t softmax_fwd(cudaStream_t stream, const T* x, BroadcastOperand<uint8_t> where,
                        BroadcastOperand<T> bias, T* y, float* stats, SoftmaxShape shape,
                        SoftmaxOutput output, CausalLimit causal) {
  if (!valid_shape(shape, causal) || !valid_broadcast(where) || !valid_broadcast(bias) ||
      stats == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_rows<T, kFwdElements>(shape, {x, y}, [&](auto pack_width, RowLaunch launch) {
    constexpr int kVec = decltype(pack_width)::value;
    const bool broadcast = where.data != nullptr || bias.data != nullptr;
    return launch_kernel(broadcast ? softmax_fwd_kernel<T, kVec, true>
                                   : softmax_fwd_kernel<T, kVec, false>,
                         launch.grid, launch.block, stream, x, where, bias, y, stats, shape.rows,
                         static_cast<int>(shape.cols),
                         output == SoftmaxOutput::kLogProbabilities, causal);
  });
}

template <typename T>
cudaError_t softmax_bwd(cudaStream_t stream, const T* dy, SoftmaxInput<T> input, T* dx,
                        SoftmaxShape shape, CausalLimit causal) {
  return softmax_linear_map<SoftmaxLinearMap>(stream, input, dy, BroadcastOperand<T>{}, dx, shape,
                                              causal);
}

template <typename T>
cudaError_t log_softmax_bwd(cudaStream_t stream, const T* dy, SoftmaxInput<T> input, T* dx,
                            SoftmaxShape shape) {
  return softmax_linear_map<LogSoftmaxVjp>(stream, input, dy, BroadcastOperand<T>{}, dx, shape);
}

template <typename T>
cudaError_t softmax_jvp(cudaStream_t stream, SoftmaxInput<T> input, const T* dx,
                        BroadcastOperand<T> dbias, T* dy, SoftmaxShape shape, CausalLimit causal) {
  return softmax_linear_map<SoftmaxLinearMap>(stream, input, dx, dbias, dy, shape, causal);
}

template <typename T>
cudaError_t log_softmax_jvp(cudaStream_t stream, SoftmaxInput<T> input, const T* dx,
                            BroadcastOperand<T> dbias, T* dy, SoftmaxShape shape) {
  return softmax_linear_map<LogSoftmaxJvp>(stream, input, dx, dbias, dy, shape);
}

#define JAXOPS_CUDA_SOFTMAX_INSTANTIATE(T)                                                 \
  template cudaError_t softmax_fwd<T>(cudaStream_t, const T*, BroadcastOperand<uint8_t>,   \
                                      BroadcastOperand<T>, T*, float*, SoftmaxShape,       \
                                      SoftmaxOutput, CausalLimit);                         \
  template cudaError_t softmax_bwd<T>(cudaStream_t, const T*, SoftmaxInput<T>, T*,         \
                                      SoftmaxShape, CausalLimit);                          \
  template cudaError_t log_softmax_bwd<T>(cudaStream_t, const T*, SoftmaxInput<T>, T*,     \
                                          SoftmaxShape);                                   \
  template cudaError_t softmax_jvp<T>(cudaStream_t, SoftmaxInput<T>, const T*,             \
                                      BroadcastOperand<T>, T*, SoftmaxShape, CausalLimit); \
  template cudaError_t log_softmax_jvp<T>(cudaStream_t, SoftmaxInput<T>, const T*,         \
                                          BroadcastOperand<T>, T*, SoftmaxShape);

JAXOPS_CUDA_SOFTMAX_INSTANTIATE(float)
JAXOPS_CUDA_SOFTMAX_INSTANTIATE(__half)
JAXOPS_CUDA_SOFTMAX_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
