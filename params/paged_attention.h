// The parameters of attention over a paged KV cache (jaxops.paged_attention),
// one struct for the CPU kernel (cpu/paged_attention.h), the CUDA kernel
// (cuda/paged_attention.h) and the FFI handlers that fill it
// (xla_ffi/paged_attention_common.h).
//
// Layouts (row-major):
//   query        [B, T, N, H]   (decode is T = 1)
//   out          [B, T, N, Hv]  (Hv = value_head_dim, H unless given)
//   key pages    [P, page_size, K, H]: float32, bfloat16, float16 or int8
//   value pages  [P, page_size, K, Hv] of the key pages' dtype; or none, when
//                the values are the first Hv <= H features of each key row
//                (values_in_keys: absorbed MLA decode, one cache holding the
//                latent and its rope part, read once for both products)
//   key/value scales [P, page_size, K] float32 (int8 pages only): the real
//                value of element h of token slot s of head k in page p is
//                pages[p, s, k, h] * scales[p, s, k] (values in keys: the
//                key scales serve both)
//   block_tables [B, M] int32: the page holding tokens [i * page_size,
//                (i + 1) * page_size) of sequence b is block_tables[b, i]
//   kv_lens      [B] int32: tokens in sequence b's cache, the new ones included
//   query_lens   [B] int32 or null (null: T for every sequence)
//   logsumexp    [B, N, T] float32 (when asked for)
//
// Masking: query row t < query_lens[b] of sequence b sits at position
// p = kv_lens[b] - query_lens[b] + t (the queries are the last tokens of the
// sequence) and attends keys j with j <= p (causal against the cache) and, when
// window_left >= 0, j >= p - window_left. Rows t >= query_lens[b] give 0 and a
// log-sum-exp of -inf, as do rows that attend no key.
//
// Traced data is clamped, never trusted: kv_lens[b] to [0, M * page_size],
// query_lens[b] to [0, min(T, kv_lens[b])], page ids to [0, P - 1]. So no
// kernel reads outside the buffers it was handed, whatever the data says.
#pragma once

#include <cmath>
#include <cstdint>

#include "params/host_device.h"

