// jaxops.attention's decode path on CUDA: the forward of calls with few query
// rows per kv head (params/attention_decode.h says which) on the split-K
// decode kernels of cuda/kv_decode.cuh, reading a dense [B, S, K, H] cache
// (values [B, S, K, Hv]: a value head dim of its own takes the MLA kernel).
// No XLA, no Python.
//
// Same operation, layouts and results as cuda::attention_fwd (cuda/
// attention.h) for the calls it applies to: no bias, mask or segment ids;
// causal, windows, sequence lengths, the
// soft cap and the query offset (device memory, read by the kernel) as
// params/attention.h says; out [B, T, N, Hv] and logsumexp
// [B, N, T] (-inf and a zero row where no key is attended). float32
// arithmetic at every precision (the allow_tf32 policy permits TF32; the
// decode is bound by memory).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/attention.h"
#include "params/attention_decode.h"

namespace jaxops::cuda {

// `workspace`: params::attention_fwd_workspace_bytes of the call's shapes
// (null when that is 0). cudaErrorInvalidValue where decode does not apply.
template <typename T>
cudaError_t attention_decode_fwd(cudaStream_t stream, const params::AttentionParams& p,
                                 const T* q, const T* k, const T* v, T* out, float* logsumexp,
                                 void* workspace);

#define JAXOPS_CUDA_ATTENTION_DECODE_DECLARE(T)                                           \
  extern template cudaError_t attention_decode_fwd<T>(                                   \
      cudaStream_t, const params::AttentionParams&, const T*, const T*, const T*, T*, float*, \
      void*);
JAXOPS_CUDA_ATTENTION_DECODE_DECLARE(float)
JAXOPS_CUDA_ATTENTION_DECODE_DECLARE(__nv_bfloat16)
JAXOPS_CUDA_ATTENTION_DECODE_DECLARE(__half)
#undef JAXOPS_CUDA_ATTENTION_DECODE_DECLARE

}  // namespace jaxops::cuda
