#include "cuda/embedding.h"

#include <climits>

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"
#include "cuda/pack_io.cuh"

namespace jaxops::cuda {
namespace {

using namespace elementwise;
using namespace pack_io;

// Row kernels (the lookup, the gradient): a row of `dim` elements per row of
// threads, its 16-byte packs spread over threadIdx.x (up to kThreads of them,
// each handling kRowUnroll packs at a time, loads first), rows of threads
// filling a block of about kThreads.
constexpr int kRowUnroll = 2;
// The sort: shared-memory tiles of kSortTile keys, a compare-exchange per thread.
constexpr int kSortTile = static_cast<int>(params::kEmbeddingSortTile);
constexpr int kSortThreads = 1024;
constexpr uint64_t kPaddingKey = ~uint64_t{0};

__device__ __forceinline__ int32_t clamp_id(int32_t id, int64_t vocab) {
  return id < 0 ? 0 : (id >= vocab ? static_cast<int32_t>(vocab - 1) : id);
}

// The row of this row of threads: blockIdx.x * blockDim.y + threadIdx.y.
__device__ __forceinline__ int64_t thread_row() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
}

// Copies a row of `packs` packs, kRowUnroll of this thread's at a time.
template <typename T, int kVec>
__device__ __forceinline__ void copy_row(const T* __restrict__ from, T* __restrict__ to,
                                         int64_t packs) {
  using RawPack = typename Raw<sizeof(T) * kVec>::type;
  const RawPack* src = reinterpret_cast<const RawPack*>(from);
  RawPack* dst = reinterpret_cast<RawPack*>(to);
  for (int64_t p = threadIdx.x; p < packs; p += kRowUnroll * blockDim.x) {
    RawPack v[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (p + u * blockDim.x < packs) v[u] = src[p + u * blockDim.x];
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (p + u * blockDim.x < packs) dst[p + u * blockDim.x] = v[u];
    }
  }
}

template <typename T, int kVec>
__global__ void embedding_fwd_kernel(const T* __restrict__ table, const int32_t* __restrict__ ids,
                                     T* __restrict__ out, EmbeddingShape shape) {
  const int64_t t = thread_row();
  if (t >= shape.tokens) return;
  const int64_t row = clamp_id(ids[t], shape.vocab);
  copy_row<T, kVec>(table + row * shape.dim, out + t * shape.dim, shape.dim / kVec);
}

// keys[i] = row of token i << 32 | i; the padding past the tokens sorts last.
__global__ void sort_keys_kernel(const int32_t* ids, uint64_t* keys, EmbeddingShape shape,
                                 int64_t count) {
  for (int64_t i = global_thread(); i < count; i += grid_threads()) {
    keys[i] = i < shape.tokens
                  ? static_cast<uint64_t>(clamp_id(ids[i], shape.vocab)) << 32 |
                        static_cast<uint64_t>(i)
                  : kPaddingKey;
  }
}

__device__ __forceinline__ void compare_exchange(uint64_t* a, uint64_t* b, bool ascending) {
  if ((*a > *b) == ascending) {
    const uint64_t t = *a;
    *a = *b;
    *b = t;
  }
}

// The first element of compare-exchange pair t at distance j: pairs fill
// blocks of 2j elements, j pairs each.
__device__ __forceinline__ int64_t pair_first(int64_t t, int64_t j) {
  return 2 * j * (t / j) + t % j;
}

// Bitonic sort, the steps of distance j < kSortTile of the stages k in
// [first_stage, last_stage], in shared memory, a tile per block. Pair (i,
// i + j) of stage k is put in ascending order when bit k of i is 0 (indices
// are global: the tiles are pieces of one network).
__global__ void __launch_bounds__(kSortThreads)
    bitonic_tile_kernel(uint64_t* keys, int64_t first_stage, int64_t last_stage) {
  __shared__ uint64_t tile[kSortTile];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kSortTile;
  for (int i = threadIdx.x; i < kSortTile; i += blockDim.x) tile[i] = keys[base + i];
  __syncthreads();
  for (int64_t k = first_stage; k <= last_stage; k *= 2) {
    for (int j = static_cast<int>(k < kSortTile ? k : kSortTile) / 2; j > 0; j /= 2) {
      for (int t = threadIdx.x; t < kSortTile / 2; t += blockDim.x) {
        const int i = static_cast<int>(pair_first(t, j));
        compare_exchange(&tile[i], &tile[i + j], ((base + i) & k) == 0);
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < kSortTile; i += blockDim.x) keys[base + i] = tile[i];
}

// One step of distance j >= kSortTile of bitonic stage k, over all keys.
__global__ void bitonic_step_kernel(uint64_t* keys, int64_t count, int64_t k, int64_t j) {
  for (int64_t t = global_thread(); t < count / 2; t += grid_threads()) {
    const int64_t i = pair_first(t, j);
    compare_exchange(&keys[i], &keys[i + j], (i & k) == 0);
  }
}

// first[row] and end[row]: the row's tokens' positions among the sorted keys
// (first stays -1 for a row without tokens).
__global__ void mark_rows_kernel(const uint64_t* keys, int32_t* first, int32_t* end,
                                 int64_t tokens) {
  for (int64_t i = global_thread(); i < tokens; i += grid_threads()) {
    const int32_t row = static_cast<int32_t>(keys[i] >> 32);
    if (i == 0 || static_cast<int32_t>(keys[i - 1] >> 32) != row) {
      first[row] = static_cast<int32_t>(i);
    }
    if (i == tokens - 1 || static_cast<int32_t>(keys[i + 1] >> 32) != row) {
      end[row] = static_cast<int32_t>(i + 1);
    }
  }
}

// dtable[row] = the sum of dout over the row's tokens, in token order (the
// keys sort them so), float32; 0 for a row without tokens.
template <typename T, int kVec>
__global__ void embedding_grad_kernel(const T* __restrict__ dout,
                                      const uint64_t* __restrict__ keys,
                                      const int32_t* __restrict__ first,
                                      const int32_t* __restrict__ end, T* __restrict__ dtable,
                                      EmbeddingShape shape) {
  const int64_t row = thread_row();
  if (row >= shape.vocab) return;
  const int32_t begin = first[row];
  const int32_t stop = begin < 0 ? begin : end[row];
  const int64_t packs = shape.dim / kVec;
  T* out = dtable + row * shape.dim;
  for (int64_t p = threadIdx.x; p < packs; p += kRowUnroll * blockDim.x) {
    float sum[kRowUnroll][kVec] = {};
    for (int32_t i = begin; i < stop; ++i) {
      const T* in = dout + static_cast<int64_t>(keys[i] & 0xffffffffu) * shape.dim;
      float v[kRowUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        if (p + u * blockDim.x < packs) load_pack<T, kVec>(in + (p + u * blockDim.x) * kVec, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum[u][j] += v[u][j];
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (p + u * blockDim.x < packs) {
        store_pack<T, kVec>(out + (p + u * blockDim.x) * kVec, sum[u]);
      }
    }
  }
}

// Threads for row kernels over rows of `dim` elements in packs of kVec: a row
// of threads per row, rows filling a block of about kThreads.
template <int kVec>
dim3 row_block(int64_t dim) {
  const int64_t packs = (dim / kVec + kRowUnroll - 1) / kRowUnroll;
  const int x = static_cast<int>(packs < 1 ? 1 : (packs < kThreads ? packs : kThreads));
  return dim3(x, kThreads / x);
}

template <int kVec>
cudaError_t row_grid(int64_t rows, int64_t dim, dim3* grid, dim3* block) {
  *block = row_block<kVec>(dim);
  const int64_t blocks = (rows + block->y - 1) / block->y;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  *grid = dim3(static_cast<unsigned>(blocks));
  return cudaSuccess;
}

unsigned sort_grid(int64_t items) {
  const int64_t blocks = (items + kSortThreads - 1) / kSortThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// Sorts `count` keys (a power of two, a whole number of tiles) ascending.
cudaError_t bitonic_sort(cudaStream_t stream, uint64_t* keys, int64_t count) {
  const unsigned tiles = static_cast<unsigned>(count / kSortTile);
  cudaError_t status = launch_kernel(bitonic_tile_kernel, tiles, kSortThreads, stream, keys,
                                     int64_t{2}, int64_t{kSortTile});
  for (int64_t k = 2 * kSortTile; status == cudaSuccess && k <= count; k *= 2) {
    for (int64_t j = k / 2; status == cudaSuccess && j >= kSortTile; j /= 2) {
      status = launch_kernel(bitonic_step_kernel, sort_grid(count / 2), kSortThreads, stream,
                             keys, count, k, j);
    }
    if (status == cudaSuccess) {
      status = launch_kernel(bitonic_tile_kernel, tiles, kSortThreads, stream, keys, k, k);
    }
  }
  return status;
}

}  // namespace

template <typename T>
cudaError_t embedding_fwd(cudaStream_t stream, const T* table, const int32_t* ids, T* out,
                          EmbeddingShape shape) {
  if (shape.tokens * shape.dim == 0) return cudaGetLastError();
  return with_pack_width<T>(can_vectorize<T>(shape.dim, {table, out}), [&](auto pack_width) {
    constexpr int kVec = decltype(pack_width)::value;
    dim3 grid, block;
    const cudaError_t shaped = row_grid<kVec>(shape.tokens, shape.dim, &grid, &block);
    if (shaped != cudaSuccess) return shaped;
    return launch_kernel(embedding_fwd_kernel<T, kVec>, grid, block, stream, table, ids, out,
                         shape);
  });
}

template <typename T>
cudaError_t embedding_bwd(cudaStream_t stream, const T* dout, const int32_t* ids, T* dtable,
                          int32_t* workspace, EmbeddingShape shape) {
  if (shape.vocab * shape.dim == 0) return cudaGetLastError();
  const int64_t count = params::embedding_sort_keys(shape.tokens);
  uint64_t* keys = reinterpret_cast<uint64_t*>(workspace);
  int32_t* first = workspace + 2 * count;
  int32_t* end = first + shape.vocab;
  cudaError_t status = cudaMemsetAsync(first, 0xff, sizeof(int32_t) * shape.vocab, stream);
  if (status != cudaSuccess) return status;
  if (shape.tokens > 0) {
    status = launch_kernel(sort_keys_kernel, sort_grid(count), kSortThreads, stream, ids, keys,
                           shape, count);
    if (status == cudaSuccess) status = bitonic_sort(stream, keys, count);
    if (status == cudaSuccess) {
      status = launch_kernel(mark_rows_kernel, sort_grid(shape.tokens), kSortThreads, stream,
                             static_cast<const uint64_t*>(keys), first, end, shape.tokens);
    }
    if (status != cudaSuccess) return status;
  }
  return with_pack_width<T>(can_vectorize<T>(shape.dim, {dout, dtable}), [&](auto pack_width) {
    constexpr int kVec = decltype(pack_width)::value;
    dim3 grid, block;
    const cudaError_t shaped = row_grid<kVec>(shape.vocab, shape.dim, &grid, &block);
    if (shaped != cudaSuccess) return shaped;
    return launch_kernel(embedding_grad_kernel<T, kVec>, grid, block, stream, dout,
                         static_cast<const uint64_t*>(keys), static_cast<const int32_t*>(first),
                         static_cast<const int32_t*>(end), dtable, shape);
  });
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