namespace jaxops::params {

struct PagedAttentionParams {
  int64_t batch = 0;              // B
  int64_t q_len = 0;              // T
  int64_t num_heads = 0;          // N
  int64_t num_kv_heads = 0;       // K
  int64_t head_dim = 0;           // H: query and key
  int64_t value_head_dim = -1;    // Hv: value and output; -1: H
  // The values are the first Hv features of each key row (absorbed MLA): the
  // value pages and value scales are not operands (null), the key pages'
  // serve both.
  bool values_in_keys = false;
  int64_t num_pages = 0;          // P
  int64_t page_size = 0;
  int64_t max_pages_per_seq = 0;  // M
  float scale = 1.0f;
  float logits_soft_cap = 0.0f;   // > 0: logits = cap * tanh(logits / cap); 0: none
  int64_t window_left = -1;       // -1: unbounded
  // Operands (host memory on the CPU, device memory on CUDA).
  const int32_t* block_tables = nullptr;  // [B, M]
  const int32_t* kv_lens = nullptr;       // [B]
  const int32_t* query_lens = nullptr;    // [B] or null
  const float* key_scales = nullptr;      // [P, page_size, K] for int8 pages, else null
  const float* value_scales = nullptr;
  // CPU only: the OpenMP threads (0: omp_get_max_threads()).
  int num_threads = 0;
};

// Hv: the value and output head dim.
JAXOPS_HOST_DEVICE int64_t paged_value_head_dim(const PagedAttentionParams& p) {
  return p.value_head_dim >= 0 ? p.value_head_dim : p.head_dim;
}

// The clamped number of cached tokens of sequence b.
JAXOPS_HOST_DEVICE int64_t paged_kv_len(const PagedAttentionParams& p, int64_t b) {
  const int64_t n = p.kv_lens[b];
  const int64_t cap = p.max_pages_per_seq * p.page_size;
  return n < 0 ? 0 : (n > cap ? cap : n);
}

// The clamped number of query rows of sequence b (at most T and kv_len).
JAXOPS_HOST_DEVICE int64_t paged_query_len(const PagedAttentionParams& p, int64_t b) {
  const int64_t kv = paged_kv_len(p, b);
  int64_t n = p.query_lens == nullptr ? p.q_len : p.query_lens[b];
  if (n > p.q_len) n = p.q_len;
  if (n > kv) n = kv;
  return n < 0 ? 0 : n;
}

// The clamped page id holding token `token` of sequence b.
JAXOPS_HOST_DEVICE int64_t paged_page_id(const PagedAttentionParams& p, int64_t b,
                                         int64_t token) {
  const int64_t id = p.block_tables[b * p.max_pages_per_seq + token / p.page_size];
  return id < 0 ? 0 : (id >= p.num_pages ? p.num_pages - 1 : id);
}

// nullptr when `p` describes a problem every backend accepts, else the first
// problem found (the handlers check the same rules).
inline const char* paged_attention_params_error(const PagedAttentionParams& p) {
  if (p.batch < 0 || p.q_len < 0 || p.num_heads < 0 || p.num_kv_heads < 0 || p.head_dim < 0 ||
      p.num_pages < 0 || p.page_size < 0 || p.max_pages_per_seq < 0) {
    return "paged_attention: negative dimension";
  }
  if (p.num_kv_heads == 0 ? p.num_heads != 0 : p.num_heads % p.num_kv_heads != 0) {
    return "paged_attention: num_heads must be a multiple of num_kv_heads";
  }
  if (p.batch > 0 && (p.page_size == 0 || p.num_pages == 0 || p.max_pages_per_seq == 0)) {
    return "paged_attention: page_size, num_pages and max_pages_per_seq must be positive";
  }
  if (p.max_pages_per_seq * p.page_size >= (int64_t{1} << 31)) {
    return "paged_attention: max_pages_per_seq * page_size must be below 2^31";
  }
  if (p.value_head_dim < -1) return "paged_attention: value_head_dim must be >= 0 (or -1)";
  if (p.values_in_keys && paged_value_head_dim(p) > p.head_dim) {
    return "paged_attention: values read from the key pages need value_head_dim <= head_dim";
  }
  if (p.window_left < -1) return "paged_attention: window_left must be >= 0 (or -1)";
  if (!std::isfinite(p.scale)) return "paged_attention: scale must be finite";
  if (!(p.logits_soft_cap >= 0.0f) || !std::isfinite(p.logits_soft_cap)) {
    return "paged_attention: logits_soft_cap must be finite and >= 0";
  }
  if (p.batch > 0 && (p.block_tables == nullptr || p.kv_lens == nullptr)) {
    return "paged_attention: block_tables and kv_lens are required";
  }
  if (!p.values_in_keys && (p.key_scales == nullptr) != (p.value_scales == nullptr)) {
    return "paged_attention: key_scales and value_scales come together";
  }
  if (p.num_threads < 0) return "paged_attention: num_threads must be >= 0";
  return nullptr;
}

// jaxops.paged_kv_update: token i's key/value rows ([num_tokens, K, H]) go to
// slot slot_mapping[i] = page * page_size + offset of every page tensor. A slot
// outside [0, P * page_size) (a padding token, e.g. -1) is skipped. A slot
// named by several tokens keeps the last one's rows (and scales): the kernels
// write the tokens of each kv head in token order. For int8
// pages each written row is quantized symmetrically per token and head:
// scale = max|x| / 127 (0 for an all-zero row), q = round(x / scale) in
// [-127, 127], and the scale is written to key_scales/value_scales[page, offset, k].
// Non-finite rows get what jaxops.reference.quantize_int8_rows gives, bit for
// bit: a NaN makes the scale NaN and the row zeros; an infinity (and no NaN)
// makes the scale inf, the finite elements 0 and the infinite ones too (inf /
// inf is NaN, which converts to 0 as XLA converts NaN to an integer).
//
// The value rows are [num_tokens, K, Hv] into value pages [P, page_size, K,
// Hv]; a cache whose values are in its keys (values_in_keys, absorbed MLA)
// has no value pages, and only the key rows are written.
struct PagedKvUpdateParams {
  int64_t num_tokens = 0;    // rows of key/value and entries of slot_mapping
  int64_t num_kv_heads = 0;  // K
  int64_t head_dim = 0;      // H
  int64_t value_head_dim = -1;  // Hv; -1: H
  bool values_in_keys = false;  // no value pages or rows: keys only
  int64_t num_pages = 0;     // P
  int64_t page_size = 0;
};

JAXOPS_HOST_DEVICE int64_t paged_value_head_dim(const PagedKvUpdateParams& p) {
  return p.value_head_dim >= 0 ? p.value_head_dim : p.head_dim;
}

JAXOPS_HOST_DEVICE bool paged_slot_valid(const PagedKvUpdateParams& p, int64_t slot) {
  return slot >= 0 && slot < p.num_pages * p.page_size;
}

inline const char* paged_kv_update_params_error(const PagedKvUpdateParams& p) {
  if (p.num_tokens < 0 || p.num_kv_heads < 0 || p.head_dim < 0 || p.num_pages < 0 ||
      p.page_size < 0 || p.value_head_dim < -1) {
    return "paged_kv_update: negative dimension";
  }
  if (p.num_pages * p.page_size >= (int64_t{1} << 31)) {
    return "paged_kv_update: num_pages * page_size must be below 2^31 (int32 slots)";
  }
  return nullptr;
}

}  // namespace jaxops::params
