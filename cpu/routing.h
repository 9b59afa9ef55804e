// The mixture-of-experts router (jaxops.topk_router) on the CPU: logits
// [tokens, experts] row-major, T float, bfloat16 or float16; scores, weights and
// every derivative in float32. The selection rules (scores, bias, groups, ties)
// are the ones params/routing.h and jaxops/reference.py:topk_router state.
//
// Expert ids read by the JVP and backward come from the forward, but a handler
// may be fed anything: they are clamped to [0, experts), so a bad id reads a
// wrong score instead of out of bounds.
#pragma once

#include <cstdint>

#include "params/routing.h"

namespace jaxops::cpu {

using ::jaxops::params::RouterShape;

// weights [tokens, k] float32, experts [tokens, k] int32 in selection order.
// expert_bias [experts] float32 or null (no bias).
template <typename T>
void topk_router_fwd(const T* logits, const float* expert_bias, float* weights, int32_t* experts,
                     RouterShape shape);

// The tangent of the weights [tokens, k] for a logits tangent dlogits, the
// experts held fixed (they are piecewise constant in the logits).
template <typename T>
void topk_router_jvp(const T* logits, const int32_t* experts, const T* dlogits, float* dweights,
                     RouterShape shape);

// d logits [tokens, experts] from d weights, through the renormalisation and the
// softmax or sigmoid, in one pass over each row.
template <typename T>
void topk_router_bwd(const float* dweights, const T* logits, const int32_t* experts, T* dlogits,
                     RouterShape shape);

}  // namespace jaxops::cpu
