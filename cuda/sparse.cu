#include "cuda/sparse.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"
#include "cuda/sparse_mma.cuh"

namespace jaxops::cuda {
namespace {

using ::jaxops::params::kSparseGroup;
using ::jaxops::params::sparse_column;
using ::jaxops::params::sparse_kept_positions;
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

// float32. Block (o, row block): the 32 lanes stride over packed row o, each keeping a
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

// The bfloat16/float16 forward on sparse tensor cores (mma.sp, cuda/sparse_mma.cuh).
// A warp computes a tile of 16 outputs x kMmaRowTiles * 8 rows of x over the
// whole of `in`, 32 inputs per step: the weight's fragment (A: 16 outputs x 32
// inputs, compressed) and its metadata are loaded and canonicalised once per
// step and serve kMmaRowTiles instructions, one per 8 rows of x (B = x^T).
// Fragments are read straight from global memory (each lane reads 4-byte pairs;
// the 4 lanes of a group read 16 contiguous bytes of a row): no shared-memory
// staging yet. Tails are zeros: outputs past `out` and groups past in / 4 get
// zero values and metadata, rows of x past `rows` and inputs past `in` zero B.
constexpr int kMmaRowTiles = 4;
constexpr int kMmaWarps = 4;
constexpr int kMmaRowsPerWarp = kMmaRowTiles * sparse_mma::kRows;

template <typename T>
__global__ void __launch_bounds__(kMmaWarps * 32)
    sparse_linear_fwd_mma_kernel(const T* x, const T* values, const uint8_t* metadata,
                                 const T* bias, T* y, SparseLinearShape s) {
  using namespace sparse_mma;
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t groups = s.in / kSparseGroup;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t o0 = (static_cast<int64_t>(blockIdx.x) * kMmaWarps + threadIdx.x / 32) * kOut;
  if (o0 >= s.out) return;  // the whole warp: no barrier follows
  const T zero = from_float<T>(0.f);
  // jaxops' nibble of (output o, group): the positions of its 2 values.
  const auto nibble = [&](int64_t o, int64_t group) -> uint32_t {
    return o < s.out && group < groups ? metadata[o * mcols + group / 2] >> (4 * (group % 2)) & 0xfu
                                       : 0u;
  };
  const int64_t row_blocks = (s.rows + kMmaRowsPerWarp - 1) / kMmaRowsPerWarp;
  for (int64_t rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
    const int64_t r0 = rb * kMmaRowsPerWarp;
    float acc[kMmaRowTiles][4];
#pragma unroll
    for (int n = 0; n < kMmaRowTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
    }
    for (int64_t k0 = 0; k0 < s.in; k0 += kK) {
      const int64_t group0 = k0 / kSparseGroup;
      // A: chunks t and t + 4 (register pairs 0-1 and 2-3) of rows g and g + 8.
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t o = o0 + g + 8 * (r % 2), group = group0 + t + 4 * (r / 2);
        const bool kept = o < s.out && group < groups;
        const T* v = values + (kept ? o * half + 2 * group : 0);
        a[r] = canonical_values(nibble(o, group), kept ? v[0] : zero, kept ? v[1] : zero);
      }
      // Metadata (selector 0: lanes t = 0, 1): chunks 4 (t % 2) .. + 3 of rows g and g + 8.
      uint32_t e = 0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint32_t nibbles = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          nibbles |= nibble(o0 + g + 8 * r, group0 + 4 * (t % 2) + c) << (4 * c);
        }
        e |= canonical_nibbles(nibbles) << (16 * r);
      }
#pragma unroll
      for (int n = 0; n < kMmaRowTiles; ++n) {
        // Row tiles wholly past the rows (the same for the whole warp) do nothing.
        if (r0 + kRows * n >= s.rows) break;
        // B = x^T: inputs k0 + 2t + 8j, + 1 of row r0 + 8n + g.
        const int64_t row = r0 + kRows * n + g;
        uint32_t b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t k = k0 + 2 * t + 8 * j;
          const bool inside = row < s.rows && k < s.in;  // in is even: k + 1 < in too
          const T* p = x + (inside ? row * s.in + k : 0);
          b[j] = pack(inside ? p[0] : zero, inside ? p[1] : zero);
        }
        mma_sp_m16n8k32<T>(acc[n], a, b, e);
      }
    }
#pragma unroll
    for (int n = 0; n < kMmaRowTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t o = o0 + g + 8 * (i / 2), row = r0 + kRows * n + 2 * t + i % 2;
        if (o < s.out && row < s.rows) {
          const float b = bias != nullptr ? to_float(bias[o]) : 0.f;
          y[row * s.out + o] = from_float<T>(acc[n][i] + b);
        }
      }
    }
  }
}

// 0 * NaN and 0 * inf are NaN, and the dense product x W^T (the reference)
// multiplies the pruned zeros: y[r, o] is NaN when x[r, c] is not finite at a
// column c that output o prunes. Neither forward kernel multiplies those
// columns (mma.sp selects the kept rows of B), so this one, launched after
// them, sets those outputs. Block: a row of x at a time. A healthy row costs
// one read of it; otherwise its groups holding non-finite values are listed
// in shared memory (kListGroups at a time) and each thread matches its
// outputs' metadata against the list.
constexpr int kListGroups = 1024;

