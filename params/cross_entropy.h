// The parameters of cross-entropy, one set for the CPU kernels
// (cpu/cross_entropy.h), the CUDA kernels (cuda/cross_entropy.h) and the FFI
// handlers that fill them (xla_ffi/cross_entropy_common.h).
#pragma once

#include <cstdint>

namespace jaxops::params {

// logits [rows, vocab], row-major; labels [rows].
struct CrossEntropyShape {
  int64_t rows;
  int64_t vocab;
};

struct CrossEntropyOptions {
  int64_t ignore_index = -100;  // a row with this label has loss 0, gradient 0
  float label_smoothing = 0.f;  // in [0, 1]
  float z_loss = 0.f;           // >= 0: weight of lse^2
};

}  // namespace jaxops::params
