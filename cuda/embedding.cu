#include "cuda/embedding.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using namespace elementwise;

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kScanThreads = 1024;

__device__ __forceinline__ int32_t clamp_id(int32_t id, int64_t vocab) {
  return id < 0 ? 0 : (id >= vocab ? static_cast<int32_t>(vocab - 1) : id);
}

template <typename T>
__global__ void embedding_fwd_kernel(const T* table, const int32_t* ids, T* out,
                                     EmbeddingShape shape) {
  for (int64_t k = global_thread(); k < shape.tokens * shape.dim; k += grid_threads()) {
    const int64_t t = k / shape.dim, c = k % shape.dim;
    out[k] = table[static_cast<int64_t>(clamp_id(ids[t], shape.vocab)) * shape.dim + c];
  }
}

// row_end[v + 1] = number of tokens of row v (row_end zeroed first).
__global__ void count_rows_kernel(const int32_t* ids, int32_t* row_end, EmbeddingShape shape) {
  for (int64_t t = global_thread(); t < shape.tokens; t += grid_threads()) {
    atomicAdd(&row_end[clamp_id(ids[t], shape.vocab) + 1], 1);
  }
}

// In-place inclusive scan of values[0, n) by one block: each thread scans a
// contiguous segment, the segment totals are scanned in shared memory, and each
// segment adds the total of those before it.
__global__ void scan_kernel(int32_t* values, int64_t n) {
  __shared__ int32_t totals[kScanThreads];
  const int64_t segment = (n + kScanThreads - 1) / kScanThreads;
  const int64_t begin = threadIdx.x * segment;
  const int64_t end = begin + segment < n ? begin + segment : n;
  int32_t sum = 0;
  for (int64_t i = begin; i < end; ++i) sum += values[i];
  totals[threadIdx.x] = sum;
  __syncthreads();
  for (int offset = 1; offset < kScanThreads; offset *= 2) {
    const int32_t add = threadIdx.x >= offset ? totals[threadIdx.x - offset] : 0;
    __syncthreads();
    totals[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t running = threadIdx.x == 0 ? 0 : totals[threadIdx.x - 1];
  for (int64_t i = begin; i < end; ++i) {
    running += values[i];
    values[i] = running;
  }
}

// Stable placement of the tokens by row, one warp: row_end[v] starts as the
// first slot of row v and ends as one past its last. Lanes with the same row
// take consecutive slots in lane (= token) order.
__global__ void place_tokens_kernel(const int32_t* ids, int32_t* row_end, int32_t* order,
                                    EmbeddingShape shape) {
  const unsigned lane = threadIdx.x;
  for (int64_t base = 0; base < shape.tokens; base += kWarpSize) {
    const int64_t t = base + lane;
    const bool active = t < shape.tokens;
    const int32_t row = active ? clamp_id(ids[t], shape.vocab) : -1;
    const unsigned peers = __match_any_sync(kFullWarp, row);
    const unsigned before = peers & ((1u << lane) - 1u);
    const bool leader = before == 0;
    const int32_t first = active && leader ? row_end[row] : 0;
    const int32_t slot = __shfl_sync(kFullWarp, first, __ffs(peers) - 1) + __popc(before);
    if (active) order[slot] = static_cast<int32_t>(t);
    __syncwarp();
    if (active && leader) row_end[row] = first + __popc(peers);
    __syncwarp();
  }
}

template <typename T>
__global__ void embedding_grad_kernel(const T* dout, const int32_t* row_end,
                                      const int32_t* order, T* dtable, EmbeddingShape shape) {
  for (int64_t k = global_thread(); k < shape.vocab * shape.dim; k += grid_threads()) {
    const int64_t v = k / shape.dim, c = k % shape.dim;
    const int32_t begin = v == 0 ? 0 : row_end[v - 1], end = row_end[v];
    float sum = 0.0f;
    for (int32_t i = begin; i < end; ++i) {
      sum += to_float(dout[static_cast<int64_t>(order[i]) * shape.dim + c]);
    }
    dtable[k] = from_float<T>(sum);
  }
}

}  // namespace

template <typename T>
cudaError_t embedding_fwd(cudaStream_t stream, const T* table, const int32_t* ids, T* out,
                          EmbeddingShape shape) {
  if (shape.tokens * shape.dim == 0) return cudaGetLastError();
  return launch_kernel(embedding_fwd_kernel<T>, grid_for(shape.tokens * shape.dim), kThreads,
                       stream, table, ids, out, shape);
}

template <typename T>
cudaError_t embedding_bwd(cudaStream_t stream, const T* dout, const int32_t* ids, T* dtable,
                          int32_t* workspace, EmbeddingShape shape) {
  if (shape.vocab * shape.dim == 0) return cudaGetLastError();
  int32_t* row_end = workspace;
  int32_t* order = workspace + shape.vocab + 1;
  cudaError_t status =
      cudaMemsetAsync(row_end, 0, sizeof(int32_t) * (shape.vocab + 1), stream);
  if (status != cudaSuccess) return status;
  if (shape.tokens > 0) {
    status = launch_kernel(count_rows_kernel, grid_for(shape.tokens), kThreads, stream, ids,
                           row_end, shape);
    if (status != cudaSuccess) return status;
  }
  status = launch_kernel(scan_kernel, 1, kScanThreads, stream, row_end, shape.vocab + 1);
  if (status != cudaSuccess) return status;
  if (shape.tokens > 0) {
    status = launch_kernel(place_tokens_kernel, 1, kWarpSize, stream, ids, row_end, order, shape);
    if (status != cudaSuccess) return status;
  }
  return launch_kernel(embedding_grad_kernel<T>, grid_for(shape.vocab * shape.dim), kThreads,
                       stream, dout, static_cast<const int32_t*>(row_end),
                       static_cast<const int32_t*>(order), dtable, shape);
}

#define JAXOPS_CUDA_EMBEDDING_INSTANTIATE(T)                                                \
  template cudaError_t embedding_fwd<T>(cudaStream_t, const T*, const int32_t*, T*,         \
                                        EmbeddingShape);                                    \
  template cudaError_t embedding_bwd<T>(cudaStream_t, const T*, const int32_t*, T*,         \
                                        int32_t*, EmbeddingShape);

JAXOPS_CUDA_EMBEDDING_INSTANTIATE(float)
JAXOPS_CUDA_EMBEDDING_INSTANTIATE(__half)
JAXOPS_CUDA_EMBEDDING_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
