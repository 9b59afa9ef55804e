#include "cpu/routing.h"

#include <algorithm>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/row_buffer.h"
#include "cpu/vector_math.h"

namespace jaxops::cpu {
namespace {

using ::jaxops::params::kGroupScoreTop;
using ::jaxops::params::ranks_before;
using ::jaxops::params::RouterScore;
using ::jaxops::params::selection_key;

// Below this many logits a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 14;

// scores[e] = softmax(x)[e] or sigmoid(x[e]), in float32.
// The loops vectorise (vector_math's exp is branch-free): the scores are
// recomputed by every pass, forward, tangent and backward.
void router_scores(const float* x, float* scores, int64_t n, RouterScore score) {
  if (score == RouterScore::kSigmoid) {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) scores[e] = vector_math::sigmoid(x[e]).value;
    return;
  }
  float max = x[0];
#pragma omp simd reduction(max : max)
  for (int64_t e = 1; e < n; ++e) max = std::max(max, x[e]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < n; ++e) {
    scores[e] = vector_math::exp(x[e] - max);
    sum += scores[e];
  }
  // A division, not a product with 1 / sum: the reference divides, and equal
  // probabilities must stay equal for the ties to go the same way.
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) scores[e] = scores[e] / sum;
}

// d score / d logit of a sigmoid score s: s (1 - s).
float sigmoid_slope(float s) { return s * (1.f - s); }

struct Ranked {
  float key;
  int64_t index;
};

// A list of the first `capacity` (key, index) pairs inserted, in ranks_before
// order: a sorted insert, cheap for the k <= a few dozen of MoE routers.
class TopList {
 public:
  explicit TopList(int64_t capacity) : items_(capacity) {}

  void clear() { count_ = 0; }

  void insert(float key, int64_t index) {
    const int64_t capacity = static_cast<int64_t>(items_.size());
    if (count_ == capacity &&
        !ranks_before(key, index, items_[capacity - 1].key, items_[capacity - 1].index)) {
      return;
    }
    int64_t pos = count_ < capacity ? count_++ : capacity - 1;
    while (pos > 0 && ranks_before(key, index, items_[pos - 1].key, items_[pos - 1].index)) {
      items_[pos] = items_[pos - 1];
      --pos;
    }
    items_[pos] = {key, index};
  }

  int64_t size() const { return count_; }
  const Ranked& operator[](int64_t i) const { return items_[i]; }

 private:
  std::vector<Ranked> items_;
  int64_t count_ = 0;
};

// Per-thread scratch of the forward.
struct RouterScratch {
  explicit RouterScratch(const RouterShape& s)
      : scores(s.experts), keys(s.experts), group_best(std::min(kGroupScoreTop,
                                                                s.experts / s.num_groups)),
        groups(s.group_topk), chosen(s.k) {}
  std::vector<float> scores, keys;
  TopList group_best, groups, chosen;
};

// The k experts of one row by selection key, within the group_topk best groups
// when the experts are grouped.
void select_experts(const float* keys, const RouterShape& s, RouterScratch& scratch) {
  scratch.chosen.clear();
  if (s.num_groups == 1) {
    for (int64_t e = 0; e < s.experts; ++e) scratch.chosen.insert(keys[e], e);
    return;
  }
  const int64_t group_size = s.experts / s.num_groups;
  scratch.groups.clear();
  for (int64_t g = 0; g < s.num_groups; ++g) {
    scratch.group_best.clear();
    for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
      scratch.group_best.insert(keys[e], e);
    }
    float group_score = 0.f;
    for (int64_t i = 0; i < scratch.group_best.size(); ++i) group_score += scratch.group_best[i].key;
    scratch.groups.insert(selection_key(group_score), g);
  }
  for (int64_t i = 0; i < scratch.groups.size(); ++i) {
    const int64_t g = scratch.groups[i].index;
    for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) scratch.chosen.insert(keys[e], e);
  }
}

int64_t clamped_expert(int32_t id, int64_t experts) {
  return std::clamp<int64_t>(id, 0, experts - 1);
}

}  // namespace

template <typename T>
void topk_router_fwd(const T* logits, const float* expert_bias, float* weights, int32_t* experts,
                     RouterShape s) {
#pragma omp parallel if (s.tokens * s.experts >= kMinParallel)
  {
    RowBuffer<T> reader(s.experts);
    RouterScratch scratch(s);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const float* x = reader.read(logits + t * s.experts, s.experts);
      float* scores = scratch.scores.data();
      router_scores(x, scores, s.experts, s.score);
      for (int64_t e = 0; e < s.experts; ++e) {
        scratch.keys[e] = selection_key(expert_bias ? scores[e] + expert_bias[e] : scores[e]);
      }
      select_experts(scratch.keys.data(), s, scratch);
      float sum = 0.f;
      for (int64_t j = 0; j < s.k; ++j) sum += scores[scratch.chosen[j].index];
      const float scale = s.renormalize ? sum : 1.f;
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t e = scratch.chosen[j].index;
        experts[t * s.k + j] = static_cast<int32_t>(e);
        weights[t * s.k + j] = scores[e] / scale;
      }
    }
  }
}

