#include "cuda/sparse.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"

namespace jaxops::cuda {
namespace {

using ::jaxops::params::sparse_column;
using ::jaxops::params::sparse_metadata_cols;
using ::jaxops::params::sparse_position;
using ::jaxops::params::sparse_values_cols;
using elementwise::global_thread;
using elementwise::grid_for;
using elementwise::grid_threads;
using elementwise::kThreads;

// Rows of x a warp of the forward kernel serves with one pass over a packed row.
constexpr int kRowsPerWarp = 8;
constexpr int kMaxRowBlocks = 65535;  // gridDim.y

// Block (o, row block): the 32 lanes stride over packed row o, each keeping a
// sum per row, then the warp adds them up.
template <typename T>
__global__ void sparse_linear_fwd_kernel(const T* x, const T* values, const uint8_t* metadata,
                                         const T* bias, T* y, SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t o = blockIdx.x;
  const T* v = values + o * half;
  const uint8_t* meta = metadata + o * mcols;
  const int64_t row_blocks = (s.rows + kRowsPerWarp - 1) / kRowsPerWarp;
  for (int64_t rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
    const int64_t r0 = rb * kRowsPerWarp;
    float sums[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) sums[r] = 0.f;
    for (int64_t k = threadIdx.x; k < half; k += blockDim.x) {
      const float value = to_float(v[k]);
      const int64_t col = sparse_column(meta, k);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (r0 + r < s.rows) sums[r] += value * to_float(x[(r0 + r) * s.in + col]);
      }
    }
    const float b = bias != nullptr ? to_float(bias[o]) : 0.f;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float total = row_reduce::block_sum(sums[r]);
      if (threadIdx.x == 0 && r0 + r < s.rows) y[(r0 + r) * s.out + o] = from_float<T>(total + b);
    }
  }
}

// Thread (r, g): dx[r, 4g .. 4g + 3] = sum over o of dy[r, o] W[o, 4g .. 4g + 3].
// The 4 sums are selected by compare, not indexed, so they stay in registers.
template <typename T>
__global__ void sparse_linear_dx_kernel(const T* dy, const T* values, const uint8_t* metadata,
                                        T* dx, SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t groups = s.in / 4;
  for (int64_t i = global_thread(); i < s.rows * groups; i += grid_threads()) {
    const int64_t r = i / groups, g = i % groups;
    float sum0 = 0.f, sum1 = 0.f, sum2 = 0.f, sum3 = 0.f;
    for (int64_t o = 0; o < s.out; ++o) {
      const float d = to_float(dy[r * s.out + o]);
      const uint8_t* meta = metadata + o * mcols;
#pragma unroll
      for (int slot = 0; slot < 2; ++slot) {
        const int64_t k = 2 * g + slot;
        const float term = d * to_float(values[o * half + k]);
        const int p = sparse_position(meta, k);
        sum0 += p == 0 ? term : 0.f;
        sum1 += p == 1 ? term : 0.f;
        sum2 += p == 2 ? term : 0.f;
        sum3 += p == 3 ? term : 0.f;
      }
    }
    T* out = dx + r * s.in + 4 * g;
    out[0] = from_float<T>(sum0);
    out[1] = from_float<T>(sum1);
    out[2] = from_float<T>(sum2);
    out[3] = from_float<T>(sum3);
  }
}

// Thread (o, k): dvalues[o, k] = sum over rows of dy[r, o] x[r, column(o, k)].
template <typename T>
__global__ void sparse_linear_dvalues_kernel(const T* dy, const T* x, const uint8_t* metadata,
                                             T* dvalues, SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  for (int64_t i = global_thread(); i < s.out * half; i += grid_threads()) {
    const int64_t o = i / half, k = i % half;
    const int64_t col = sparse_column(metadata + o * mcols, k);
    float sum = 0.f;
    for (int64_t r = 0; r < s.rows; ++r) {
      sum += to_float(dy[r * s.out + o]) * to_float(x[r * s.in + col]);
    }
    dvalues[i] = from_float<T>(sum);
  }
}

}  // namespace

template <typename T>
cudaError_t sparse_linear_fwd(cudaStream_t stream, const T* x, const T* values,
                              const uint8_t* metadata, const T* bias, T* y,
                              SparseLinearShape shape) {
  if (shape.rows == 0 || shape.out == 0) return cudaGetLastError();
  const int64_t row_blocks = (shape.rows + kRowsPerWarp - 1) / kRowsPerWarp;
  const dim3 grid(static_cast<unsigned>(shape.out),
                  static_cast<unsigned>(row_blocks < kMaxRowBlocks ? row_blocks : kMaxRowBlocks));
  return launch_kernel(sparse_linear_fwd_kernel<T>, grid, row_reduce::kWarpSize, stream, x,
                       values, metadata, bias, y, shape);
}

template <typename T>
cudaError_t sparse_linear_dx(cudaStream_t stream, const T* dy, const T* values,
                             const uint8_t* metadata, T* dx, SparseLinearShape shape) {
  const int64_t items = shape.rows * (shape.in / 4);
  if (items == 0) return cudaGetLastError();
  return launch_kernel(sparse_linear_dx_kernel<T>, grid_for(items), kThreads, stream, dy, values,
                       metadata, dx, shape);
}

template <typename T>
cudaError_t sparse_linear_dvalues(cudaStream_t stream, const T* dy, const T* x,
                                  const uint8_t* metadata, T* dvalues, SparseLinearShape shape) {
  const int64_t items = shape.out * sparse_values_cols(shape.in);
  if (items == 0) return cudaGetLastError();
  return launch_kernel(sparse_linear_dvalues_kernel<T>, grid_for(items), kThreads, stream, dy, x,
                       metadata, dvalues, shape);
}

#define JAXOPS_CUDA_SPARSE_INSTANTIATE(T)                                                      \
  template cudaError_t sparse_linear_fwd<T>(cudaStream_t, const T*, const T*, const uint8_t*,  \
                                            const T*, T*, SparseLinearShape);                  \
  template cudaError_t sparse_linear_dx<T>(cudaStream_t, const T*, const T*, const uint8_t*,   \
                                           T*, SparseLinearShape);                             \
  template cudaError_t sparse_linear_dvalues<T>(cudaStream_t, const T*, const T*,              \
                                                const uint8_t*, T*, SparseLinearShape);

JAXOPS_CUDA_SPARSE_INSTANTIATE(float)
JAXOPS_CUDA_SPARSE_INSTANTIATE(__half)
JAXOPS_CUDA_SPARSE_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
