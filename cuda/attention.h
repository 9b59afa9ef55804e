// Flash attention on CUDA (FlashAttention-2 style): forward, backward and
// forward mode (JVP). No XLA, no Python.
//
// The same operation, layouts and masking as cpu/attention.h (keep the two in
// step), plus the stream to launch on:
//   query, out, dout, dq   [B, T, N, H]
//   key, value, dk, dv     [B, S, K, H]     N % K == 0 (grouped-query attention)
//   logsumexp              [B, N, T]        float32, natural log
// bias (float32) and mask (one byte per element) are read through four element
// strides over [B, N, T, S] (0 broadcasts); dbias is bias-shaped, summed over
// the broadcast axes. A row with no attended key gets output 0, logsumexp -inf
// and zero gradients. Every pointer, including query_offset and the sequence
// lengths, is device memory. T is float, __half or __nv_bfloat16; scores,
// softmax statistics and accumulation are float32.
//
// Every function launches on `stream` and returns the first failing launch's
// cudaGetLastError() (cudaErrorInvalidValue for head_dim > kCudaAttentionMaxHeadDim).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/attention.h"

namespace jaxops::cuda {

// The parameters (params/attention.h), shared with the CPU kernel and the
// handlers; head_dim is at most params::kCudaAttentionMaxHeadDim here.
using ::jaxops::params::AttentionParams;
using ::jaxops::params::kCudaAttentionMaxHeadDim;

// out [B,T,N,H], logsumexp [B,N,T].
template <typename T>
cudaError_t attention_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                          const T* key, const T* value, T* out, float* logsumexp);

// Bytes of device scratch attention_bwd needs (float32 [B, N, T]).
size_t attention_bwd_workspace_bytes(const AttentionParams& p);

// dq, dk, dv (and dbias when not null) from the cotangent dout of out and,
// when not null, dlogsumexp [B,N,T]. Deterministic except for dbias along
// broadcast axes (float atomics).
template <typename T>
cudaError_t attention_bwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                          const T* key, const T* value, const T* out, const float* logsumexp,
                          const T* dout, const float* dlogsumexp, T* dquery, T* dkey, T* dvalue,
                          float* dbias, void* workspace);

// Forward mode: out and logsumexp as attention_fwd, with their tangents dout
// [B,T,N,H] and dlogsumexp [B,N,T] (float32) for the tangents dquery, dkey,
// dvalue (shaped like their primals) and dbias (float32, read through the bias
// strides); a null tangent is zero, and its products are skipped. One pass over
// K/V, no workspace. A row with no attended key gets zero tangents.
template <typename T>
cudaError_t attention_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const T* query,
                              const T* key, const T* value, const T* dquery, const T* dkey,
                              const T* dvalue, const float* dbias, T* out, float* logsumexp,
                              T* dout, float* dlogsumexp);

#define JAXOPS_CUDA_ATTENTION_DECLARE(T)                                                   \
  extern template cudaError_t attention_fwd<T>(cudaStream_t, const AttentionParams&,       \
                                               const T*, const T*, const T*, T*, float*);  \
  extern template cudaError_t attention_bwd<T>(                                            \
      cudaStream_t, const AttentionParams&, const T*, const T*, const T*, const T*,        \
      const float*, const T*, const float*, T*, T*, T*, float*, void*);                    \
  extern template cudaError_t attention_fwd_jvp<T>(                                        \
      cudaStream_t, const AttentionParams&, const T*, const T*, const T*, const T*,        \
      const T*, const T*, const float*, T*, float*, T*, float*);

JAXOPS_CUDA_ATTENTION_DECLARE(float)
JAXOPS_CUDA_ATTENTION_DECLARE(__half)
JAXOPS_CUDA_ATTENTION_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_ATTENTION_DECLARE

}  // namespace jaxops::cuda
