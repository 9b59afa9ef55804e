// The parameters of the mixture-of-experts router (jaxops.topk_router), one
// set for the CPU kernel (cpu/routing.h), the CUDA kernel (cuda/routing.h) and
// the FFI handlers that fill them (xla_ffi/routing_common.h), and the one
// ordering both platforms select experts by.
#pragma once

#include <cmath>
#include <cstdint>

#include "params/host_device.h"

namespace jaxops::params {

// How a logit becomes an expert's score (the `score` attribute).
enum class RouterScore : int64_t { kSoftmax = 0, kSigmoid = 1 };

// logits [tokens, experts]; weights and experts [tokens, k].
struct RouterShape {
  int64_t tokens;
  int64_t experts;
  int64_t k;            // in [1, experts]; <= group_topk * (experts / num_groups)
  RouterScore score;
  bool renormalize;     // weights / sum of the k weights
  int64_t num_groups;   // 1: no group limit; divides experts
  int64_t group_topk;   // groups kept, in [1, num_groups]
};

// Experts of one group that sum to the group's score (DeepSeek-V3: the top 2;
// a group of one expert scores with that one).
inline constexpr int64_t kGroupScoreTop = 2;

// The selection order, as lax.top_k's: a higher score first, and of equal
// scores the lower index. Both platforms pick the k first in this order, so
// they choose the same experts from the same scores.
JAXOPS_HOST_DEVICE bool ranks_before(float score, int64_t index, float other_score,
                                     int64_t other_index) {
  return score > other_score || (score == other_score && index < other_index);
}

// A score as the selection compares it: NaN ranks last, like -inf (so the
// order is total and every platform picks k distinct, in-range experts).
JAXOPS_HOST_DEVICE float selection_key(float score) { return score == score ? score : -HUGE_VALF; }

}  // namespace jaxops::params
