#include "cuda/cross_entropy.h"

#include <algorithm>
#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_reduce;

constexpr int kMaxRowThreads = 512;
// Rows beyond the grid are taken by the same blocks in turn.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

enum class Pass { kForward, kBackward, kForwardGrad };

// The label of a row, or -1 if the row is not computed (ignored or out of
// range); *ignored tells which.
template <typename Label>
__device__ __forceinline__ int64_t computed_label(const Label* labels, int64_t row, int64_t vocab,
                                                  int64_t ignore_index, bool* ignored) {
  const int64_t label = static_cast<int64_t>(labels[row]);
  *ignored = label == ignore_index;
  return !*ignored && label >= 0 && label < vocab ? label : -1;
}

// One kernel for the three passes (they share the row statistics):
//   kForward:     loss, lse
//   kBackward:    dlogits from lse and dloss
//   kForwardGrad: loss, dlogits for dloss = 1
// In the in-place passes each thread reads and writes only its own columns, so
// dlogits may be the logits.
template <typename T, typename Label, Pass kPass>
__global__ void __launch_bounds__(kMaxRowThreads)
    cross_entropy_kernel(const T* logits, const Label* __restrict__ labels,
                         float* __restrict__ loss, float* __restrict__ lse_out,
                         const float* __restrict__ lse_in, const float* __restrict__ dloss,
                         T* dlogits, int64_t rows, int64_t vocab,
                         CrossEntropyOptions options) {
  const float eps = options.label_smoothing;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = logits + row * vocab;
    bool ignored;
    const int64_t label = computed_label(labels, row, vocab, options.ignore_index, &ignored);
    if (label < 0) {
      if constexpr (kPass != Pass::kBackward) {
        if (threadIdx.x == 0) loss[row] = ignored ? 0.f : CUDART_NAN_F;
      }
      if constexpr (kPass == Pass::kForward) {
        if (threadIdx.x == 0) lse_out[row] = 0.f;
      } else {
        for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
          dlogits[row * vocab + c] = from_float<T>(0.f);
        }
      }
      continue;
    }
    float row_lse;
    if constexpr (kPass == Pass::kBackward) {
      row_lse = lse_in[row];
    } else {
      // The thread whose columns include the label's keeps its logit and
      // writes the loss: no other thread reads an element it may overwrite.
      float picked = 0.f;
      MaxSum stats = MaxSum::empty();
      float partial_total = 0.f;
      for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float v = to_float(z[c]);
        if (c == label) picked = v;
        stats.add(v);
        partial_total += v;
      }
      stats = block_max_sum(stats);
      const float total = eps != 0.f ? block_sum(partial_total) : 0.f;
      row_lse = stats.max + logf(stats.sum);
      if (threadIdx.x == label % blockDim.x) {
        loss[row] = (1.f - eps) * (row_lse - picked) +
                    eps * (row_lse - total / static_cast<float>(vocab)) +
                    options.z_loss * row_lse * row_lse;
        if constexpr (kPass == Pass::kForward) lse_out[row] = row_lse;
      }
    }
    if constexpr (kPass != Pass::kForward) {
      const float g = kPass == Pass::kBackward ? dloss[row] : 1.f;
      const float scale = g * (1.f + 2.f * options.z_loss * row_lse);
      const float uniform = g * eps / static_cast<float>(vocab);
      const float target = g * (1.f - eps);
      T* d = dlogits + row * vocab;
      for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
        float v = scale * expf(to_float(z[c]) - row_lse) - uniform;
        if (c == label) v -= target;
        d[c] = from_float<T>(v);
      }
    }
    // The next row's first reduction reuses the shared scratch; block_reduce
    // ends with a barrier, and rows without a reduction touch no shared memory.
  }
}

// The loss's tangent for the logits' tangent dz: the row sums of p * dz and,
// when label smoothing needs it, of dz; the thread whose columns include the
// label's keeps dz[label] and writes the row's value.
template <typename T, typename Label>
__global__ void __launch_bounds__(kMaxRowThreads)
    cross_entropy_jvp_kernel(const T* __restrict__ logits, const Label* __restrict__ labels,
                             const float* __restrict__ lse, const T* __restrict__ dlogits,
                             float* __restrict__ dloss, int64_t rows, int64_t vocab,
                             CrossEntropyOptions options) {
  const float eps = options.label_smoothing;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    bool ignored;
    const int64_t label = computed_label(labels, row, vocab, options.ignore_index, &ignored);
    if (label < 0) {
      if (threadIdx.x == 0) dloss[row] = 0.f;
      continue;
    }
    const T* z = logits + row * vocab;
    const T* dz = dlogits + row * vocab;
    const float row_lse = lse[row];
    float picked = 0.f, partial_p_dot = 0.f, partial_total = 0.f;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      const float d = to_float(dz[c]);
      if (c == label) picked = d;
      partial_p_dot += expf(to_float(z[c]) - row_lse) * d;
      partial_total += d;
    }
    const float p_dot = block_sum(partial_p_dot);
    const float total = eps != 0.f ? block_sum(partial_total) : 0.f;
    if (threadIdx.x == label % blockDim.x) {
      dloss[row] = (1.f + 2.f * options.z_loss * row_lse) * p_dot -
                   eps * total / static_cast<float>(vocab) - (1.f - eps) * picked;
    }
    // As in cross_entropy_kernel: block_sum ends with a barrier before the
    // next row's reduction reuses its scratch.
  }
}

// Launches `kernel` with one block per row (rows beyond the grid are taken by
// the same blocks in turn).
template <typename Kernel, typename... Args>
cudaError_t launch_rows(Kernel kernel, cudaStream_t stream, CrossEntropyShape shape,
                        Args... args) {
  if (shape.vocab < 1 || shape.rows < 0) return cudaErrorInvalidValue;
  if (shape.rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(std::min(shape.rows, kMaxBlocks)));
  const dim3 block(threads_for_row(shape.vocab, kMaxRowThreads));
  return launch_kernel(kernel, grid, block, stream, args...);
}

template <typename T, typename Label, Pass kPass>
cudaError_t launch(cudaStream_t stream, const T* logits, const Label* labels, float* loss,
                   float* lse_out, const float* lse_in, const float* dloss, T* dlogits,
                   CrossEntropyShape shape, CrossEntropyOptions options) {
  return launch_rows(cross_entropy_kernel<T, Label, kPass>, stream, shape, logits, labels, loss,
                     lse_out, lse_in, dloss, dlogits, shape.rows, shape.vocab, options);
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
  return launch_rows(cross_entropy_jvp_kernel<T, Label>, stream, shape, logits, labels, lse,
                     dlogits, dloss, shape.rows, shape.vocab, options);
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
