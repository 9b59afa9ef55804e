// The CPU kernels of the paged KV cache (cpu/paged_attention.h).
//
// paged_attention_fwd runs on the decode core (cpu/kv_decode.h), shared with
// jaxops.attention's decode path: one group per (sequence, kv head) holds the
// T * G query rows of that kv head (GQA: the group's heads read every K/V row
// once), each row limited to its own key interval (causal at the end of the
// sequence, left window); the core splits a group's keys across threads when
// there are fewer groups than threads (batch 1) and merges the partial
// softmax states deterministically. What is paged is the row source: key j of
// a sequence is read through its block table, page ids clamped.
#include "cpu/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/kv_decode.h"

namespace jaxops::cpu {
namespace {

using params::paged_kv_len;
using params::paged_page_id;
using params::paged_query_len;
using params::paged_slot_valid;

// Key j of kv head kh of sequence b, read through its block table (the
// decode core's row source concept). Rows are uniformly strided (K * H
// elements apart, value rows K * Hv) within a page only. With the values in
// the keys (absorbed MLA) value j is key j's row, and its scale key j's.
template <typename KV>
struct PagedKvRows {
  using Element = KV;
  const PagedAttentionParams* p;
  const KV* k;
  const KV* v;
  int64_t b;
  int64_t kh;

  // Row (page, offset, kh) of the [P, page_size, K] rows.
  int64_t row(int64_t j) const {
    return (paged_page_id(*p, b, j) * p->page_size + j % p->page_size) * p->num_kv_heads + kh;
  }
  const KV* key(int64_t j) const { return k + row(j) * p->head_dim; }
  const KV* value(int64_t j) const {
    return p->values_in_keys ? key(j) : v + row(j) * params::paged_value_head_dim(*p);
  }
  void key_scales(int64_t j, int64_t n, float* out) const { scales(p->key_scales, j, n, out); }
  void value_scales(int64_t j, int64_t n, float* out) const {
    scales(p->values_in_keys ? p->key_scales : p->value_scales, j, n, out);
  }
  int64_t uniform_stride(int64_t j, int64_t n) const {
    return one_page(j, n) ? p->num_kv_heads * p->head_dim : 0;
  }
  int64_t uniform_value_stride(int64_t j, int64_t n) const {
    const int64_t row_elements =
        p->values_in_keys ? p->head_dim : params::paged_value_head_dim(*p);
    return one_page(j, n) ? p->num_kv_heads * row_elements : 0;
  }
  int64_t run_length(int64_t j, int64_t n) const {
    return std::min(n, p->page_size - j % p->page_size);
  }

 private:
  bool one_page(int64_t j, int64_t n) const {
    return j / p->page_size == (j + n - 1) / p->page_size;
  }
  // A page's scales of one kv head are K apart: one row lookup per page.
  void scales(const float* all, int64_t j, int64_t n, float* out) const {
    for (int64_t i = 0; i < n;) {
      const int64_t len = run_length(j + i, n - i);
      const float* first = all + row(j + i);
      for (int64_t t = 0; t < len; ++t) out[i + t] = first[t * p->num_kv_heads];
      i += len;
    }
  }
};

// The core's groups: (sequence, kv head) pairs, rows t-major over the kv
// head's G query heads. Query row t < query_len sits at position
// kv_len - query_len + t and attends [max(0, position - window), position];
// padding rows t >= query_len attend nothing (output 0, log-sum-exp -inf).
template <typename Q, typename KV>
struct PagedDecodeGroups {
  using Source = PagedKvRows<KV>;
  const PagedAttentionParams& p;
  const Q* query;
  const KV* key_pages;
  const KV* value_pages;
  Q* out;
  float* logsumexp;

  Source setup(int64_t group, float* q, int64_t ld, int64_t* begin, int64_t* end) const {
    const int64_t K = p.num_kv_heads, G = p.num_heads / K, H = p.head_dim;
    const int64_t b = group / K, kh = group % K;
    const int64_t kv_len = paged_kv_len(p, b), q_len = paged_query_len(p, b);
    for (int64_t i = 0; i < p.q_len * G; ++i) {
      const int64_t t = i / G, n = kh * G + i % G;
      kv_decode::load_query_row(query + ((b * p.q_len + t) * p.num_heads + n) * H, q + i * ld, H,
                                ld);
      const int64_t position = kv_len - q_len + t;
      const bool valid = t < q_len;
      begin[i] = !valid || p.window_left < 0 ? 0 : std::max<int64_t>(0, position - p.window_left);
      end[i] = valid ? position + 1 : 0;
    }
    return Source{&p, key_pages, value_pages, b, kh};
  }

