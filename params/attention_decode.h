// When jaxops.attention's CUDA forward takes the decode kernels
// (cuda/attention_decode.h, on cuda/kv_decode.cuh) instead of the tiled
// flash-attention kernel, and the workspace of their split-K. Host code with
// no CUDA in it: the FFI contract sizes the forward's workspace result from
// the operand shapes with it (xla_ffi/attention_common.h), and the CUDA
// handler chooses the kernel with it.
//
// Decode applies to the calls whose T * G query rows per kv head fit one tile
// of the decode kernel (T new tokens of a GQA group: every key and value row
// is then read once for the group), without a bias or mask operand (the
// decode kernel's masks are the causal limit, the windows and the sequence
// lengths), for head dims up to params::kCudaDecodeMaxHeadDim.
#pragma once

#include <cstdint>

#include "params/decode_plan.h"

namespace jaxops::params {

inline bool attention_decode_applies(int64_t q_len, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, bool has_bias, bool has_mask) {
  if (has_bias || has_mask || num_kv_heads <= 0 || head_dim > kCudaDecodeMaxHeadDim) {
    return false;
  }
  const int64_t rows = q_len * (num_heads / num_kv_heads);
  return rows >= 1 && rows <= decode_max_rows_per_tile(head_dim);
}

// The plan of a decode over B sequences of S keys.
inline DecodePlan attention_decode_plan(int64_t batch, int64_t q_len, int64_t kv_len,
                                        int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim) {
  return decode_plan(batch * num_kv_heads, q_len * (num_heads / num_kv_heads), kv_len, head_dim);
}

// The CUDA forward's workspace in bytes: the decode's split-K partials when
// decode applies and splits, else 0.
inline int64_t attention_fwd_workspace_bytes(int64_t batch, int64_t q_len, int64_t kv_len,
                                             int64_t num_heads, int64_t num_kv_heads,
                                             int64_t head_dim, bool has_bias, bool has_mask) {
  if (!attention_decode_applies(q_len, num_heads, num_kv_heads, head_dim, has_bias, has_mask)) {
    return 0;
  }
  return decode_workspace_bytes(
      batch * num_kv_heads, head_dim,
      attention_decode_plan(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim));
}

}  // namespace jaxops::params
