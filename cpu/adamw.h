// One AdamW step on one parameter leaf of n elements (optax.adamw's math):
//
//   m' = (1 - b1) g + b1 m            v' = (1 - b2) g^2 + b2 v
//   m^ = m' / c1                      (nesterov: b1 m' / c1_next + (1 - b1) g / c1)
//   u  = m^ / (sqrt(v' / c2 + eps_root) + eps)  [+ weight_decay * p when decay]
//   out = -lr * u                     (the update, when !apply_updates)
//   out = p - lr * u                  (the new parameters, when apply_updates)
//
// with c1 = 1 - b1^t, c2 = 1 - b2^t, c1_next = 1 - b1^(t+1). Every
// hyper-parameter comes in `scalars` (layout: params/adamw.h), read at run time.
// T is the dtype of params, grads and out (float, bfloat16, float16); M the
// first moment's (float, bfloat16 or float16); v is float32; everything is computed in
// float32 (with b1 as scalars[kAdamWB1Moment] has it for m), m' rounded to M
// only where it is stored (optax computes the update from the unrounded moment). out may alias params or grads, and
// m_out / v_out may alias m / v (the update is elementwise). NaN and inf
// propagate as IEEE arithmetic has them (the jnp reference's).
#pragma once

#include <cstdint>

#include "params/adamw.h"

namespace jaxops::cpu {

using ::jaxops::params::AdamWOptions;

template <typename T, typename M>
void adamw(const T* grads, const T* params, const M* m, const float* v, const float* scalars,
           T* out, M* m_out, float* v_out, int64_t n, AdamWOptions options);

}  // namespace jaxops::cpu
