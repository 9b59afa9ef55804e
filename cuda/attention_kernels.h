// The launchers behind cuda/attention.h's entry points (internal to cuda/):
// the tensor-core kernels of the FlashAttention-2 design (sm_80+: bfloat16 and
// float16 on mma.sync m16n8k16, float32 as TF32 on m16n8k8 where the call's
// allow_tf32 allows it; attention_forward.cu, attention_backward.cu,
// attention_jvp.cu) and the full-float32 SIMT kernels (float32 at "highest",
// and every float32 call on a GPU without TF32 tensor cores; attention_simt.cu).
// Each launches on `stream` and returns the first failing launch's error; the
// arguments are attention.h's, already checked there (head_dim within
// kCudaAttentionMaxHeadDim, num_kv_heads > 0, at least one query row).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/attention.h"

namespace jaxops::cuda::attention_kernels {

// The operands and results of one forward-mode call, as both forward-mode
// kernels (tensor-core and SIMT) take them; null tangents are zero.
template <typename T>
struct JvpTensors {
  const T* query;
  const T* key;
  const T* value;
  const T* dquery;
  const T* dkey;
  const T* dvalue;
  const float* dbias;
  T* out;
  float* logsumexp;
  T* dout;
  float* dlogsumexp;
};

// Whether the current device has the tensor cores and cp.async of sm_80.
bool device_has_tensor_cores();

template <typename T>
cudaError_t tensor_core_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                            const T* key, const T* value, T* out, float* logsumexp);

// d: the rows D = rowsum(dout * out) - dlogsumexp [B, N, T] (float32), computed.
template <typename T>
cudaError_t tensor_core_bwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                            const T* key, const T* value, const float* logsumexp, const T* dout,
                            const float* d, T* dquery, T* dkey, T* dvalue, float* dbias);

template <typename T>
cudaError_t tensor_core_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const T* query,
                                const T* key, const T* value, const T* dquery, const T* dkey,
                                const T* dvalue, const float* dbias, T* out, float* logsumexp,
                                T* dout, float* dlogsumexp);

cudaError_t simt_fwd(cudaStream_t stream, const AttentionParams& p, const float* query,
                     const float* key, const float* value, float* out, float* logsumexp);

cudaError_t simt_bwd(cudaStream_t stream, const AttentionParams& p, const float* query,
                     const float* key, const float* value, const float* logsumexp,
                     const float* dout, const float* d, float* dquery, float* dkey,
                     float* dvalue, float* dbias);

cudaError_t simt_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const float* query,
                         const float* key, const float* value, const float* dquery,
                         const float* dkey, const float* dvalue, const float* dbias, float* out,
                         float* logsumexp, float* dout, float* dlogsumexp);

#define JAXOPS_CUDA_ATTENTION_KERNELS_DECLARE(T)                                            \
  extern template cudaError_t tensor_core_fwd<T>(cudaStream_t, const AttentionParams&,      \
                                                 const T*, const T*, const T*, T*, float*); \
  extern template cudaError_t tensor_core_bwd<T>(                                           \
      cudaStream_t, const AttentionParams&, const T*, const T*, const T*, const float*,     \
      const T*, const float*, T*, T*, T*, float*);                                          \
  extern template cudaError_t tensor_core_fwd_jvp<T>(                                       \
      cudaStream_t, const AttentionParams&, const T*, const T*, const T*, const T*,         \
      const T*, const T*, const float*, T*, float*, T*, float*);

JAXOPS_CUDA_ATTENTION_KERNELS_DECLARE(float)
JAXOPS_CUDA_ATTENTION_KERNELS_DECLARE(__half)
JAXOPS_CUDA_ATTENTION_KERNELS_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_ATTENTION_KERNELS_DECLARE

}  // namespace jaxops::cuda::attention_kernels
