// How the CUDA paged attention (cuda/paged_attention.cu) divides its work:
// the decode plan of params/decode_plan.h with one group per (sequence, kv
// head), the T * (N / K) query rows of a kv head's group, and the capacity
// M * page_size of a sequence as its keys (kv_lens are traced data). Host
// code with no CUDA in it, so that the FFI contract sizes the CUDA workspace
// from the operand shapes alone.
//
// Which kernel: the decode kernel (decode_block) for value rows as wide as
// the key rows, up to kCudaDecodeMaxHeadDim (a cache whose values are its
// whole key rows included: it reads the key pages as its value pages); the
// MLA kernel (mla_decode_block) for a value head dim of its own (MLA's
// 192/128, absorbed MLA's 576/512 with the values in the key rows) and for
// wider heads. The choice depends on H and Hv only, never on whether the
// values have pages of their own, so that the workspace, which the contract
// sizes from H and the value_head_dim attribute, is the plan's either way.
#pragma once

#include <cstdint>

#include "params/decode_plan.h"
#include "params/paged_attention.h"

namespace jaxops::params {

// Key (and query) head dim and value head dim the CUDA kernels take.
constexpr int64_t kCudaPagedAttentionMaxHeadDim = kCudaMlaDecodeMaxHeadDim;
constexpr int64_t kCudaPagedAttentionMaxValueHeadDim = kCudaMlaDecodeMaxValueHeadDim;
using PagedAttentionPlan = DecodePlan;

inline int64_t paged_attention_rows(const PagedAttentionParams& p) {
  return p.num_kv_heads > 0 ? p.q_len * (p.num_heads / p.num_kv_heads) : 0;
}

// Whether the call takes the MLA kernel (else the decode kernel).
inline bool paged_attention_takes_mla_kernel(const PagedAttentionParams& p) {
  return paged_value_head_dim(p) != p.head_dim || p.head_dim > kCudaDecodeMaxHeadDim;
}

// The plan with (up to) `splits` key splits.
inline DecodePlan paged_attention_plan_with_splits(const PagedAttentionParams& p,
                                                   int64_t splits) {
  const int64_t capacity = p.max_pages_per_seq * p.page_size;
  if (paged_attention_takes_mla_kernel(p)) {
    return mla_decode_plan_with_splits(paged_attention_rows(p), capacity, splits);
  }
  return decode_plan_with_splits(paged_attention_rows(p), capacity, p.head_dim, splits);
}

// The plan the CUDA launcher takes when it is handed a workspace.
inline DecodePlan paged_attention_plan(const PagedAttentionParams& p) {
  const int64_t capacity = p.max_pages_per_seq * p.page_size;
  if (paged_attention_takes_mla_kernel(p)) {
    return mla_decode_plan(p.batch * p.num_kv_heads, paged_attention_rows(p), capacity);
  }
  return decode_plan(p.batch * p.num_kv_heads, paged_attention_rows(p), capacity, p.head_dim);
}

// Bytes of the float32 workspace of `plan` (0 without splits): partial
// outputs of Hv floats a row.
inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p,
                                               const DecodePlan& plan) {
  return decode_workspace_bytes(p.batch * p.num_kv_heads, paged_value_head_dim(p), plan);
}

inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p) {
  return paged_attention_workspace_bytes(p, paged_attention_plan(p));
}

}  // namespace jaxops::params
