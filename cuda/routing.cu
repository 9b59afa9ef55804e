#include "cuda/routing.h"

#include <algorithm>

#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_reduce;
using ::jaxops::params::kGroupScoreTop;
using ::jaxops::params::ranks_before;
using ::jaxops::params::RouterScore;
using ::jaxops::params::selection_key;

// One warp per token; enough blocks to fill any GPU, the rest grid-stride.
constexpr int kRowThreads = kWarpSize;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

dim3 grid_for(int64_t tokens) { return dim3(static_cast<unsigned>(std::min(tokens, kMaxBlocks))); }

// The score of a logit in its row: softmax from the row's max and sum of
// exponentials, or the sigmoid.
struct RowScores {
  RouterScore kind;
  float max;
  float sum;

  __device__ __forceinline__ float operator()(float x) const {
    return kind == RouterScore::kSigmoid ? 1.f / (1.f + expf(-x)) : expf(x - max) / sum;
  }
};

template <typename T>
__device__ __forceinline__ RowScores row_scores(const T* x, int64_t experts, RouterScore kind) {
  if (kind == RouterScore::kSigmoid) return {kind, 0.f, 1.f};
  MaxSum stats = MaxSum::empty();
  for (int64_t e = threadIdx.x; e < experts; e += kRowThreads) stats.add(to_float(x[e]));
  stats = block_max_sum(stats);
  return {kind, stats.max, stats.sum};
}

// A candidate of the warp-wide arg-max: index -1 is none.
// Expert and group indices fit an int: the handlers cap experts below 2^31.
struct Pick {
  float key;
  int index;

  __device__ __forceinline__ static Pick none() { return {-CUDART_INF_F, -1}; }
  __device__ __forceinline__ Pick shuffled(int offset) const {
    return {__shfl_xor_sync(kFullWarp, key, offset), __shfl_xor_sync(kFullWarp, index, offset)};
  }
};

// The first of two picks in ranks_before order; keys hold no NaN
// (selection_key), so the order is total and every lane gets the same pick.
__device__ __forceinline__ Pick first_of(Pick a, Pick b) {
  if (b.index < 0) return a;
  if (a.index < 0) return b;
  return ranks_before(b.key, b.index, a.key, a.index) ? b : a;
}

__device__ __forceinline__ Pick warp_first(Pick pick) {
  __shared__ Pick scratch[kMaxWarps];
  return block_reduce(pick, [](Pick a, Pick b) { return first_of(a, b); }, scratch);
}

// Whether (key, index) comes after the previous round's pick (round 0: all do).
__device__ __forceinline__ bool after(Pick previous, float key, int64_t index) {
  return previous.index < 0 || ranks_before(previous.key, previous.index, key, index);
}

// The selection keys of one token's experts, and of its groups: the sum of
// the kGroupScoreTop best keys of the group's experts.
template <typename T>
struct TokenKeys {
  const T* x;
  const float* bias;
  RowScores scores;
  int64_t group_size;

  __device__ __forceinline__ float expert(int64_t e) const {
    const float p = scores(to_float(x[e]));
    return selection_key(bias ? p + bias[e] : p);
  }

