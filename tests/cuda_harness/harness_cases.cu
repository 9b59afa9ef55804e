// Test-only: small CUDA kernels that check the harness itself. Correct kernels
// check the emulated semantics (shuffles with widths, votes, wmma, dynamic shared
// memory); planted bugs check that the harness reports what it must: a missing
// barrier (wrong result under a random order, a race under ThreadSanitizer),
// out-of-bounds reads (AddressSanitizer), divergent barriers and deadlock (a
// failed launch with a report, not a hang).
//
// usage: harness_cases CASE    exit 0: right result; 3: wrong result;
//                              4: the launch failed (report on stderr)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mma.h>
#include <string>
#include <vector>

#include "cuda/launch.cuh"

namespace {

using jaxops::cuda::launch_kernel;
using jaxops::cuda::launch_kernel_dynamic_shared;
constexpr unsigned kFull = 0xffffffffu;

// Block sum: warp shuffles, then the warps' sums through shared memory.
template <bool kBarrier>
__global__ void block_sum(const float* in, float* out) {
  __shared__ float warp_sums[8];
  float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFull, v, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  if (kBarrier) __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) sum += warp_sums[w];
    out[blockIdx.x] = sum;
  }
}

__global__ void read_past_global(const float* in, float* out) {
  out[threadIdx.x] = in[threadIdx.x + 1];
}

