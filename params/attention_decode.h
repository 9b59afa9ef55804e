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
// lengths), for head dims up to params::kCudaDecodeMaxHeadDim on the decode
// kernel; a value head dim of its own (MLA's 192/128) takes the MLA kernel.
#pragma once

#include <cstdint>

#include "params/decode_plan.h"

namespace jaxops::params {

// Which decode kernel: the MLA kernel (cuda/kv_decode.cuh's
// mla_decode_block, tiles of kMlaDecodeMaxRowsPerTile rows at every width)
// for a value head dim of its own or heads above kCudaDecodeMaxHeadDim (up to
// kCudaMlaDecodeMaxHeadDim / kCudaMlaDecodeMaxValueHeadDim), else the decode
// kernel (decode_block). H and Hv only, as paged attention's choice
// (params/paged_attention_plan.h).
inline bool attention_decode_takes_mla_kernel(int64_t head_dim, int64_t value_head_dim) {
  return value_head_dim != head_dim || head_dim > kCudaDecodeMaxHeadDim;
}

inline int64_t attention_decode_max_rows_per_tile(int64_t head_dim, int64_t value_head_dim) {
  return attention_decode_takes_mla_kernel(head_dim, value_head_dim)
             ? kMlaDecodeMaxRowsPerTile
             : decode_max_rows_per_tile(head_dim);
}

// Shapes and operands only (the contract sizes the workspace with it): no
// bias or mask operand, T * G rows in one tile of the kernel, head dims the
// kernel takes. The handler adds no segment ids (segments take the tiled
// kernel, leaving the workspace unused).
inline bool attention_decode_applies(int64_t q_len, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t value_head_dim, bool has_bias,
                                     bool has_mask) {
  if (has_bias || has_mask || num_kv_heads <= 0) return false;
  if (attention_decode_takes_mla_kernel(head_dim, value_head_dim)) {
    if (head_dim > kCudaMlaDecodeMaxHeadDim || value_head_dim > kCudaMlaDecodeMaxValueHeadDim ||
        head_dim <= 0 || value_head_dim <= 0) {
      return false;
    }
  } else if (head_dim > kCudaDecodeMaxHeadDim) {
    return false;
  }
  const int64_t rows = q_len * (num_heads / num_kv_heads);
  return rows >= 1 && rows <= attention_decode_max_rows_per_tile(head_dim, value_head_dim);
}

inline bool attention_decode_applies(int64_t q_len, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, bool has_bias, bool has_mask) {
  return attention_decode_applies(q_len, num_heads, num_kv_heads, head_dim, head_dim, has_bias,
                                  has_mask);
}

// The plan of a decode over B sequences of S keys.
inline DecodePlan attention_decode_plan(int64_t batch, int64_t q_len, int64_t kv_len,
                                        int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t value_head_dim) {
  const int64_t groups = batch * num_kv_heads, rows = q_len * (num_heads / num_kv_heads);
  if (attention_decode_takes_mla_kernel(head_dim, value_head_dim)) {
    return mla_decode_plan(groups, rows, kv_len);
  }
  return decode_plan(groups, rows, kv_len, head_dim);
}

inline DecodePlan attention_decode_plan(int64_t batch, int64_t q_len, int64_t kv_len,
                                        int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim) {
  return attention_decode_plan(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim,
                               head_dim);
}

// The CUDA forward's workspace in bytes: the decode's split-K partials (Hv
// floats a row) when decode applies and splits, else 0.
inline int64_t attention_fwd_workspace_bytes(int64_t batch, int64_t q_len, int64_t kv_len,
                                             int64_t num_heads, int64_t num_kv_heads,
                                             int64_t head_dim, int64_t value_head_dim,
                                             bool has_bias, bool has_mask) {
  if (!attention_decode_applies(q_len, num_heads, num_kv_heads, head_dim, value_head_dim,
                                has_bias, has_mask)) {
    return 0;
  }
  return decode_workspace_bytes(batch * num_kv_heads, value_head_dim,
                                attention_decode_plan(batch, q_len, kv_len, num_heads,
                                                      num_kv_heads, head_dim, value_head_dim));
}

inline int64_t attention_fwd_workspace_bytes(int64_t batch, int64_t q_len, int64_t kv_len,
                                             int64_t num_heads, int64_t num_kv_heads,
                                             int64_t head_dim, bool has_bias, bool has_mask) {
  return attention_fwd_workspace_bytes(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim,
                                       head_dim, has_bias, has_mask);
}

}  // namespace jaxops::params
