#include "cuda/cross_entropy.h"

#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"
#include "cuda/row_tile.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_tile;
using row_reduce::MaxSum;

// Layout (cuda/row_tile.cuh): a row per warp up to 32 * kElements columns, else
// a row per block of up to kMaxRowThreads threads; vocabularies longer than
// that stream chunk by chunk (the forward and the JVP only read the row, the
// backward writes each chunk as it reads it; the in-place forward-grad keeps
// the last chunk in registers and re-reads the others, from L2 mostly). At most
// 64 registers a thread (kMinBlocksPerSm blocks of kMaxRowThreads): docs/cuda.md,
// "Bandwidth-bound kernels", has the plan.
constexpr int kMaxRowThreads = 512;
constexpr int kMinBlocksPerSm = 2;
constexpr int kWarpRowsPerBlock = 4;
constexpr int64_t kMaxVocab = int64_t{1} << 30;

// Elements a thread holds per chunk: 16 logits (4 float32 or 2 16-bit packs);
// the JVP 8 logits and 8 of their tangent.
constexpr int kElements = 16;
constexpr int kJvpElements = 8;

enum class Pass { kForward, kBackward, kForwardGrad };

// The label of a row, or -1 if the row is not computed (ignored or out of
// range); *ignored tells which.
template <typename Label>
__device__ __forceinline__ int computed_label(const Label* labels, int64_t row, int vocab,
                                              int64_t ignore_index, bool* ignored) {
  const int64_t label = static_cast<int64_t>(labels[row]);
  *ignored = label == ignore_index;
  return !*ignored && label >= 0 && label < vocab ? static_cast<int>(label) : -1;
}

// Whether this thread's packs hold column `col` (every chunk puts the same
// threads on the same packs modulo blockDim.x).
template <int kVec>
__device__ __forceinline__ bool owns(int col) {
  return (col / kVec) % static_cast<int>(blockDim.x) == static_cast<int>(threadIdx.x);
}

// v[e] where this thread's column of element e in the chunk at `base` is
// `col`; `fallback` elsewhere.
template <int kVec, int N>
__device__ __forceinline__ float element_at(const float (&v)[N], int base, int col,
                                            float fallback) {
#pragma unroll
  for (int i = 0; i < N / kVec; ++i) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (item_col<kVec>(base, i) + j == col) fallback = v[i * kVec + j];
    }
  }
  return fallback;
}

// The row's sum of this thread's logits in the chunk at `base` (past the end: none).
template <int kVec, int N>
__device__ __forceinline__ float chunk_total(const float (&v)[N], int base, int vocab) {
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < N / kVec; ++i) {
    if (item_col<kVec>(base, i) >= vocab) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) total += v[i * kVec + j];
  }
  return total;
}