__global__ void read_past_shared(const float* in, float* out) {
  __shared__ float tile[32];
  tile[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = tile[threadIdx.x + 1];
}

__global__ void read_past_dynamic_shared(const float* in, float* out) {
  float* tile = jaxops::cuda::dynamic_shared_memory<float>();
  tile[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = tile[threadIdx.x + 1];
}

__global__ void reverse_in_dynamic_shared(const float* in, float* out) {
  float* tile = jaxops::cuda::dynamic_shared_memory<float>();
  tile[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
}

__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

__global__ void barrier_after_exit(float* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

__global__ void shuffle_with_exited_lane(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(kFull, 1.f, 1);
}

__global__ void warp_waits_for_block(float* out) {
  if (threadIdx.x == 0) {
    __syncwarp();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

// out[k][lane] for the shuffles, with width 8 and a half-warp mask.
__global__ void shuffles(int* out) {
  const int lane = threadIdx.x;
  out[0 * 32 + lane] = __shfl_sync(kFull, lane * 10, 3, 8);
  out[1 * 32 + lane] = __shfl_up_sync(kFull, lane * 10, 2, 8);
  out[2 * 32 + lane] = __shfl_down_sync(kFull, lane * 10, 3, 8);
  out[3 * 32 + lane] = __shfl_xor_sync(kFull, lane * 10, 9, 16);
  out[4 * 32 + lane] = static_cast<int>(__ballot_sync(kFull, lane % 3 == 0));
  out[5 * 32 + lane] = __all_sync(kFull, lane < 32) + 2 * __any_sync(kFull, lane == 7);
  if (lane < 16) {
    out[6 * 32 + lane] = __shfl_xor_sync(0x0000ffffu, lane * 10, 1);
  } else {
    out[6 * 32 + lane] = __shfl_xor_sync(0xffff0000u, lane * 10, 2);
  }
  out[7 * 32 + lane] = __reduce_add_sync(kFull, static_cast<unsigned>(lane));
}

// C = A * B (16 x 16 x 16) in half with a float accumulator, via wmma.
__global__ void wmma_product(const __half* a, const __half* b, float* c) {
  using namespace nvcuda;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.5f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, b, 16);
  wmma::mma_sync(acc, fa, fb, acc);
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= 2.f;
  wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

int launched(cudaError_t status) {
  if (status == cudaSuccess) return 0;
  std::fprintf(stderr, "launch failed: %s: %s\n", cudaGetErrorName(status),
               cudaGetErrorString(status));
  return 4;
}

int wrong(const std::string& what) {
  std::fprintf(stderr, "wrong result: %s\n", what.c_str());
  return 3;
}

int run_block_sum(bool barrier) {
  const int blocks = 4, threads = 256;
  std::vector<float> in(blocks * threads), out(blocks);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 7);
  auto kernel = barrier ? block_sum<true> : block_sum<false>;
  if (int e = launched(launch_kernel(kernel, dim3(blocks), dim3(threads), nullptr, in.data(),
                                     out.data()))) {
    return e;
  }
  for (int b = 0; b < blocks; ++b) {
    float expected = 0.f;
    for (int t = 0; t < threads; ++t) expected += in[b * threads + t];
    if (out[b] != expected) {
      return wrong("block " + std::to_string(b) + ": " + std::to_string(out[b]) + " != " +
                   std::to_string(expected));
    }
  }
  return 0;
}

int run_one_warp(void (*kernel)(float*)) {
  std::vector<float> out(32);
  return launched(launch_kernel(kernel, dim3(1), dim3(32), nullptr, out.data()));
}

int run_read_past(const std::string& where) {
  // Exact-size heap buffers: AddressSanitizer guards their ends.
  float* in = new float[32];
  float* out = new float[32];
  for (int i = 0; i < 32; ++i) in[i] = static_cast<float>(i);
  cudaError_t status;
  if (where == "global") {
    status = launch_kernel(read_past_global, dim3(1), dim3(32), nullptr, in, out);
  } else if (where == "shared") {
    status = launch_kernel(read_past_shared, dim3(1), dim3(32), nullptr, in, out);
  } else {
    status = launch_kernel_dynamic_shared(read_past_dynamic_shared, dim3(1), dim3(32),
                                          32 * sizeof(float), nullptr, in, out);
  }
  const int e = launched(status);
  // Without AddressSanitizer the read returns poison (shared) or a neighbour.
  const bool right = e == 0 && out[31] == 32.f;
  delete[] in;
  delete[] out;
  return e ? e : (right ? 0 : 3);
}

int run_dynamic_shared() {
  std::vector<float> in(64), out(64);
  for (int i = 0; i < 64; ++i) in[i] = static_cast<float>(i);
  if (int e = launched(launch_kernel_dynamic_shared(reverse_in_dynamic_shared, dim3(2), dim3(64),
                                                    64 * sizeof(float), nullptr, in.data(),
                                                    out.data()))) {
    return e;
  }
  for (int i = 0; i < 64; ++i) {
    if (out[i] != in[63 - i]) return wrong("reverse at " + std::to_string(i));
  }
  return 0;
}

int run_shuffles() {
  std::vector<int> out(8 * 32);
  if (int e = launched(launch_kernel(shuffles, dim3(1), dim3(32), nullptr, out.data()))) return e;
  for (int lane = 0; lane < 32; ++lane) {
    const int segment = lane / 8 * 8;
    const int expected[8] = {
        (segment + 3) * 10,
        (lane - segment >= 2 ? lane - 2 : lane) * 10,
        (lane - segment + 3 < 8 ? lane + 3 : lane) * 10,
        // xor 9 within segments of 16: a source in a later segment reads its own value.
        ((lane ^ 9) <= (lane / 16 * 16 + 15) ? (lane ^ 9) : lane) * 10,
        static_cast<int>(0x49249249u),
        1 + 2,
        lane < 16 ? (lane ^ 1) * 10 : (lane ^ 2) * 10,
        31 * 32 / 2,
    };
    for (int k = 0; k < 8; ++k) {
      if (out[k * 32 + lane] != expected[k]) {
        return wrong("shuffle " + std::to_string(k) + " lane " + std::to_string(lane) + ": " +
                     std::to_string(out[k * 32 + lane]) + " != " + std::to_string(expected[k]));
      }
    }
  }
  return 0;
}

int run_wmma() {
  std::vector<__half> a(256), b(256);
  std::vector<float> c(256);
  for (int i = 0; i < 256; ++i) {
    a[i] = __float2half(static_cast<float>(i % 5) - 2.f);
    b[i] = __float2half(static_cast<float>(i % 3) * 0.5f);
  }
  if (int e = launched(launch_kernel(wmma_product, dim3(1), dim3(32), nullptr, a.data(), b.data(),
                                     c.data()))) {
    return e;
  }
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float sum = 0.5f;
      // b is column-major: element (k, j) at b[j * 16 + k].
      for (int k = 0; k < 16; ++k) sum += float(a[i * 16 + k]) * float(b[j * 16 + k]);
      if (c[i * 16 + j] != 2.f * sum) return wrong("wmma at " + std::to_string(i * 16 + j));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string name = argc > 1 ? argv[1] : "";
  if (name == "block_sum") return run_block_sum(true);
  if (name == "missing_barrier") return run_block_sum(false);
  if (name == "read_past_global") return run_read_past("global");
  if (name == "read_past_shared") return run_read_past("shared");
  if (name == "read_past_dynamic_shared") return run_read_past("dynamic");
  if (name == "dynamic_shared") return run_dynamic_shared();
  if (name == "divergent_barrier") return run_one_warp(divergent_barrier);
  if (name == "barrier_after_exit") return run_one_warp(barrier_after_exit);
  if (name == "shuffle_with_exited_lane") return run_one_warp(shuffle_with_exited_lane);
  if (name == "warp_waits_for_block") return run_one_warp(warp_waits_for_block);
  if (name == "shuffles") return run_shuffles();
  if (name == "wmma") return run_wmma();
  std::fprintf(stderr, "unknown case %s\n", name.c_str());
  return 2;
}
