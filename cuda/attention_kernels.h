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

// The tensor-core kernels' configuration of a call: the padded head dims of
// query/key (kHd) and of value/out (kHdv), each 64, 128 or 256. Equal padded
// dims run as they are; a value head dim of its own (MLA: H = 192, Hv = 128)
// takes the (256, 128) configuration where H pads to 256 and Hv to at most
// 128, and otherwise the configuration of the larger of the two, the smaller
// zero-padded to it (correct, with idle columns). So every H, Hv <= 256 runs.
struct TensorCoreDims {
  int hd;
  int hdv;
};

// Whether a call needs the kernels' instantiations with the soft cap,
// segment ids and a value head dim of its own (kFeatures): the others run the
// plain ones, whose registers and tiles stay as they were without them.
inline bool tensor_core_features(const AttentionParams& p) {
  return p.logits_soft_cap > 0.0f || p.q_segment_ids != nullptr ||
         params::value_head_dim(p) != p.head_dim;
}

inline int tensor_core_padded_dim(int64_t head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

inline TensorCoreDims tensor_core_dims(const AttentionParams& p) {
  const int hd = tensor_core_padded_dim(p.head_dim);
  const int hdv = tensor_core_padded_dim(params::value_head_dim(p));
  if (hd == 256 && hdv <= 128) return {256, 128};
  const int both = hd > hdv ? hd : hdv;
  return {both, both};
}

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

// The sm_90a forward in the FlashAttention-3 design (attention_forward_sm90.cu:
// TMA producer warpgroup, two wgmma consumer warpgroups, 128 query rows and
// 128-key tiles per CTA). Only for an sm_90 device (elsewhere its kernel
// traps) and only where hopper_fwd_supports: bfloat16 or float16, H == Hv
// <= 128 with H a multiple of 8 (16-byte TMA strides; padded to 64 or 128),
// no mask and no bias (causal with its offset, the window, the lengths, the
// soft cap and segment ids are taken). hopper_fwd returns
// cudaErrorInvalidValue for a call it does not support (or whose tensors the
// TMA cannot describe: 16-byte aligned base addresses).
enum class HopperDtype { kFloat16, kBfloat16, kFloat32 };

bool hopper_fwd_supports(const AttentionParams& p, HopperDtype dtype);

template <typename T>
cudaError_t hopper_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                       const T* key, const T* value, T* out, float* logsumexp);

extern template cudaError_t hopper_fwd<__half>(cudaStream_t, const AttentionParams&,
                                               const __half*, const __half*, const __half*,
                                               __half*, float*);
extern template cudaError_t hopper_fwd<__nv_bfloat16>(cudaStream_t, const AttentionParams&,
                                                      const __nv_bfloat16*,
                                                      const __nv_bfloat16*,
                                                      const __nv_bfloat16*, __nv_bfloat16*,
                                                      float*);

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
