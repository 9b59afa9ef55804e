// Attention over a paged KV cache on CUDA (jaxops.paged_attention) and the
// cache's update (jaxops.paged_kv_update). No XLA, no Python.
//
// The operation, layouts, masking and clamping are params/paged_attention.h's
// (shared with cpu/paged_attention.h and the FFI handlers); every pointer,
// including those inside the params, is device memory. Q is float, __half or
// __nv_bfloat16; KV (the page type) is Q or int8_t (with the float32 scales of
// the params). Logits, softmax statistics and accumulation are float32.
//
// Value pages may have a head dim Hv of their own (p.value_head_dim), or be
// absent (p.values_in_keys: the values are the first Hv features of the key
// rows, absorbed MLA; value_pages and p.value_scales are then not read, the
// key pages and key scales serve).
//
// Every function launches on `stream` and returns the first failing launch's
// cudaGetLastError() (cudaErrorInvalidValue for a head dim above
// kCudaPagedAttentionMaxHeadDim, a value head dim above
// kCudaPagedAttentionMaxValueHeadDim or params the header rejects).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/paged_attention.h"
#include "params/paged_attention_plan.h"

namespace jaxops::cuda {

using ::jaxops::params::PagedAttentionParams;
using ::jaxops::params::PagedKvUpdateParams;

// How the attention kernel divides the work and the workspace of its split-K
// (params/paged_attention_plan.h: host code, for the FFI contract too).
using ::jaxops::params::paged_attention_plan;
using ::jaxops::params::paged_attention_plan_with_splits;
using ::jaxops::params::paged_attention_workspace_bytes;
using ::jaxops::params::kCudaPagedAttentionMaxHeadDim;
using ::jaxops::params::kCudaPagedAttentionMaxValueHeadDim;
using ::jaxops::params::paged_attention_takes_mla_kernel;
using ::jaxops::params::PagedAttentionPlan;

// out [B, T, N, Hv] and, when not null, logsumexp [B, N, T]. With a null
// workspace the keys are not split (one kernel); otherwise `workspace` holds
// paged_attention_workspace_bytes(p, plan) bytes.
template <typename Q, typename KV>
cudaError_t launch_paged_attention(cudaStream_t stream, const PagedAttentionParams& p,
                                   const PagedAttentionPlan& plan, const Q* query,
                                   const KV* key_pages, const KV* value_pages, Q* out,
                                   float* logsumexp, void* workspace);

// With paged_attention_plan(p), or without splits when workspace is null.
template <typename Q, typename KV>
cudaError_t launch_paged_attention(cudaStream_t stream, const PagedAttentionParams& p,
                                   const Q* query, const KV* key_pages, const KV* value_pages,
                                   Q* out, float* logsumexp, void* workspace);

// Writes the rows key [num_tokens, K, H] and value [num_tokens, K, Hv]
// (type In) into the pages [P, page_size, K, H] and [P, page_size, K, Hv]
// (type KV) at slot_mapping[i] (int32, [num_tokens]); invalid slots (padding)
// are skipped. Float pages (KV == In) receive copies; int8 pages the header's
// symmetric quantization, with the scales written to key_scales/value_scales
// [P, page_size, K] (null for float pages). Of the tokens mapped to one slot,
// the last one's rows land. With p.values_in_keys only the keys are written
// (value, value_pages and value_scales are not read).
template <typename In, typename KV>
cudaError_t launch_paged_kv_update(cudaStream_t stream, const PagedKvUpdateParams& p,
                                   const In* key, const In* value, const int32_t* slot_mapping,
                                   KV* key_pages, KV* value_pages, float* key_scales,
                                   float* value_scales);

#define JAXOPS_CUDA_PAGED_DECLARE(Q, KV)                                                     \
  extern template cudaError_t launch_paged_attention<Q, KV>(                                 \
      cudaStream_t, const PagedAttentionParams&, const PagedAttentionPlan&, const Q*,        \
      const KV*, const KV*, Q*, float*, void*);                                              \
  extern template cudaError_t launch_paged_attention<Q, KV>(                                 \
      cudaStream_t, const PagedAttentionParams&, const Q*, const KV*, const KV*, Q*, float*, \
      void*);                                                                                \
  extern template cudaError_t launch_paged_kv_update<Q, KV>(                                 \
      cudaStream_t, const PagedKvUpdateParams&, const Q*, const Q*, const int32_t*, KV*, KV*, \
      float*, float*);

JAXOPS_CUDA_PAGED_DECLARE(float, float)
JAXOPS_CUDA_PAGED_DECLARE(__nv_bfloat16, __nv_bfloat16)
JAXOPS_CUDA_PAGED_DECLARE(__half, __half)
JAXOPS_CUDA_PAGED_DECLARE(float, int8_t)
JAXOPS_CUDA_PAGED_DECLARE(__nv_bfloat16, int8_t)
JAXOPS_CUDA_PAGED_DECLARE(__half, int8_t)

#undef JAXOPS_CUDA_PAGED_DECLARE

}  // namespace jaxops::cuda
