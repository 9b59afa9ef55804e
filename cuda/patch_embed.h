// CUDA kernels for the patch embedding and its gradient. No XLA, no Python.
//
// The same operations, arguments and semantics as cpu/patch_embed.h (keep the
// two in step), plus the stream to launch on and allow_tf32 (the float32
// precision policy, docs/precision.md: float32 products may run on the TF32
// tensor cores); T is float, __half or __nv_bfloat16, products accumulate in
// float32. Null pointers are absent operands (bias, pos, cls) or gradients not
// wanted. Deterministic: no atomics, every output element is written by one
// thread.
// Every function returns cudaGetLastError() after its launches.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/patch_embed.h"

namespace jaxops::cuda {

using ::jaxops::params::PatchEmbedShape;

template <typename T>
cudaError_t patch_embed_fwd(cudaStream_t stream, const T* images, const T* kernel, const T* bias,
                            const T* pos, const T* cls, T* tokens, PatchEmbedShape shape,
                            bool allow_tf32);

template <typename T>
cudaError_t patch_embed_bwd(cudaStream_t stream, const T* dtokens, const T* images,
                            const T* kernel, T* dimages, T* dkernel, T* dbias, T* dpos, T* dcls,
                            PatchEmbedShape shape, bool allow_tf32);

#define JAXOPS_CUDA_PATCH_EMBED_DECLARE(T)                                                      \
  extern template cudaError_t patch_embed_fwd<T>(cudaStream_t, const T*, const T*, const T*,   \
                                                 const T*, const T*, T*, PatchEmbedShape,       \
                                                 bool);                                          \
  extern template cudaError_t patch_embed_bwd<T>(cudaStream_t, const T*, const T*, const T*,   \
                                                 T*, T*, T*, T*, T*, PatchEmbedShape, bool);

JAXOPS_CUDA_PATCH_EMBED_DECLARE(float)
JAXOPS_CUDA_PATCH_EMBED_DECLARE(__half)
JAXOPS_CUDA_PATCH_EMBED_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_PATCH_EMBED_DECLARE

}  // namespace jaxops::cuda