  __device__ float group(int64_t g) const {
    static_assert(kGroupScoreTop == 2, "a group scores with its best two experts");
    Pick first = Pick::none(), second = Pick::none();
    for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
      const Pick candidate{expert(e), static_cast<int>(e)};
      if (first_of(candidate, first).index == e) {
        second = first;
        first = candidate;
      } else {
        second = first_of(second, candidate);
      }
    }
    // Summed from zero in rank order, as on the CPU; a group of one expert
    // scores with that one.
    float sum = 0.f + first.key;
    if (second.index >= 0) sum += second.key;
    return selection_key(sum);
  }
};

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
topk_router_fwd_kernel(const T* logits, const float* expert_bias, float* weights,
                       int32_t* experts, RouterShape s) {
  const int lane = threadIdx.x;
  const int64_t group_size = s.experts / s.num_groups;
  for (int64_t t = blockIdx.x; t < s.tokens; t += gridDim.x) {
    const T* x = logits + t * s.experts;
    const TokenKeys<T> keys{x, expert_bias, row_scores(x, s.experts, s.score), group_size};
    // The last of the group_topk kept groups: a group is kept when it ranks
    // at or before it.
    Pick last_group = Pick::none();
    if (s.num_groups > 1) {
      for (int64_t r = 0; r < s.group_topk; ++r) {
        Pick best = Pick::none();
        for (int64_t g = lane; g < s.num_groups; g += kRowThreads) {
          const float key = keys.group(g);
          if (after(last_group, key, g)) best = first_of(best, {key, static_cast<int>(g)});
        }
        last_group = warp_first(best);
      }
    }
    float sum = 0.f;
    Pick previous = Pick::none();
    for (int64_t r = 0; r < s.k; ++r) {
      Pick best = Pick::none();
      for (int64_t e = lane; e < s.experts; e += kRowThreads) {
        if (last_group.index >= 0 && after(last_group, keys.group(e / group_size), e / group_size)) {
          continue;
        }
        const float key = keys.expert(e);
        if (after(previous, key, e)) best = first_of(best, {key, static_cast<int>(e)});
      }
      previous = warp_first(best);
      const int64_t e = previous.index < 0 ? 0 : previous.index;
      const float p = keys.scores(to_float(x[e]));
      sum += p;
      // Round r is written by lane r % 32, which rescales its own writes below.
      if (lane == r % kRowThreads) {
        experts[t * s.k + r] = static_cast<int32_t>(e);
        weights[t * s.k + r] = p;
      }
    }
    if (s.renormalize) {
      for (int64_t j = lane; j < s.k; j += kRowThreads) weights[t * s.k + j] /= sum;
    }
  }
}

__device__ __forceinline__ int64_t clamped_expert(int32_t id, int64_t experts) {
  return id < 0 ? 0 : (id >= experts ? experts - 1 : id);
}

