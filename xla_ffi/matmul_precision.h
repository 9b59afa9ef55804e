// The float32 precision policy of the targets with products inside (attention,
// paged attention, patch embedding, sparse linear; docs/precision.md): one
// attribute, resolved by the Python side at trace time from the precision the
// call asks for (jax.default_matmul_precision by default), as XLA's GPU dots
// read it. true where XLA would run a float32 dot on TF32 tensor cores (the
// default and "high" precisions), false for "highest"/"float32". A kernel may
// then use TF32 for float32 operands, never must: the CPU kernels, and the
// CUDA ones that stay on the CUDA cores, compute in full float32 either way.
#pragma once

#include "xla_ffi/contract.h"

namespace jaxops::matmul_precision {

inline constexpr contract::Attribute<bool> kAllowTf32{"allow_tf32"};

}  // namespace jaxops::matmul_precision