// One kernel for the three passes (they share the row statistics):
//   kForward:     loss, lse
//   kBackward:    dlogits from lse and dloss
//   kForwardGrad: loss, dlogits for dloss = 1
// In the in-place passes each thread reads and writes only its own columns, so
// dlogits may be the logits.
template <typename T, typename Label, int kVec, Pass kPass>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    cross_entropy_kernel(const T* logits, const Label* __restrict__ labels,
                         float* __restrict__ loss, float* __restrict__ lse_out,
                         const float* __restrict__ lse_in, const float* __restrict__ dloss,
                         T* dlogits, int64_t rows, int vocab, CrossEntropyOptions options) {
  constexpr int kItemCount = kItems<kVec, kElements>;
  constexpr int kElems = kItemCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const float eps = options.label_smoothing;
  const T* z = logits + row * vocab;
  T* d = kPass == Pass::kForward ? nullptr : dlogits + row * vocab;
  const int chunk = blockDim.x * kElems;
  const int chunks = (vocab + chunk - 1) / chunk;
  bool ignored;
  const int label = computed_label(labels, row, vocab, options.ignore_index, &ignored);
  float v[kElems];
  if (label < 0) {
    if (threadIdx.x == 0) {
      if constexpr (kPass != Pass::kBackward) loss[row] = ignored ? 0.f : CUDART_NAN_F;
      if constexpr (kPass == Pass::kForward) lse_out[row] = 0.f;
    }
    if constexpr (kPass != Pass::kForward) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) v[e] = 0.f;
      for (int c = 0; c < chunks; ++c) store_chunk<T, kVec, kItemCount>(d, c * chunk, vocab, v);
    }
    return;
  }
  const int label_chunk = label / chunk;

  float row_lse;
  if constexpr (kPass == Pass::kBackward) {
    row_lse = lse_in[row];
  } else {
    // The thread whose packs hold the label's column keeps its logit and
    // writes the loss: no other thread reads an element it may overwrite.
    float picked = 0.f, total = 0.f;
    MaxSum stats = MaxSum::empty();
    for (int c = 0; c < chunks; ++c) {
      load_chunk<T, kVec, kItemCount>(z, c * chunk, vocab, v, -CUDART_INF_F);
      stats = row_reduce::combine(stats, row_reduce::max_sum_of(v));
      if (eps != 0.f) total += chunk_total<kVec>(v, c * chunk, vocab);
      if (c == label_chunk) picked = element_at<kVec>(v, c * chunk, label, picked);
    }
    stats = row_reduce::block_max_sum(stats);
    float sums[1] = {total};
    if (eps != 0.f) row_sum(sums);
    row_lse = stats.max + logf(stats.sum);
    if (owns<kVec>(label)) {
      loss[row] = (1.f - eps) * (row_lse - picked) +
                  eps * (row_lse - sums[0] / static_cast<float>(vocab)) +
                  options.z_loss * row_lse * row_lse;
      if constexpr (kPass == Pass::kForward) lse_out[row] = row_lse;
    }
  }
  if constexpr (kPass != Pass::kForward) {
    const float g = kPass == Pass::kBackward ? dloss[row] : 1.f;
    const float scale = g * (1.f + 2.f * options.z_loss * row_lse);
    const float uniform = g * eps / static_cast<float>(vocab);
    const float target = g * (1.f - eps);
    // The forward-grad's last chunk is still in registers: write it first.
    for (int k = 0; k < chunks; ++k) {
      const int c = kPass == Pass::kForwardGrad ? chunks - 1 - k : k;
      if (kPass == Pass::kBackward || k != 0) {
        load_chunk<T, kVec, kItemCount>(z, c * chunk, vocab, v);
      }
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        v[e] = scale * row_reduce::exp_of_difference(v[e], row_lse) - uniform;
      }
      if (c == label_chunk) {
#pragma unroll
        for (int i = 0; i < kItemCount; ++i) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            if (item_col<kVec>(c * chunk, i) + j == label) v[i * kVec + j] -= target;
          }
        }
      }
      store_chunk<T, kVec, kItemCount>(d, c * chunk, vocab, v);
    }
  }
}

// The loss's tangent for the logits' tangent dz: the row sums of p * dz and,
// when label smoothing needs it, of dz; the thread whose packs hold the label's
// column keeps dz[label] and writes the row's value.
template <typename T, typename Label, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    cross_entropy_jvp_kernel(const T* __restrict__ logits, const Label* __restrict__ labels,
                             const float* __restrict__ lse, const T* __restrict__ dlogits,
                             float* __restrict__ dloss, int64_t rows, int vocab,
                             CrossEntropyOptions options) {
  constexpr int kItemCount = kItems<kVec, kJvpElements>;
  constexpr int kElems = kItemCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const float eps = options.label_smoothing;
  bool ignored;
  const int label = computed_label(labels, row, vocab, options.ignore_index, &ignored);
  if (label < 0) {
    if (threadIdx.x == 0) dloss[row] = 0.f;
    return;
  }
  const T* z = logits + row * vocab;
  const T* dz = dlogits + row * vocab;
  const float row_lse = lse[row];
  const int chunk = blockDim.x * kElems;
  const int chunks = (vocab + chunk - 1) / chunk;
  float z_v[kElems], dz_v[kElems];
  // sums[0] = sum of p * dz, sums[1] = sum of dz.
  float sums[2] = {0.f, 0.f}, picked = 0.f;
  for (int c = 0; c < chunks; ++c) {
    load_chunk<T, kVec, kItemCount>(z, c * chunk, vocab, z_v, -CUDART_INF_F);
    load_chunk<T, kVec, kItemCount>(dz, c * chunk, vocab, dz_v);
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      sums[0] += row_reduce::exp_of_difference(z_v[e], row_lse) * dz_v[e];
      sums[1] += dz_v[e];
    }
    if (c == label / chunk) picked = element_at<kVec>(dz_v, c * chunk, label, picked);
  }
  if (eps != 0.f) {
    row_sum(sums);
  } else {
    float p_dot[1] = {sums[0]};
    row_sum(p_dot);
    sums[0] = p_dot[0];
  }
  if (owns<kVec>(label)) {
    dloss[row] = (1.f + 2.f * options.z_loss * row_lse) * sums[0] -
                 eps * sums[1] / static_cast<float>(vocab) - (1.f - eps) * picked;
  }
}

