// What the fused AdamW step's CPU kernel (cpu/adamw.h), CUDA kernel
// (cuda/adamw.h) and FFI handlers (xla_ffi/adamw_common.h) share: the layout
// of the float32 `scalars` operand and the static options.
//
// Every hyper-parameter is an operand, not an attribute: a learning rate, b1,
// b2, eps, eps_root or weight decay that is traced (optax.inject_hyperparams, a
// schedule) changes per step without recompiling. The Python side computes
// them as optax.adamw does (1 - b1 and 1 - b2 from Python floats in double
// precision, float32(1 - 0.9) differing from 1 - float32(0.9) by an ulp).
#pragma once

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
  kAdamWB1Moment,        // b1 as it multiplies the stored first moment: rounded to
                         // bfloat16 for a bfloat16 moment, as optax's weakly typed
                         // Python float is (XLA then multiplies in float32)
  kAdamWScalarCount,
};

// The static choices (kernel attributes).
struct AdamWOptions {
  bool apply_updates;  // out = params + update (else out = the update)
  bool nesterov;       // NAdamW's first moment estimate
  bool decay;          // add weight_decay * params (false: skipped, as optax skips a
                       // constant 0 or a masked-out leaf, so 0 * inf is no NaN)
};

}  // namespace jaxops::params