template <typename T>
void topk_router_jvp(const T* logits, const int32_t* experts, const T* dlogits, float* dweights,
                     RouterShape s) {
#pragma omp parallel if (s.tokens * s.experts >= kMinParallel)
  {
    RowBuffer<T> reader(s.experts), tangent_reader(s.experts);
    std::vector<float> scores(s.experts);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const float* x = reader.read(logits + t * s.experts, s.experts);
      const float* dx = tangent_reader.read(dlogits + t * s.experts, s.experts);
      router_scores(x, scores.data(), s.experts, s.score);
      // <p, dx>: the softmax's normaliser moves with every logit.
      float mean_tangent = 0.f;
      if (s.score == RouterScore::kSoftmax) {
#pragma omp simd reduction(+ : mean_tangent)
        for (int64_t e = 0; e < s.experts; ++e) mean_tangent += scores[e] * dx[e];
      }
      const int32_t* ids = experts + t * s.k;
      float* dw = dweights + t * s.k;
      float sum = 0.f, dsum = 0.f;
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t e = clamped_expert(ids[j], s.experts);
        const float p = scores[e];
        dw[j] = s.score == RouterScore::kSoftmax ? p * (dx[e] - mean_tangent)
                                                 : sigmoid_slope(p) * dx[e];
        sum += p;
        dsum += dw[j];
      }
      if (!s.renormalize) continue;
      // w = p / sum(p): dw = (dp - w * sum(dp)) / sum(p).
      for (int64_t j = 0; j < s.k; ++j) {
        const float w = scores[clamped_expert(ids[j], s.experts)] / sum;
        dw[j] = (dw[j] - w * dsum) / sum;
      }
    }
  }
}

template <typename T>
void topk_router_bwd(const float* dweights, const T* logits, const int32_t* experts, T* dlogits,
                     RouterShape s) {
#pragma omp parallel if (s.tokens * s.experts >= kMinParallel)
  {
    RowBuffer<T> reader(s.experts), writer(s.experts);
    std::vector<float> scores(s.experts), dscores(s.k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const float* x = reader.read(logits + t * s.experts, s.experts);
      router_scores(x, scores.data(), s.experts, s.score);
      const int32_t* ids = experts + t * s.k;
      const float* g = dweights + t * s.k;
      // d score of each chosen expert, through w = p / sum(p) when renormalised.
      float sum = 0.f, weighted = 0.f;
      for (int64_t j = 0; j < s.k; ++j) sum += scores[clamped_expert(ids[j], s.experts)];
      for (int64_t j = 0; j < s.k; ++j) {
        weighted += g[j] * scores[clamped_expert(ids[j], s.experts)] / sum;
      }
      for (int64_t j = 0; j < s.k; ++j) dscores[j] = s.renormalize ? (g[j] - weighted) / sum : g[j];
      float* dx = writer.target(dlogits + t * s.experts);
      if (s.score == RouterScore::kSoftmax) {
        // dx_e = p_e (h_e - sum_j h_j p_j), h the d scores scattered to the experts.
        float through_normaliser = 0.f;
        for (int64_t j = 0; j < s.k; ++j) {
          through_normaliser += dscores[j] * scores[clamped_expert(ids[j], s.experts)];
        }
#pragma omp simd
        for (int64_t e = 0; e < s.experts; ++e) dx[e] = -scores[e] * through_normaliser;
        for (int64_t j = 0; j < s.k; ++j) {
          const int64_t e = clamped_expert(ids[j], s.experts);
          dx[e] += scores[e] * dscores[j];
        }
      } else {
        std::fill(dx, dx + s.experts, 0.f);
        for (int64_t j = 0; j < s.k; ++j) {
          const int64_t e = clamped_expert(ids[j], s.experts);
          dx[e] += sigmoid_slope(scores[e]) * dscores[j];
        }
      }
      writer.commit(dlogits + t * s.experts, s.experts);
    }
  }
}

#define JAXOPS_INSTANTIATE_ROUTER(T)                                                         \
  template void topk_router_fwd<T>(const T*, const float*, float*, int32_t*, RouterShape);  \
  template void topk_router_jvp<T>(const T*, const int32_t*, const T*, float*, RouterShape); \
  template void topk_router_bwd<T>(const float*, const T*, const int32_t*, T*, RouterShape);

JAXOPS_INSTANTIATE_ROUTER(float)
JAXOPS_INSTANTIATE_ROUTER(bfloat16)
JAXOPS_INSTANTIATE_ROUTER(float16)

}  // namespace jaxops::cpu
