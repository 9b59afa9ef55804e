// Patch embedding on CUDA (see patch_embed.h for the contract): three tiled
// GEMMs whose patch operand is gathered from the image in the tile load (no
// im2col buffer), on the block-wide shared-memory products of the attention
// kernels (attention_tiles.cuh: wmma tensor cores for __half/__nv_bfloat16 on
// sm_80+, and for float32 as TF32 when allow_tf32 says so; a float32 SIMT loop
// otherwise).
//
//   forward:  a block owns kTile patch rows x kTile columns of D and walks the
//             patch length in steps of kStep; the epilogue adds bias and pos.
//   dimages:  kTile patch rows x kTile patch columns, walking D; each result is
//             scattered straight to its pixel (patches do not overlap).
//   dkernel:  kTile patch columns x kTile columns of D, walking all B * N patch
//             rows in the block: the reduction is in one block, in a fixed
//             order, so no atomics and no partials.
//   dpos / dcls / dbias: column sums over the batch (and the patches) of
//             dtokens, one thread per output element.
// Tiles past the edges of the matrices are zero-filled, so any shape works.
#include "cuda/patch_embed.h"

#include <cstdint>

#include "cuda/attention_tiles.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using attention_tiles::block_gemm;
using attention_tiles::kThreads;

constexpr int kTile = 64;
constexpr int kStep = 32;
// Row pads: multiples of 8 (16-bit wmma operands) and 4 (float accumulators),
// off the 32-bank period.
constexpr int kLdStep = kStep + 8;
constexpr int kLdTile = kTile + 8;
constexpr int kLdAcc = kTile + 4;

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

// Element (row, k) of the patch matrix: pixel k (kernel order ky, kx, c) of
// patch row `row` (flattened over batch and patches), or 0 outside it.
template <typename T>
__device__ __forceinline__ T patch_value(const T* images, const PatchEmbedShape& s, int64_t row,
                                         int64_t k) {
  if (row >= s.batch * s.patches() || k >= s.patch_len()) return from_float<T>(0.0f);
  const int64_t run = s.patch * s.channels;
  return images[s.patch_row_offset(row / s.patches(), row % s.patches(), k / run) + k % run];
}

// Row `row` of the patch matrix as a row of dtokens (skipping the class token).
__device__ __forceinline__ int64_t token_row(const PatchEmbedShape& s, int64_t row) {
  return row / s.patches() * s.tokens() + (s.has_cls ? 1 : 0) + row % s.patches();
}

template <typename T>
__device__ __forceinline__ T value_or_zero(const T* base, int64_t index, bool inside) {
  return inside ? base[index] : from_float<T>(0.0f);
}

// acc [kTile][kLdAcc] = the sum over k0 = 0, kStep, ... < length of the products
// of the tiles that load(k0) writes into a (A, or A^T with kTransA, leading
// dimension lda) and b ([kStep][kLdTile]): the loop every kernel here runs.
template <bool kTransA, typename T, typename Load>
__device__ __forceinline__ void sum_tile_products(float* acc, const T* a, int lda, const T* b,
                                                  int64_t length, bool allow_tf32, Load load) {
  for (int i = threadIdx.x; i < kTile * kLdAcc; i += kThreads) acc[i] = 0.0f;
  for (int64_t k0 = 0; k0 < length; k0 += kStep) {
    load(k0);
    __syncthreads();
    block_gemm<kTransA, false, true>(acc, kLdAcc, a, lda, b, kLdTile, kTile, kTile, kStep,
                                     allow_tf32);
    __syncthreads();
  }
}

template <typename T>
__global__ void patch_embed_fwd_kernel(const T* images, const T* kernel, const T* bias,
                                       const T* pos, T* tokens, PatchEmbedShape s,
                                       bool allow_tf32) {
  __shared__ __align__(32) float acc[kTile * kLdAcc];
  __shared__ __align__(32) T a[kTile * kLdStep];
  __shared__ __align__(32) T b[kStep * kLdTile];
  const int64_t m0 = int64_t{blockIdx.x} * kTile, n0 = int64_t{blockIdx.y} * kTile;
  const int64_t len = s.patch_len();
  sum_tile_products<false>(acc, a, kLdStep, b, len, allow_tf32, [&](int64_t k0) {
    for (int i = threadIdx.x; i < kTile * kStep; i += kThreads) {
      const int r = i / kStep, q = i % kStep;
      a[r * kLdStep + q] = patch_value(images, s, m0 + r, k0 + q);
    }
    for (int i = threadIdx.x; i < kStep * kTile; i += kThreads) {
      const int q = i / kTile, c = i % kTile;
      b[q * kLdTile + c] = value_or_zero(kernel, (k0 + q) * s.dim + n0 + c,
                                         k0 + q < len && n0 + c < s.dim);
    }
  });
  const int64_t rows = s.batch * s.patches();
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int64_t row = m0 + i / kTile, d = n0 + i % kTile;
    if (row >= rows || d >= s.dim) continue;
    const int64_t token = token_row(s, row);
    float v = acc[(i / kTile) * kLdAcc + i % kTile];
    if (bias) v += to_float(bias[d]);
    if (pos) v += to_float(pos[(token % s.tokens()) * s.dim + d]);
    tokens[token * s.dim + d] = from_float<T>(v);
  }
}

