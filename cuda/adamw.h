// CUDA kernel of the fused AdamW step over every leaf of a model. No XLA, no
// Python.
//
// The same operation, leaf table and math as cpu/adamw.h (keep the two in
// step), plus the stream to launch on: each leaf (params::AdamWLeaf) has its
// own storage types (grads, params, out float, __half or __nv_bfloat16; the
// first moment float, __nv_bfloat16 or __half; v float32) and its own weight
// decay flag; `scalars` (layout: params/adamw.h) is a device array, so traced
// hyper-parameters change without a recompile. out may alias params or grads,
// and m_out / v_out may alias m / v.
//
// One launch per kAdamWLeavesPerLaunch leaves (their pointers and sizes travel
// in the kernel's parameters): one launch for a model of up to that many
// leaves. Returns the first failed launch's cudaError_t (cudaGetLastError()).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params/adamw.h"

namespace jaxops::cuda {

using ::jaxops::params::AdamWLeaf;
using ::jaxops::params::AdamWOptions;

// Leaves per launch: the table of their pointers, sizes and first tiles
// (81 bytes a leaf) fills most of the 32 KiB of kernel parameters that CUDA
// 12.1+ allows on sm_70 and later.
constexpr int kAdamWLeavesPerLaunch = 384;

cudaError_t adamw(cudaStream_t stream, const AdamWLeaf* leaves, int64_t count,
                  const float* scalars, AdamWOptions options);

}  // namespace jaxops::cuda
