// Which activation an elementwise kernel computes, one enum for the CPU kernels
// (cpu/activations.h), the CUDA kernels (cuda/activations.h) and the FFI
// handlers that choose it (xla_ffi/activations_common.h).
#pragma once

namespace jaxops::params {

enum class Activation { kGeluTanh, kGeluErf, kSilu };

}  // namespace jaxops::params