// tokens[b, 0] = cls + pos[0].
template <typename T>
__global__ void class_token_kernel(const T* pos, const T* cls, T* tokens, PatchEmbedShape s) {
  using namespace elementwise;
  for (int64_t i = global_thread(); i < s.batch * s.dim; i += grid_threads()) {
    const int64_t b = i / s.dim, d = i % s.dim;
    tokens[b * s.tokens() * s.dim + d] =
        from_float<T>(to_float(cls[d]) + (pos ? to_float(pos[d]) : 0.0f));
  }
}

// dpatches = dtokens . kernel^T, scattered to the image.
template <typename T>
__global__ void patch_embed_dimages_kernel(const T* dtokens, const T* kernel, T* dimages,
                                           PatchEmbedShape s, bool allow_tf32) {
  __shared__ __align__(32) float acc[kTile * kLdAcc];
  __shared__ __align__(32) T a[kTile * kLdStep];
  __shared__ __align__(32) T b[kStep * kLdTile];
  const int64_t m0 = int64_t{blockIdx.x} * kTile, k0 = int64_t{blockIdx.y} * kTile;
  const int64_t rows = s.batch * s.patches(), len = s.patch_len();
  sum_tile_products<false>(acc, a, kLdStep, b, s.dim, allow_tf32, [&](int64_t d0) {
    for (int i = threadIdx.x; i < kTile * kStep; i += kThreads) {
      const int r = i / kStep, q = i % kStep;
      const bool inside = m0 + r < rows && d0 + q < s.dim;
      a[r * kLdStep + q] =
          value_or_zero(dtokens, inside ? token_row(s, m0 + r) * s.dim + d0 + q : 0, inside);
    }
    for (int i = threadIdx.x; i < kStep * kTile; i += kThreads) {
      const int q = i / kTile, c = i % kTile;
      b[q * kLdTile + c] = value_or_zero(kernel, (k0 + c) * s.dim + d0 + q,
                                         k0 + c < len && d0 + q < s.dim);
    }
  });
  const int64_t run = s.patch * s.channels;
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int64_t row = m0 + i / kTile, k = k0 + i % kTile;
    if (row >= rows || k >= len) continue;
    dimages[s.patch_row_offset(row / s.patches(), row % s.patches(), k / run) + k % run] =
        from_float<T>(acc[(i / kTile) * kLdAcc + i % kTile]);
  }
}

// dkernel = patches^T dtokens: a block reduces over every patch row.
template <typename T>
__global__ void patch_embed_dkernel_kernel(const T* dtokens, const T* images, T* dkernel,
                                           PatchEmbedShape s, bool allow_tf32) {
  __shared__ __align__(32) float acc[kTile * kLdAcc];
  __shared__ __align__(32) T a[kStep * kLdTile];  // [patch row][patch column]
  __shared__ __align__(32) T b[kStep * kLdTile];  // [patch row][D column]
  const int64_t k0 = int64_t{blockIdx.x} * kTile, n0 = int64_t{blockIdx.y} * kTile;
  const int64_t rows = s.batch * s.patches(), len = s.patch_len();
  sum_tile_products<true>(acc, a, kLdTile, b, rows, allow_tf32, [&](int64_t m0) {
    for (int i = threadIdx.x; i < kStep * kTile; i += kThreads) {
      const int q = i / kTile, c = i % kTile;
      a[q * kLdTile + c] = patch_value(images, s, m0 + q, k0 + c);
      const bool inside = m0 + q < rows && n0 + c < s.dim;
      b[q * kLdTile + c] =
          value_or_zero(dtokens, inside ? token_row(s, m0 + q) * s.dim + n0 + c : 0, inside);
    }
  });
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int64_t k = k0 + i / kTile, d = n0 + i % kTile;
    if (k < len && d < s.dim) {
      dkernel[k * s.dim + d] = from_float<T>(acc[(i / kTile) * kLdAcc + i % kTile]);
    }
  }
}

