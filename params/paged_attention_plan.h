// How the CUDA paged attention (cuda/paged_attention.cu) divides its work:
// the decode plan of params/decode_plan.h with one group per (sequence, kv
// head), the T * (N / K) query rows of a kv head's group, and the capacity
// M * page_size of a sequence as its keys (kv_lens are traced data). Host
// code with no CUDA in it, so that the FFI contract sizes the CUDA workspace
// from the operand shapes alone.
#pragma once

#include <cstdint>

#include "params/decode_plan.h"
#include "params/paged_attention.h"

namespace jaxops::params {

constexpr int64_t kCudaPagedAttentionMaxHeadDim = kCudaDecodeMaxHeadDim;
using PagedAttentionPlan = DecodePlan;

inline int64_t paged_attention_rows(const PagedAttentionParams& p) {
  return p.num_kv_heads > 0 ? p.q_len * (p.num_heads / p.num_kv_heads) : 0;
}

// The plan with (up to) `splits` key splits.
inline DecodePlan paged_attention_plan_with_splits(const PagedAttentionParams& p,
                                                   int64_t splits) {
  return decode_plan_with_splits(paged_attention_rows(p), p.max_pages_per_seq * p.page_size,
                                 p.head_dim, splits);
}

// The plan the CUDA launcher takes when it is handed a workspace.
inline DecodePlan paged_attention_plan(const PagedAttentionParams& p) {
  return decode_plan(p.batch * p.num_kv_heads, paged_attention_rows(p),
                     p.max_pages_per_seq * p.page_size, p.head_dim);
}

// Bytes of the float32 workspace of `plan` (0 without splits).
inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p,
                                               const DecodePlan& plan) {
  return decode_workspace_bytes(p.batch * p.num_kv_heads, p.head_dim, plan);
}

inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p) {
  return paged_attention_workspace_bytes(p, paged_attention_plan(p));
}

}  // namespace jaxops::params