// d score / d logit of a sigmoid score s.
__device__ __forceinline__ float sigmoid_slope(float s) { return s * (1.f - s); }

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
topk_router_jvp_kernel(const T* logits, const int32_t* experts, const T* dlogits, float* dweights,
                       RouterShape s) {
  const int lane = threadIdx.x;
  for (int64_t t = blockIdx.x; t < s.tokens; t += gridDim.x) {
    const T* x = logits + t * s.experts;
    const T* dx = dlogits + t * s.experts;
    const RowScores scores = row_scores(x, s.experts, s.score);
    float mean_tangent = 0.f;
    if (s.score == RouterScore::kSoftmax) {
      float partial = 0.f;
      for (int64_t e = lane; e < s.experts; e += kRowThreads) {
        partial += scores(to_float(x[e])) * to_float(dx[e]);
      }
      mean_tangent = block_sum(partial);
    }
    const int32_t* ids = experts + t * s.k;
    auto score_tangent = [&](int64_t e, float p) {
      return s.score == RouterScore::kSoftmax ? p * (to_float(dx[e]) - mean_tangent)
                                              : sigmoid_slope(p) * to_float(dx[e]);
    };
    float sum = 0.f, dsum = 0.f;
    if (s.renormalize) {
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t e = clamped_expert(ids[j], s.experts);
        const float p = scores(to_float(x[e]));
        sum += p;
        dsum += score_tangent(e, p);
      }
    }
    for (int64_t j = lane; j < s.k; j += kRowThreads) {
      const int64_t e = clamped_expert(ids[j], s.experts);
      const float p = scores(to_float(x[e]));
      const float dp = score_tangent(e, p);
      // w = p / sum(p): dw = (dp - w * sum(dp)) / sum(p).
      dweights[t * s.k + j] = s.renormalize ? (dp - p / sum * dsum) / sum : dp;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
topk_router_bwd_kernel(const float* dweights, const T* logits, const int32_t* experts,
                       T* dlogits, RouterShape s) {
  const int lane = threadIdx.x;
  for (int64_t t = blockIdx.x; t < s.tokens; t += gridDim.x) {
    const T* x = logits + t * s.experts;
    const RowScores scores = row_scores(x, s.experts, s.score);
    const int32_t* ids = experts + t * s.k;
    const float* g = dweights + t * s.k;
    auto chosen_score = [&](int64_t j) {
      return scores(to_float(x[clamped_expert(ids[j], s.experts)]));
    };
    // Every lane walks the k choices: the d scores through w = p / sum(p).
    float sum = 0.f, weighted = 0.f;
    for (int64_t j = 0; j < s.k; ++j) sum += chosen_score(j);
    for (int64_t j = 0; j < s.k; ++j) weighted += g[j] * chosen_score(j) / sum;
    auto dscore = [&](int64_t j) { return s.renormalize ? (g[j] - weighted) / sum : g[j]; };
    float through_normaliser = 0.f;
    if (s.score == RouterScore::kSoftmax) {
      for (int64_t j = 0; j < s.k; ++j) through_normaliser += dscore(j) * chosen_score(j);
    }
    for (int64_t e = lane; e < s.experts; e += kRowThreads) {
      const float p = scores(to_float(x[e]));
      const bool softmax = s.score == RouterScore::kSoftmax;
      float d = softmax ? -p * through_normaliser : 0.f;
      const float slope = softmax ? p : sigmoid_slope(p);
      for (int64_t j = 0; j < s.k; ++j) {
        if (clamped_expert(ids[j], s.experts) == e) d += slope * dscore(j);
      }
      dlogits[t * s.experts + e] = from_float<T>(d);
    }
  }
}

bool valid(const RouterShape& s) {
  return s.tokens >= 0 && s.experts >= 1 && s.k >= 1 && s.k <= s.experts && s.num_groups >= 1 &&
         s.experts % s.num_groups == 0 && s.group_topk >= 1 && s.group_topk <= s.num_groups &&
         s.k <= s.group_topk * (s.experts / s.num_groups);
}

}  // namespace

template <typename T>
cudaError_t topk_router_fwd(cudaStream_t stream, const T* logits, const float* expert_bias,
                            float* weights, int32_t* experts, RouterShape shape) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.tokens == 0) return cudaGetLastError();
  return launch_kernel(topk_router_fwd_kernel<T>, grid_for(shape.tokens), dim3(kRowThreads),
                       stream, logits, expert_bias, weights, experts, shape);
}

template <typename T>
cudaError_t topk_router_jvp(cudaStream_t stream, const T* logits, const int32_t* experts,
                            const T* dlogits, float* dweights, RouterShape shape) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.tokens == 0) return cudaGetLastError();
  return launch_kernel(topk_router_jvp_kernel<T>, grid_for(shape.tokens), dim3(kRowThreads),
                       stream, logits, experts, dlogits, dweights, shape);
}

template <typename T>
cudaError_t topk_router_bwd(cudaStream_t stream, const float* dweights, const T* logits,
                            const int32_t* experts, T* dlogits, RouterShape shape) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.tokens == 0) return cudaGetLastError();
  return launch_kernel(topk_router_bwd_kernel<T>, grid_for(shape.tokens), dim3(kRowThreads),
                       stream, dweights, logits, experts, dlogits, shape);
}

#define JAXOPS_CUDA_ROUTER_INSTANTIATE(T)                                                     \
  template cudaError_t topk_router_fwd<T>(cudaStream_t, const T*, const float*, float*,       \
                                          int32_t*, RouterShape);                             \
  template cudaError_t topk_router_jvp<T>(cudaStream_t, const T*, const int32_t*, const T*,   \
                                          float*, RouterShape);                               \
  template cudaError_t topk_router_bwd<T>(cudaStream_t, const float*, const T*,               \
                                          const int32_t*, T*, RouterShape);

JAXOPS_CUDA_ROUTER_INSTANTIATE(float)
JAXOPS_CUDA_ROUTER_INSTANTIATE(__half)
JAXOPS_CUDA_ROUTER_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
