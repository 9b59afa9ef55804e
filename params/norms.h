// The parameters of layer_norm, rms_norm and add_rms_norm, one set for the CPU
// kernels (cpu/norms.h), the CUDA kernels (cuda/norms.h) and the FFI handlers
// that fill them (xla_ffi/norms_common.h).
#pragma once

#include <cstdint>

namespace jaxops::params {

// Rows = product of the leading axes, cols = the last axis, row-major.
struct NormShape {
  int64_t rows;
  int64_t cols;  // at most 2^30 on CUDA
};

// How the backward reduces the weight gradients: the rows split into `groups`
// equal contiguous groups (groups > 1 comes from vmap: one gradient per
// example), each cut into `parts` pieces reduced independently into the
// workspace and then summed in a fixed order (deterministic for any threads).
struct WeightGradLayout {
  int64_t groups = 1;  // divides rows
  int64_t parts = 1;   // pieces per group reduced in parallel
};

}  // namespace jaxops::params
