// One AdamW step on every leaf of a model in one call (optax.adamw's math,
// per element of each leaf):
//
//   m' = (1 - b1) g + b1 m            v' = (1 - b2) g^2 + b2 v
//   m^ = m' / c1                      (nesterov: b1 m' / c1_next + (1 - b1) g / c1)
//   u  = m^ / (sqrt(v' / c2 + eps_root) + eps)  [+ weight_decay * p when the leaf decays]
//   out = -lr * u                     (the update, when !apply_updates)
//   out = p - lr * u                  (the new parameters, when apply_updates)
//
// with c1 = 1 - b1^t, c2 = 1 - b2^t, c1_next = 1 - b1^(t+1). Every
// hyper-parameter comes in `scalars` (layout: params/adamw.h), read at run time.
// Each leaf (params::AdamWLeaf) has its own storage types: grads, params and out
// float, bfloat16 or float16; the first moment float, bfloat16 or float16; v
// float32. Everything is computed in float32 (with b1 as
// scalars[kAdamWB1Moment + moment type] has it for m), m' rounded to the
// moment's type only where it is stored (optax computes the update from the
// unrounded moment). out may alias params or grads, and m_out / v_out may
// alias m / v (the update is elementwise). NaN and inf propagate as IEEE
// arithmetic has them (the jnp reference's).
//
// One OpenMP region covers every leaf: small leaves share threads, and a step
// pays one fork and join, not one per leaf.
#pragma once

#include <cstdint>

#include "params/adamw.h"

namespace jaxops::cpu {

using ::jaxops::params::AdamWLeaf;
using ::jaxops::params::AdamWOptions;

void adamw(const AdamWLeaf* leaves, int64_t count, const float* scalars, AdamWOptions options);

}  // namespace jaxops::cpu
