// One AdamW step on one parameter leaf of n elements (optax.adamw's math):
//
//   m' = (1 - b1) g + b1 m            v' = (1 - b2) g^2 + b2 v
//   u  = (m' / c1) / (sqrt(v' / c2) + eps) + weight_decay * p
//   out = -lr * u                     (the update, when !apply_updates)
//   out = p - lr * u                  (the new parameters, when apply_updates)
//
// with c1 = 1 - b1^t, c2 = 1 - b2^t (bias corrections) and lr given per step in
// `scalars` = {lr, c1, c2} (they depend on the step count, which is traced). T
// is the dtype of params, grads and out (float, bfloat16, float16); m and v are
// float32; everything is computed in float32. out may alias params or grads, and
// m_out / v_out may alias m / v (the update is elementwise).
#pragma once

#include <cstdint>

#include "params/adamw.h"

namespace jaxops::cpu {

using ::jaxops::params::AdamWHyperparameters;

template <typename T>
void adamw(const T* grads, const T* params, const float* m, const float* v, const float* scalars,
           T* out, float* m_out, float* v_out, int64_t n, AdamWHyperparameters hyper,
           bool apply_updates);

}  // namespace jaxops::cpu