template <typename T>
__global__ void sparse_linear_pruned_nan_kernel(const T* x, const uint8_t* metadata, T* y,
                                                SparseLinearShape s) {
  __shared__ int listed;
  __shared__ int list_groups[kListGroups];
  __shared__ uint8_t list_positions[kListGroups];
  const int64_t groups = s.in / kSparseGroup, mcols = sparse_metadata_cols(s.in);
  const auto non_finite = [](T v) {
    return (__float_as_uint(to_float(v)) & 0x7f800000u) == 0x7f800000u;
  };
  for (int64_t r = blockIdx.x; r < s.rows; r += gridDim.x) {
    const T* xr = x + r * s.in;
    bool any = false;
    for (int64_t c = threadIdx.x; c < s.in; c += blockDim.x) any = any || non_finite(xr[c]);
    if (!__syncthreads_or(any)) continue;  // the whole block
    for (int64_t g0 = 0; g0 < groups; g0 += kListGroups) {
      if (threadIdx.x == 0) listed = 0;
      __syncthreads();
      const int64_t g_end = g0 + kListGroups < groups ? g0 + kListGroups : groups;
      for (int64_t g = g0 + threadIdx.x; g < g_end; g += blockDim.x) {
        unsigned positions = 0;
        for (int p = 0; p < kSparseGroup; ++p) {
          positions |= static_cast<unsigned>(non_finite(xr[kSparseGroup * g + p])) << p;
        }
        if (positions != 0) {
          const int i = atomicAdd(&listed, 1);
          list_groups[i] = static_cast<int>(g - g0);
          list_positions[i] = static_cast<uint8_t>(positions);
        }
      }
      __syncthreads();
      const int n = listed;
      for (int64_t o = threadIdx.x; o < s.out && n > 0; o += blockDim.x) {
        for (int i = 0; i < n; ++i) {
          const unsigned kept = sparse_kept_positions(metadata + o * mcols, g0 + list_groups[i]);
          if ((list_positions[i] & ~kept) != 0) {
            y[r * s.out + o] = from_float<T>(__uint_as_float(0x7fc00000u));
            break;
          }
        }
      }
      __syncthreads();  // every thread has read `listed` before it is reset
    }
  }
}

// Thread (r, g): dx[r, 4g .. 4g + 3] = sum over o of dy[r, o] W[o, 4g .. 4g + 3].
// The 4 sums are selected by compare, not indexed, so they stay in registers.
// The pruned positions get dy[r, o] * 0 (the dense product's term): 0, or NaN
// for a non-finite dy.
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
      const unsigned kept = sparse_kept_positions(meta, g);
      const float pruned_term = d * 0.f;
      sum0 += kept & 1u ? 0.f : pruned_term;
      sum1 += kept & 2u ? 0.f : pruned_term;
      sum2 += kept & 4u ? 0.f : pruned_term;
      sum3 += kept & 8u ? 0.f : pruned_term;
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

// After either forward kernel: a block per row of x, at most kMaxRowBlocks.
template <typename T>
cudaError_t launch_pruned_nan(cudaStream_t stream, const T* x, const uint8_t* metadata, T* y,
                              SparseLinearShape shape) {
  if (shape.in == 0) return cudaGetLastError();
  const unsigned blocks =
      static_cast<unsigned>(shape.rows < kMaxRowBlocks ? shape.rows : kMaxRowBlocks);
  return launch_kernel(sparse_linear_pruned_nan_kernel<T>, dim3(blocks), kThreads, stream, x,
                       metadata, y, shape);
}

}  // namespace

template <typename T>
cudaError_t sparse_linear_fwd(cudaStream_t stream, const T* x, const T* values,
                              const uint8_t* metadata, const T* bias, T* y,
                              SparseLinearShape shape) {
  if (shape.rows == 0 || shape.out == 0) return cudaGetLastError();
  // bfloat16/float16 on sm_80+: sparse tensor cores.
  if constexpr (!std::is_same<T, float>::value) {
    if (sparse_mma::device_has_sparse_mma()) {
      const int64_t warps = (shape.out + sparse_mma::kOut - 1) / sparse_mma::kOut;
      const int64_t row_blocks = (shape.rows + kMmaRowsPerWarp - 1) / kMmaRowsPerWarp;
      const dim3 grid(
          static_cast<unsigned>((warps + kMmaWarps - 1) / kMmaWarps),
          static_cast<unsigned>(row_blocks < kMaxRowBlocks ? row_blocks : kMaxRowBlocks));
      const cudaError_t error = launch_kernel(sparse_linear_fwd_mma_kernel<T>, grid,
                                              kMmaWarps * 32, stream, x, values, metadata, bias,
                                              y, shape);
      if (error != cudaSuccess) return error;
      return launch_pruned_nan(stream, x, metadata, y, shape);
    }
  }
  // float32, and every dtype on a device without sparse tensor cores: SIMT.
  const int64_t row_blocks = (shape.rows + kRowsPerWarp - 1) / kRowsPerWarp;
  const dim3 grid(static_cast<unsigned>(shape.out),
                  static_cast<unsigned>(row_blocks < kMaxRowBlocks ? row_blocks : kMaxRowBlocks));
  const cudaError_t error = launch_kernel(sparse_linear_fwd_kernel<T>, grid, row_reduce::kWarpSize,
                                          stream, x, values, metadata, bias, y, shape);
  if (error != cudaSuccess) return error;
  return launch_pruned_nan(stream, x, metadata, y, shape);
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
