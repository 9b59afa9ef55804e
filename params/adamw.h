// What the fused AdamW step's CPU kernel (cpu/adamw.h), CUDA kernel
// (cuda/adamw.h) and FFI handlers (xla_ffi/adamw_common.h) share: the layout
// of the float32 `scalars` operand, the static options and the description of
// one parameter leaf (a step updates every leaf of a model in one call).
//
// Every hyper-parameter is an operand, not an attribute: a learning rate, b1,
// b2, eps, eps_root or weight decay that is traced (optax.inject_hyperparams, a
// schedule) changes per step without recompiling. The Python side computes
// them as optax.adamw does (1 - b1 and 1 - b2 from Python floats in double
// precision, float32(1 - 0.9) differing from 1 - float32(0.9) by an ulp).
#pragma once

#include <cstdint>

namespace jaxops::params {

// Indices into `scalars` (float32[kAdamWScalarCount]).
enum AdamWScalar : int {
  kAdamWStepSize = 0,    // -learning_rate (this step's)
  kAdamWB1,              // b1
  kAdamWOneMinusB1,      // 1 - b1
  kAdamWB2,              // b2
  kAdamWOneMinusB2,      // 1 - b2
  kAdamWEps,             // eps (outside the square root)
  kAdamWEpsRoot,         // eps_root (inside the square root)
  kAdamWWeightDecay,     // weight decay (this step's)
  kAdamWC1,              // 1 - b1^t, the first moment's bias correction at step t
  kAdamWC2,              // 1 - b2^t
  kAdamWC1Next,          // 1 - b1^(t+1) (Nesterov's look-ahead)
  kAdamWB1Moment,        // b1 as it multiplies a stored float32 first moment, then
                         // (the next two) a bfloat16 and a float16 one: rounded to the
                         // moment's dtype, as optax's weakly typed Python float is (XLA
                         // then multiplies in float32). Indexed by AdamWFloat.
  kAdamWScalarCount = kAdamWB1Moment + 3,
};

// The static choices of a call, the same for every leaf (kernel attributes).
struct AdamWOptions {
  bool apply_updates;  // out = params + update (else out = the update)
  bool nesterov;       // NAdamW's first moment estimate
};

// The storage types of a leaf's grads, params and out (one type), and of its
// first moment.
enum class AdamWFloat : uint8_t { kFloat32, kBFloat16, kFloat16 };

// One parameter leaf of `size` elements. out may alias params or grads, and
// m_out / v_out may alias m / v (the update is elementwise); v is float32.
struct AdamWLeaf {
  const void* grads;
  const void* params;
  const void* m;
  const float* v;
  void* out;
  void* m_out;
  float* v_out;
  int64_t size;
  AdamWFloat type;    // grads, params, out
  AdamWFloat moment;  // m, m_out
  bool decay;         // add weight_decay * params (false: skipped, as optax skips a
                      // constant 0 or a masked-out leaf, so 0 * inf is no NaN)
};

}  // namespace jaxops::params