  void store(int64_t group, int64_t i, const float* row, float lse) const {
    const int64_t K = p.num_kv_heads, G = p.num_heads / K;
    const int64_t b = group / K, kh = group % K, t = i / G, n = kh * G + i % G;
    const int64_t Hv = params::paged_value_head_dim(p);
    store_row(row, out + ((b * p.q_len + t) * p.num_heads + n) * Hv, Hv);
    logsumexp[(b * p.num_heads + n) * p.q_len + t] = lse;
  }
};

// Symmetric int8 quantization of one row (params/paged_attention.h's rule),
// bit for bit the reference's (jaxops.reference.quantize_int8_rows): a NaN in
// the row makes max|x| and the scale NaN and the row zeros; an infinity makes
// the scale inf, the finite elements 0 and the infinite ones inf / inf = NaN,
// which converts to 0 as XLA converts NaN to an integer.
template <typename Src>
void quantize_row(const Src* src, int8_t* dst, float* scale, float* buffer, int64_t n) {
  load_row(src, buffer, n);
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(buffer[i]);
    if (a > amax || std::isnan(a)) amax = a;  // a NaN max stays NaN
  }
  const float sc = amax / 127.0f;
  *scale = sc;
  for (int64_t i = 0; i < n; ++i) {
    const float q = sc > 0.0f ? std::nearbyint(buffer[i] / sc) : 0.0f;
    dst[i] = std::isnan(q) ? 0 : static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
  }
}

template <typename Src, typename Page>
void write_row(const Src* src, Page* dst, float* scale, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<Page, int8_t>) {
    quantize_row(src, dst, scale, buffer, n);
  } else {
    (void)scale;
    (void)buffer;
    std::memcpy(dst, src, sizeof(Src) * n);
  }
}

}  // namespace

template <typename Q, typename KV>
void paged_attention_fwd(const PagedAttentionParams& p, const Q* query, const KV* key_pages,
                         const KV* value_pages, Q* out, float* logsumexp) {
  const int64_t groups = p.batch * p.num_kv_heads;
  if (groups == 0 || p.q_len == 0) return;
  kv_decode::DecodeShape shape;
  shape.rows = p.q_len * (p.num_heads / p.num_kv_heads);
  shape.head_dim = p.head_dim;
  shape.value_dim = params::paged_value_head_dim(p);
  shape.scale = p.scale;
  shape.soft_cap = p.logits_soft_cap;
  // A page holds key j of every kv head in one block: a sequence's heads are
  // walked together.
  shape.groups_per_walk = p.num_kv_heads;
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
  const int64_t max_keys = p.max_pages_per_seq * p.page_size;
  std::vector<unsigned char> workspace(
      kv_decode::decode_workspace_bytes(groups, shape, max_keys, threads));
  const PagedDecodeGroups<Q, KV> paged{p, query, key_pages, value_pages, out, logsumexp};
  kv_decode::run_decode(paged, groups, shape, max_keys, threads, workspace.data());
}

template <typename Src, typename Page>
void paged_kv_update(const PagedKvUpdateParams& p, const Src* key, const Src* value,
                     const int32_t* slot_mapping, Page* key_pages, Page* value_pages,
                     float* key_scales, float* value_scales) {
  const int64_t K = p.num_kv_heads, H = p.head_dim, Hv = params::paged_value_head_dim(p);
  // Heads are disjoint memory, so threads split them; each writes the tokens in
  // order, which makes the last token of a repeated slot win.
#pragma omp parallel if (K > 1 && p.num_tokens * K * H >= (int64_t{1} << 15))
  {
    std::vector<float> buffer(std::max(H, Hv));
#pragma omp for schedule(static)
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = 0; i < p.num_tokens; ++i) {
        const int64_t slot = slot_mapping[i];
        if (!paged_slot_valid(p, slot)) continue;
        const int64_t row = slot * K + k;
        write_row(key + (i * K + k) * H, key_pages + row * H,
                  key_scales ? key_scales + row : nullptr, buffer.data(), H);
        if (p.values_in_keys) continue;  // absorbed MLA: no value pages
        write_row(value + (i * K + k) * Hv, value_pages + row * Hv,
                  value_scales ? value_scales + row : nullptr, buffer.data(), Hv);
      }
    }
  }
}

#define JAXOPS_PAGED_INSTANTIATE(Q)                                                         \
  template void paged_attention_fwd<Q, Q>(const PagedAttentionParams&, const Q*, const Q*,   \
                                          const Q*, Q*, float*);                            \
  template void paged_attention_fwd<Q, int8_t>(const PagedAttentionParams&, const Q*,        \
                                               const int8_t*, const int8_t*, Q*, float*);   \
  template void paged_kv_update<Q, Q>(const PagedKvUpdateParams&, const Q*, const Q*,        \
                                      const int32_t*, Q*, Q*, float*, float*);              \
  template void paged_kv_update<Q, int8_t>(const PagedKvUpdateParams&, const Q*, const Q*,   \
                                           const int32_t*, int8_t*, int8_t*, float*, float*);
JAXOPS_PAGED_INSTANTIATE(float)
JAXOPS_PAGED_INSTANTIATE(bfloat16)
JAXOPS_PAGED_INSTANTIATE(float16)
#undef JAXOPS_PAGED_INSTANTIATE

}  // namespace jaxops::cpu