// dpos[t, d] = sum over b of dtokens[b, t, d]; dcls = row 0 of that.
template <typename T>
__global__ void token_sums_kernel(const T* dtokens, T* dpos, T* dcls, PatchEmbedShape s) {
  using namespace elementwise;
  for (int64_t i = global_thread(); i < s.tokens() * s.dim; i += grid_threads()) {
    float sum = 0.0f;
    for (int64_t b = 0; b < s.batch; ++b) sum += to_float(dtokens[b * s.tokens() * s.dim + i]);
    if (dpos) dpos[i] = from_float<T>(sum);
    if (dcls && i < s.dim) dcls[i] = from_float<T>(sum);
  }
}

// dbias[d] = sum over every patch token of dtokens[., ., d].
template <typename T>
__global__ void bias_sum_kernel(const T* dtokens, T* dbias, PatchEmbedShape s) {
  using namespace elementwise;
  for (int64_t d = global_thread(); d < s.dim; d += grid_threads()) {
    float sum = 0.0f;
    for (int64_t row = 0; row < s.batch * s.patches(); ++row) {
      sum += to_float(dtokens[token_row(s, row) * s.dim + d]);
    }
    dbias[d] = from_float<T>(sum);
  }
}

}  // namespace

template <typename T>
cudaError_t patch_embed_fwd(cudaStream_t stream, const T* images, const T* kernel, const T* bias,
                            const T* pos, const T* cls, T* tokens, PatchEmbedShape s,
                            bool allow_tf32) {
  const int64_t rows = s.batch * s.patches();
  if (rows > 0) {
    const cudaError_t status =
        launch_kernel(patch_embed_fwd_kernel<T>, dim3(blocks_for(rows), blocks_for(s.dim)),
                      dim3(kThreads), stream, images, kernel, bias, pos, tokens, s, allow_tf32);
    if (status != cudaSuccess) return status;
  }
  if (cls && s.batch > 0) {
    return launch_kernel(class_token_kernel<T>, dim3(elementwise::grid_for(s.batch * s.dim)),
                         dim3(elementwise::kThreads), stream, pos, cls, tokens, s);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t patch_embed_bwd(cudaStream_t stream, const T* dtokens, const T* images,
                            const T* kernel, T* dimages, T* dkernel, T* dbias, T* dpos, T* dcls,
                            PatchEmbedShape s, bool allow_tf32) {
  const int64_t rows = s.batch * s.patches();
  cudaError_t status = cudaSuccess;
  if (dimages && rows > 0) {
    status = launch_kernel(patch_embed_dimages_kernel<T>,
                           dim3(blocks_for(rows), blocks_for(s.patch_len())), dim3(kThreads),
                           stream, dtokens, kernel, dimages, s, allow_tf32);
    if (status != cudaSuccess) return status;
  }
  if (dkernel) {
    status = launch_kernel(patch_embed_dkernel_kernel<T>,
                           dim3(blocks_for(s.patch_len()), blocks_for(s.dim)), dim3(kThreads),
                           stream, dtokens, images, dkernel, s, allow_tf32);
    if (status != cudaSuccess) return status;
  }
  if (dpos || dcls) {
    status = launch_kernel(token_sums_kernel<T>, dim3(elementwise::grid_for(s.tokens() * s.dim)),
                           dim3(elementwise::kThreads), stream, dtokens, dpos, dcls, s);
    if (status != cudaSuccess) return status;
  }
  if (dbias) {
    status = launch_kernel(bias_sum_kernel<T>, dim3(elementwise::grid_for(s.dim)),
                           dim3(elementwise::kThreads), stream, dtokens, dbias, s);
  }
  return status == cudaSuccess ? cudaGetLastError() : status;
}

#define JAXOPS_CUDA_PATCH_EMBED_INSTANTIATE(T)                                                  \
  template cudaError_t patch_embed_fwd<T>(cudaStream_t, const T*, const T*, const T*, const T*, \
                                          const T*, T*, PatchEmbedShape, bool);                 \
  template cudaError_t patch_embed_bwd<T>(cudaStream_t, const T*, const T*, const T*, T*, T*,   \
                                          T*, T*, T*, PatchEmbedShape, bool);

JAXOPS_CUDA_PATCH_EMBED_INSTANTIATE(float)
JAXOPS_CUDA_PATCH_EMBED_INSTANTIATE(__half)
JAXOPS_CUDA_PATCH_EMBED_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
