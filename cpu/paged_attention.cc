// The CPU kernels of the paged KV cache (cpu/paged_attention.h).
//
// paged_attention_fwd: one work item per (sequence, kv head) holds the G * T
// query rows of that kv head (GQA: the group's heads share every K/V row read)
// and walks the keys they attend page by page, through the block table: each
// page's K and V rows are converted (int8: dequantized with their scales) to
// float32 once, then every row takes its logits over the page and updates its
// online-softmax state (running max, sum and unnormalised output).
#include "cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/vector_math.h"

namespace jaxops::cpu {
namespace {

using params::paged_kv_len;
using params::paged_page_id;
using params::paged_query_len;
using params::paged_slot_valid;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Row `h` values of a page row as float32: int8 rows times their scale.
template <typename T>
void load_page_row(const T* src, float scale, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, int8_t>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  } else {
    (void)scale;
    load_row(src, dst, n);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The per-thread buffers of one work item.
struct Scratch {
  std::vector<float> q, acc, m, l, k, v, s;
  std::vector<int64_t> lo, hi;
  Scratch(int64_t rows, int64_t page_size, int64_t H)
      : q(rows * H), acc(rows * H), m(rows), l(rows), k(page_size * H), v(page_size * H),
        s(page_size), lo(rows), hi(rows) {}
};

template <typename Q, typename KV>
void attend_kv_head(const PagedAttentionParams& p, const Q* query, const KV* key_pages,
                    const KV* value_pages, Q* out, float* logsumexp, int64_t b, int64_t kh,
                    Scratch& s) {
  const int64_t T = p.q_len, N = p.num_heads, K = p.num_kv_heads, H = p.head_dim;
  const int64_t G = N / K, ps = p.page_size;
  const int64_t kv_len = paged_kv_len(p, b), q_len = paged_query_len(p, b);
  // Row r = t * G + g is query row t of head kh * G + g; rows t >= q_len are
  // padding (output 0, log-sum-exp -inf).
  const int64_t rows = q_len * G;
  int64_t key_begin = kv_len, key_end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / G, n = kh * G + r % G;
    load_row(query + ((b * T + t) * N + n) * H, s.q.data() + r * H, H);
    const int64_t position = kv_len - q_len + t;
    s.hi[r] = position + 1;
    s.lo[r] = p.window_left < 0 ? 0 : std::max<int64_t>(0, position - p.window_left);
    key_begin = std::min(key_begin, s.lo[r]);
    key_end = std::max(key_end, s.hi[r]);
    s.m[r] = -kInf;
    s.l[r] = 0.0f;
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * H, 0.0f);
  const float cap = p.logits_soft_cap;
  for (int64_t j0 = key_begin; j0 < key_end;) {
    const int64_t page = paged_page_id(p, b, j0);
    const int64_t j1 = std::min(key_end, (j0 / ps + 1) * ps);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t slot = (page * ps + j % ps) * K + kh;
      const float ks = p.key_scales ? p.key_scales[slot] : 1.0f;
      const float vs = p.value_scales ? p.value_scales[slot] : 1.0f;
      load_page_row(key_pages + slot * H, ks, s.k.data() + (j - j0) * H, H);
      load_page_row(value_pages + slot * H, vs, s.v.data() + (j - j0) * H, H);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = std::max(j0, s.lo[r]), e = std::min(j1, s.hi[r]);
      if (a >= e) continue;
      float row_max = s.m[r];
      for (int64_t j = a; j < e; ++j) {
        float logit = dot(s.q.data() + r * H, s.k.data() + (j - j0) * H, H) * p.scale;
        if (cap > 0.0f) logit = cap * std::tanh(logit / cap);
        s.s[j - j0] = logit;
        row_max = std::max(row_max, logit);
      }
      float* acc = s.acc.data() + r * H;
      const float rescale = s.m[r] == -kInf ? 0.0f : vector_math::exp(s.m[r] - row_max);
      float sum = s.l[r] * rescale;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[h] *= rescale;
      for (int64_t j = a; j < e; ++j) {
        const float w = vector_math::exp(s.s[j - j0] - row_max);
        sum += w;
        const float* v = s.v.data() + (j - j0) * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) acc[h] += w * v[h];
      }
      s.m[r] = row_max;
      s.l[r] = sum;
    }
    j0 = j1;
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g, n = kh * G + g;
      Q* o = out + ((b * T + t) * N + n) * H;
      float* lse = logsumexp + (b * N + n) * T + t;
      if (t >= q_len || s.l[r] == 0.0f) {
        std::fill(o, o + H, from_float<Q>(0.0f));
        *lse = -kInf;
        continue;
      }
      const float inv = 1.0f / s.l[r];
      float* acc = s.acc.data() + r * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[h] *= inv;
      store_row(acc, o, H);
      *lse = s.m[r] + std::log(s.l[r]);
    }
  }
}

// Symmetric int8 quantization of one row (params/paged_attention.h's rule).
template <typename Src>
void quantize_row(const Src* src, int8_t* dst, float* scale, float* buffer, int64_t n) {
  load_row(src, buffer, n);
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(buffer[i]));
  const float sc = amax / 127.0f;
  *scale = sc;
  for (int64_t i = 0; i < n; ++i) {
    const float q = sc == 0.0f ? 0.0f : std::nearbyint(buffer[i] / sc);
    dst[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
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
  const int64_t items = p.batch * p.num_kv_heads;
  if (items == 0) return;
  const int64_t rows = p.q_len * (p.num_heads / p.num_kv_heads);
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
    Scratch scratch(rows, p.page_size, p.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      attend_kv_head(p, query, key_pages, value_pages, out, logsumexp, item / p.num_kv_heads,
                     item % p.num_kv_heads, scratch);
    }
  }
}

template <typename Src, typename Page>
void paged_kv_update(const PagedKvUpdateParams& p, const Src* key, const Src* value,
                     const int32_t* slot_mapping, Page* key_pages, Page* value_pages,
                     float* key_scales, float* value_scales) {
  const int64_t K = p.num_kv_heads, H = p.head_dim;
  // Heads are disjoint memory, so threads split them; each writes the tokens in
  // order, which makes the last token of a repeated slot win.
#pragma omp parallel if (K > 1 && p.num_tokens * K * H >= (int64_t{1} << 15))
  {
    std::vector<float> buffer(H);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = 0; i < p.num_tokens; ++i) {
        const int64_t slot = slot_mapping[i];
        if (!paged_slot_valid(p, slot)) continue;
        const int64_t row = slot * K + k;
        write_row(key + (i * K + k) * H, key_pages + row * H,
                  key_scales ? key_scales + row : nullptr, buffer.data(), H);
        write_row(value + (i * K + k) * H, value_pages + row * H,
                  value_scales ? value_scales + row : nullptr, buffer.data(), H);
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
