// Row tiles of the row-wise kernels (norms, softmax, cross-entropy): how a row
// is spread over the threads that handle it, read into registers with 16-byte
// loads and written back with 16-byte stores.
//
// A row is handled by a "row group" of blockDim.x threads: one warp for short
// rows (blockDim.y rows per block), else a whole block (blockDim.y = 1). Each
// thread holds kItems packs of kVec consecutive elements in registers; a chunk
// of blockDim.x * kItems * kVec columns is read with kItems independent loads
// per thread, all issued before the first is used, and consecutive threads own
// consecutive packs, so that each load instruction of a warp reads one
// contiguous span (512 bytes). Rows longer than a chunk are processed chunk by
// chunk. Packs are 16 bytes (kVec = 16 / sizeof(T)) when the row length is a
// multiple of 16 bytes and every buffer is 16-byte aligned; otherwise rows start
// at every alignment and the kernels take the scalar path (kVec = 1).
#pragma once

#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/pack_io.cuh"

namespace jaxops::cuda::row_tile {

using namespace pack_io;

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

// Packs a thread holds per chunk for kElements elements: kElements / kVec on
// the vectorised path, 8 single elements on the scalar path (where every
// element needs its own address registers, so more would spill).
template <int kVec, int kElements>
constexpr int kItems = kVec == 1 ? 8 : kElements / kVec;

// The columns a thread owns in the chunk starting at `base`: item i covers
// [item_col(i), item_col(i) + kVec).
template <int kVec>
__device__ __forceinline__ int item_col(int base, int item) {
  return base + (item * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * kVec;
}

// Loads this thread's part of a chunk; columns past the end read as `fill`.
template <typename T, int kVec, int kCount>
__device__ __forceinline__ void load_chunk(const T* row, int base, int cols,
                                           float (&v)[kCount * kVec], float fill = 0.f) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int col = item_col<kVec>(base, i);
    if (col < cols) {
      load_pack<T, kVec>(row + col, &v[i * kVec]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[i * kVec + j] = fill;
    }
  }
}

template <typename T, int kVec, int kCount>
__device__ __forceinline__ void store_chunk(T* row, int base, int cols,
                                            const float (&v)[kCount * kVec]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int col = item_col<kVec>(base, i);
    if (col < cols) store_pack<T, kVec>(row + col, &v[i * kVec]);
  }
}

// Sums each of v[0..N) over the threads of the row group; every thread receives
// the same bits (the butterfly adds the same pairs in every lane, and every
// thread adds the per-warp sums in the same order). One shared-memory step when
// the group is a block.
template <int N>
__device__ __forceinline__ void row_sum(float (&v)[N]) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(kFullWarp, v[i], offset);
  }
  if (blockDim.x > kWarpSize) {
    __shared__ float warp_sums[N][1024 / kWarpSize];
    const int warp = threadIdx.x / kWarpSize;
    if (threadIdx.x % kWarpSize == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) warp_sums[i][warp] = v[i];
    }
    __syncthreads();
    const int warps = blockDim.x / kWarpSize;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float sum = warp_sums[i][0];
      for (int w = 1; w < warps; ++w) sum += warp_sums[i][w];
      v[i] = sum;
    }
    __syncthreads();  // warp_sums is reused by the next call
  }
}

// The row of this thread's row group when every group handles one row. Only
// blocks of one-warp row groups can run past the last row; they never
// synchronise the block, so those warps may return early.
__device__ __forceinline__ int64_t group_row() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
}

struct RowLaunch {
  dim3 grid;
  dim3 block;
};

// Launch shape for `units` independent units of work of `cols` columns: one
// row group per unit, row groups of one warp (`warp_groups` of them per block)
// when a row fits in a warp's registers, else of whole blocks of up to
// `max_threads` threads (rows longer than that go chunk by chunk).
// `unit_per_block`: each unit is a block, whatever its row groups.
template <int kVec, int kCount>
cudaError_t row_launch(int64_t cols, int64_t units, bool unit_per_block, int warp_groups,
                       int max_threads, RowLaunch* launch) {
  const int64_t threads = ((cols + kVec - 1) / kVec + kCount - 1) / kCount;
  int group_threads = kWarpSize;
  int groups_per_block = warp_groups;
  if (threads > kWarpSize) {
    const int64_t rounded = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
    group_threads = static_cast<int>(rounded < max_threads ? rounded : max_threads);
    groups_per_block = 1;
  }
  const int64_t blocks =
      unit_per_block ? units : (units + groups_per_block - 1) / groups_per_block;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  launch->grid = dim3(static_cast<unsigned>(blocks));
  launch->block = dim3(group_threads, groups_per_block);
  return cudaSuccess;
}

// Launches a kernel with a row per row group (row_launch) over `rows` rows of
// `cols` columns, with the widest packs every buffer allows (kElements
// elements a thread on the vectorised path): launch_with(pack width as a
// std::integral_constant, the launch shape).
template <typename T, int kElements, typename LaunchWith>
cudaError_t launch_row_groups(int64_t rows, int64_t cols,
                              std::initializer_list<const void*> buffers, int warp_groups,
                              int max_threads, LaunchWith&& launch_with) {
  if (rows == 0) return cudaSuccess;
  return with_pack_width<T>(can_vectorize<T>(cols, buffers), [&](auto pack_width) {
    constexpr int kVec = decltype(pack_width)::value;
    RowLaunch launch;
    const cudaError_t shaped = row_launch<kVec, kItems<kVec, kElements>>(
        cols, rows, false, warp_groups, max_threads, &launch);
    if (shaped != cudaSuccess) return shaped;
    return launch_with(pack_width, launch);
  });
}

}  // namespace jaxops::cuda::row_tile
