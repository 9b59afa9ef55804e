// Test-only: a warp-specialised pipeline on the sm_90 layer (cuda/tma.cuh), the
// shape of a FlashAttention-3 forward CTA without the attention: C = A B^T for
// A [M][K] and B [N][K] float32 (rows of K, as queries and keys are), one CTA
// per 128 x 32 block of C.
//   warpgroup 0, the producer: setmaxnreg.dec to 40 registers; one elected
//     lane of its first warp streams K-tiles of A (128 x 32) and B (32 x 32),
//     128-byte swizzled, by TMA into a 3-stage ring: it waits for a stage's
//     `empty` barrier, expects the stage's bytes on its `full` barrier
//     (arrive.expect_tx) and issues the two loads, which complete there;
//   warpgroups 1 and 2, the consumers: setmaxnreg.inc to 232; each owns 64
//     rows of the block; per stage they wait on `full`, read the tiles through
//     the swizzle (tma::landed checks that the phase completed), accumulate
//     with plain FMAs and arrive on `empty` (256 arrivals free a stage); then
//     each writes its 64 x 32 tile to shared memory, fences the async proxy,
//     meets its warpgroup at a named barrier, and one thread TMA-stores it.
// Out-of-bounds rows and K columns arrive as zeros and are not stored, so any
// M, N and K (K and N multiples of 4: 16-byte global strides) work.
// tests/cuda_harness/tma_cases.cc runs it in the harness against a host
// product; tma_pipeline_probe.cu compiles it with nvcc for the SASS gate.
#pragma once

#include <cstdint>

#include <cuda.h>

#include "cuda/launch.cuh"
#include "cuda/tma.cuh"

namespace jaxops_tests::tma_pipeline {

namespace tma = jaxops::cuda::tma;

constexpr int kStages = 3;
constexpr int kBlockM = 128, kBlockN = 32, kBlockK = 32;  // a K-tile row: 128 bytes, one swizzle span
constexpr int kThreads = 384;                              // producer + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
constexpr uint32_t kATileBytes = kBlockM * kBlockK * 4, kBTileBytes = kBlockN * kBlockK * 4;
constexpr uint32_t kCTileBytes = 64 * kBlockN * 4;  // one consumer warpgroup's rows, unswizzled
constexpr uint32_t kBOffset = kStages * kATileBytes;
constexpr uint32_t kCOffset = kBOffset + kStages * kBTileBytes;
constexpr uint32_t kBarrierOffset = kCOffset + 2 * kCTileBytes;
constexpr uint32_t kSwizzleAlignment = 1024;  // the 128-byte swizzle's pattern
constexpr uint32_t kSharedBytes = kBarrierOffset + 2 * kStages * 8 + kSwizzleAlignment;

// Element (row, k) of a K-tile with 128-byte rows, 128-byte swizzled.
__device__ __forceinline__ float tile_element(const float* tile, int row, int k) {
  return tile[tma::swizzled_offset(tma::Swizzle::k128B, static_cast<uint32_t>(row * 128 + k * 4)) / 4];
}

__global__ void __launch_bounds__(kThreads, 1)
    row_block_product_kernel(const __grid_constant__ CUtensorMap a_map,
                             const __grid_constant__ CUtensorMap b_map,
                             const __grid_constant__ CUtensorMap c_map, int k_tiles) {
  unsigned char* const raw = jaxops::cuda::dynamic_shared_memory<unsigned char>();
  // Offset from `raw`, not rebuilt from an integer, so nvcc keeps the shared
  // address space (LDS, not generic loads).
  unsigned char* const smem =
      raw + (kSwizzleAlignment - reinterpret_cast<uintptr_t>(raw) % kSwizzleAlignment) % kSwizzleAlignment;
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);
  uint64_t* const empty = full + kStages;
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int m0 = static_cast<int>(blockIdx.x) * kBlockM, n0 = static_cast<int>(blockIdx.y) * kBlockN;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::init(&full[s], 1);
      tma::init(&empty[s], kConsumerThreads);
    }
    tma::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    tma::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x < 32 && tma::elect_one()) {
      tma::prefetch_tensor_map(&a_map);
      tma::prefetch_tensor_map(&b_map);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kStages;
        const uint32_t round = static_cast<uint32_t>(kt / kStages);
        // A fresh barrier's preceding phase counts as complete: round 0 passes.
        tma::wait_parity(&empty[s], (round & 1u) ^ 1u);
        tma::arrive_expect_tx(&full[s], kATileBytes + kBTileBytes);
        tma::load_2d(smem + s * kATileBytes, &a_map, kt * kBlockK, m0, &full[s]);
        tma::load_2d(smem + kBOffset + s * kBTileBytes, &b_map, kt * kBlockK, n0, &full[s]);
      }
    }
    return;
  }

  tma::setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int thread = static_cast<int>(threadIdx.x) - 128 * warpgroup;
  const int row = 64 * consumer + thread / 2, col0 = (thread % 2) * 16;
  float acc[16] = {};
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int s = kt % kStages;
    tma::wait_parity(&full[s], static_cast<uint32_t>(kt / kStages) & 1u);
    const float* a = tma::landed(reinterpret_cast<const float*>(smem + s * kATileBytes),
                                 kBlockM * kBlockK);
    const float* b = tma::landed(reinterpret_cast<const float*>(smem + kBOffset + s * kBTileBytes),
                                 kBlockN * kBlockK);
#pragma unroll 4
    for (int k = 0; k < kBlockK; ++k) {
      const float x = tile_element(a, row, k);
#pragma unroll
      for (int j = 0; j < 16; ++j) acc[j] = fmaf(x, tile_element(b, col0 + j, k), acc[j]);
    }
    tma::arrive(&empty[s]);
  }

  float* const c = reinterpret_cast<float*>(smem + kCOffset + consumer * kCTileBytes);
#pragma unroll
  for (int j = 0; j < 16; ++j) c[(thread / 2) * kBlockN + col0 + j] = acc[j];
  tma::fence_proxy_async();
  tma::named_sync(1 + consumer, 128);
  if (thread == 0) {
    tma::store_2d(&c_map, c, n0, m0 + 64 * consumer);
    tma::bulk_commit_group();
    tma::bulk_wait_group<0>();
  }
}

}  // namespace jaxops_tests::tma_pipeline