bool valid_shape(CrossEntropyShape shape) {
  return shape.vocab >= 1 && shape.vocab <= kMaxVocab && shape.rows >= 0;
}

// Launches over the rows of `shape` (launch_row_groups).
template <typename T, int kRowElements, typename LaunchWith>
cudaError_t launch_rows(CrossEntropyShape shape, std::initializer_list<const void*> buffers,
                        LaunchWith&& launch_with) {
  if (!valid_shape(shape)) return cudaErrorInvalidValue;
  return launch_row_groups<T, kRowElements>(shape.rows, shape.vocab, buffers,
                                            kWarpRowsPerBlock, kMaxRowThreads, launch_with);
}

template <typename T, typename Label, Pass kPass>
cudaError_t launch(cudaStream_t stream, const T* logits, const Label* labels, float* loss,
                   float* lse_out, const float* lse_in, const float* dloss, T* dlogits,
                   CrossEntropyShape shape, CrossEntropyOptions options) {
  return launch_rows<T, kElements>(shape, {logits, dlogits}, [&](auto pack_width,
                                                                  RowLaunch launch) {
    return launch_kernel(cross_entropy_kernel<T, Label, decltype(pack_width)::value, kPass>,
                         launch.grid, launch.block, stream, logits, labels, loss, lse_out, lse_in,
                         dloss, dlogits, shape.rows, static_cast<int>(shape.vocab), options);
  });
}

}  // namespace

template <typename T, typename Label>
cudaError_t cross_entropy_fwd(cudaStream_t stream, const T* logits, const Label* labels,
                              float* loss, float* lse, CrossEntropyShape shape,
                              CrossEntropyOptions options) {
  return launch<T, Label, Pass::kForward>(stream, logits, labels, loss, lse, nullptr, nullptr,
                                          nullptr, shape, options);
}

template <typename T, typename Label>
cudaError_t cross_entropy_bwd(cudaStream_t stream, const T* logits, const Label* labels,
                              const float* lse, const float* dloss, T* dlogits,
                              CrossEntropyShape shape, CrossEntropyOptions options) {
  return launch<T, Label, Pass::kBackward>(stream, logits, labels, nullptr, nullptr, lse, dloss,
                                           dlogits, shape, options);
}

template <typename T, typename Label>
cudaError_t cross_entropy_fwd_grad(cudaStream_t stream, const T* logits, const Label* labels,
                                   float* loss, T* dlogits, CrossEntropyShape shape,
                                   CrossEntropyOptions options) {
  return launch<T, Label, Pass::kForwardGrad>(stream, logits, labels, loss, nullptr, nullptr,
                                              nullptr, dlogits, shape, options);
}

template <typename T, typename Label>
cudaError_t cross_entropy_jvp(cudaStream_t stream, const T* logits, const Label* labels,
                              const float* lse, const T* dlogits, float* dloss,
                              CrossEntropyShape shape, CrossEntropyOptions options) {
  return launch_rows<T, kJvpElements>(shape, {logits, dlogits}, [&](auto pack_width,
                                                                RowLaunch launch) {
    return launch_kernel(cross_entropy_jvp_kernel<T, Label, decltype(pack_width)::value>,
                         launch.grid, launch.block, stream, logits, labels, lse, dlogits, dloss,
                         shape.rows, static_cast<int>(shape.vocab), options);
  });
}

#define JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(T, Label)                                       \
  template cudaError_t cross_entropy_fwd<T, Label>(cudaStream_t, const T*, const Label*,      \
                                                   float*, float*, CrossEntropyShape,         \
                                                   CrossEntropyOptions);                      \
  template cudaError_t cross_entropy_bwd<T, Label>(cudaStream_t, const T*, const Label*,      \
                                                   const float*, const float*, T*,            \
                                                   CrossEntropyShape, CrossEntropyOptions);   \
  template cudaError_t cross_entropy_fwd_grad<T, Label>(cudaStream_t, const T*, const Label*, \
                                                        float*, T*, CrossEntropyShape,        \
                                                        CrossEntropyOptions);                 \
  template cudaError_t cross_entropy_jvp<T, Label>(cudaStream_t, const T*, const Label*,      \
                                                   const float*, const T*, float*,            \
                                                   CrossEntropyShape, CrossEntropyOptions);

JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(float, int32_t)
JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(float, int64_t)
JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(__half, int32_t)
JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(__half, int64_t)
JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(__nv_bfloat16, int32_t)
JAXOPS_CUDA_CROSS_ENTROPY_INSTANTIATE(__nv_bfloat16, int64_t)

}  // namespace jaxops::cuda
