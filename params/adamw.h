// The hyperparameters of the fused AdamW step, one struct for the CPU kernel
// (cpu/adamw.h), the CUDA kernel (cuda/adamw.h) and the FFI handlers that fill
// it (xla_ffi/adamw_common.h).
#pragma once

namespace jaxops::params {

// 1 - b1 and 1 - b2 are passed rounded from their double-precision values, as
// optax's Python-float arithmetic computes them (float32(1 - 0.9) differs
// from 1 - float32(0.9) by an ulp).
struct AdamWHyperparameters {
  float b1;
  float one_minus_b1;
  float b2;
  float one_minus_b2;
  float eps;
  float weight_decay;
};

}  // namespace jaxops::params
