// Test-only (tests/test_wgmma_sass.py): the wgmma layer of cuda/wgmma.cuh compiled
// by nvcc for sm_90a in the pattern of the FlashAttention-3 consumer: S = Q K^T by
// SS products (both K-major, 128B swizzle), P = bf16(S) kept in registers as the
// RS A operand, O += P V with V by an MN-major ("transposed") descriptor, and a
// TF32 SS product; one kernel per N so that every register list the layer spells
// is assembled. Never launched: the test reads its SASS (HGMMA, no local memory).
#include <cuda_bf16.h>

#include "cuda/wgmma.cuh"

namespace wg = jaxops::cuda::wgmma;

// Q (64 x 64), K (N x 64), V (N x 64) bf16 tiles, 128B-swizzled, from `tiles`.
template <int N>
__global__ void __launch_bounds__(128) wgmma_probe_bf16(const uint4* tiles, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int kQBytes = 64 * 64 * 2, kKBytes = N * 64 * 2;
  for (int i = threadIdx.x; i < (kQBytes + 2 * kKBytes) / 16; i += 128) {
    reinterpret_cast<uint4*>(smem)[i] = tiles[i];
  }
  __syncthreads();
  const uint32_t q = wg::shared_address(smem), k = q + kQBytes, v = k + kKBytes;
  wg::Accumulator<N> s;
  wg::fence();
#pragma unroll
  for (int step = 0; step < 4; ++step) {  // K = 64 head dims in k16 steps of 32 bytes
    wg::mma_ss<__nv_bfloat16>(s, wg::make_descriptor(q + 32 * step, wg::Swizzle::k128B, 16, 1024),
                              wg::make_descriptor(k + 32 * step, wg::Swizzle::k128B, 16, 1024),
                              step > 0);
  }
  wg::commit_group();
  wg::wait_group<0>(s);
  wg::Accumulator<64> o;
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  // P = bf16(S) as the A fragments of the N / 16 k16 steps over N: the m64nN
  // accumulator's elements 8j .. 8j + 7 are register A of step j (same rows,
  // columns 16j + 2(l % 4) + i % 2 + 8(i / 4)), converted before the fence.
  uint32_t p[N / 16][4];
#pragma unroll
  for (int step = 0; step < N / 16; ++step) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const __nv_bfloat162 pair =
          __floats2bfloat162_rn(s[8 * step + 2 * r], s[8 * step + 2 * r + 1]);
      p[step][r] = *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
  wg::fence();
#pragma unroll
  for (int step = 0; step < N / 16; ++step) {
    // V rows of 64 head dims (128 bytes, one swizzled row): MN-major, 8 rows of K
    // per 1024-byte group (SBO); N blocks of 64 head dims (LBO) do not occur here.
    wg::mma_rs<__nv_bfloat16, wg::Major::kMN>(
        o, p[step], wg::make_descriptor(v + 2048 * step, wg::Swizzle::k128B, 8192, 1024), true);
  }
  wg::commit_group();
  wg::wait_group<0>(o);
#pragma unroll
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = o[i];
}

template <int N>
__global__ void __launch_bounds__(128) wgmma_probe_tf32(const uint4* tiles, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < (64 * 32 + N * 32) * 4 / 16; i += 128) {
    reinterpret_cast<uint4*>(smem)[i] = tiles[i];
  }
  __syncthreads();
  const uint32_t a = wg::shared_address(smem), b = a + 64 * 32 * 4;
  wg::Accumulator<N> d;
  wg::fence();
#pragma unroll
  for (int step = 0; step < 4; ++step) {  // K = 32 in k8 steps of 32 bytes
    wg::mma_ss_tf32(d, wg::make_descriptor(a + 32 * step, wg::Swizzle::k128B, 16, 1024),
                    wg::make_descriptor(b + 32 * step, wg::Swizzle::k128B, 16, 1024), step > 0);
  }
  uint32_t ra[4] = {};
  wg::mma_rs_tf32(d, ra, wg::make_descriptor(b, wg::Swizzle::k128B, 16, 1024), true);
  wg::commit_group();
  wg::wait_group<0>(d);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = d[i];
}

template <int N>
__global__ void __launch_bounds__(128) wgmma_probe_f16_mn(const uint4* tiles, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < (64 * 16 + 16 * N) * 2 / 16; i += 128) {
    reinterpret_cast<uint4*>(smem)[i] = tiles[i];
  }
  __syncthreads();
  const uint32_t a = wg::shared_address(smem), b = a + 64 * 16 * 2;
  wg::Accumulator<N> d;
  wg::fence();
  wg::mma_ss<__half, wg::Major::kMN, wg::Major::kMN>(
      d, wg::make_descriptor(a, wg::Swizzle::kNone, 256, 128),
      wg::make_descriptor(b, wg::Swizzle::kNone, 16 * N, 128), false);
  wg::commit_group();
  wg::wait_group<0>(d);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = d[i];
}

template __global__ void wgmma_probe_bf16<64>(const uint4*, float*);
template __global__ void wgmma_probe_bf16<96>(const uint4*, float*);
template __global__ void wgmma_probe_bf16<128>(const uint4*, float*);
template __global__ void wgmma_probe_bf16<192>(const uint4*, float*);
template __global__ void wgmma_probe_bf16<256>(const uint4*, float*);
template __global__ void wgmma_probe_tf32<8>(const uint4*, float*);
template __global__ void wgmma_probe_tf32<64>(const uint4*, float*);
template __global__ void wgmma_probe_tf32<128>(const uint4*, float*);
template __global__ void wgmma_probe_f16_mn<16>(const uint4*, float*);
template __global__ void wgmma_probe_f16_mn<32>(const uint4*, float*);
template __global__ void wgmma_probe_f16_mn<256>(const uint4*, float*);
