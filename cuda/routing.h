// CUDA kernels of the mixture-of-experts router (jaxops.topk_router): forward,
// forward-mode derivative (JVP) and backward. No XLA, no Python.
//
// The same operations, arguments and math as cpu/routing.h (keep the two in
// step), plus the stream to launch on: logits [tokens, experts] row-major, T
// float, __half or __nv_bfloat16, float32 arithmetic; expert ids read by the
// JVP and backward are clamped to [0, experts). One warp (a block of 32
// threads) handles a token: it picks the k experts in k rounds of a warp-wide
// arg-max over the experts ranked after the previous pick (params/routing.h:
// ranks_before), so no per-token list is kept, and group scores are recomputed
// where they are needed instead of staged in shared memory (no limit on the
// number of experts or groups).
//
// Every function returns cudaGetLastError() after its launch
// (cudaErrorInvalidValue for a shape it cannot handle).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/routing.h"

namespace jaxops::cuda {

using ::jaxops::params::RouterShape;

template <typename T>
cudaError_t topk_router_fwd(cudaStream_t stream, const T* logits, const float* expert_bias,
                            float* weights, int32_t* experts, RouterShape shape);

template <typename T>
cudaError_t topk_router_jvp(cudaStream_t stream, const T* logits, const int32_t* experts,
                            const T* dlogits, float* dweights, RouterShape shape);

template <typename T>
cudaError_t topk_router_bwd(cudaStream_t stream, const float* dweights, const T* logits,
                            const int32_t* experts, T* dlogits, RouterShape shape);

#define JAXOPS_CUDA_ROUTER_DECLARE(T)                                                          \
  extern template cudaError_t topk_router_fwd<T>(cudaStream_t, const T*, const float*, float*, \
                                                 int32_t*, RouterShape);                       \
  extern template cudaError_t topk_router_jvp<T>(cudaStream_t, const T*, const int32_t*,      \
                                                 const T*, float*, RouterShape);               \
  extern template cudaError_t topk_router_bwd<T>(cudaStream_t, const float*, const T*,        \
                                                 const int32_t*, T*, RouterShape);

JAXOPS_CUDA_ROUTER_DECLARE(float)
JAXOPS_CUDA_ROUTER_DECLARE(__half)
JAXOPS_CUDA_ROUTER_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_ROUTER_DECLARE

}  // namespace jaxops::cuda
