// Test-only: runs the CUDA paged attention kernels (cuda/paged_attention.cu,
// compiled by the harness) on the shapes given on the command line, for every
// (query, page) type pair (float32, bfloat16, float16 pages; int8 pages with
// scales under float32, bfloat16 and float16 queries), and checks every
// result against a double-precision reference that follows
// params/paged_attention.h:
//   - attention without key splits (no workspace), with three splits and with
//     the default plan (split-K merged by the second kernel, the workspace
//     exactly sized), and without a logsumexp; block tables holding page ids
//     below 0 and past the last page (clamped), kv_lens of 0, part of the
//     capacity, the capacity and beyond it (clamped), and for T > 1 query_lens
//     of T, 1, beyond T and beyond kv_len (clamped); GQA; rows that see no key;
//   - paged_kv_update with padding slots (-1, past the last slot), a slot
//     named twice (the later token lands), a copy for float pages, the int8
//     quantization rule bit for bit (scales included, rows with NaN and
//     infinities as the reference quantizes them),
//     every other slot untouched;
//   - value pages of a head dim Hv of their own, and no value pages at all
//     (the values are the first Hv features of the key rows, scaled by the
//     key scales: absorbed MLA), for attention (the MLA kernel) and update
//     (keys only);
//   - params the launchers reject (head dim above the limit, a value head dim
//     above its limit, int8 pages without scales) return
//     cudaErrorInvalidValue without launching.
// Built under AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_paged_attention_sanitizers.py: each buffer is its
// own exact-size allocation, so a read past any page, table or tile is caught.
//
// usage: paged_attention_driver BxTxNxKxHxPSxM[w][s][vHV][k] ...   (page size
// PS, M pages per sequence; w: window_left 3; s: logits soft cap 5; vHV: value
// head dim HV; k: the values in the key rows)
// exit status 0 when all agree
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/paged_attention.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;
namespace params = jaxops::params;

struct Shape {
  int64_t B, T, N, K, H, page_size, M;
  bool window, soft_cap;
  int64_t Hv;     // the value head dim
  bool in_keys;   // the values are the first Hv features of the key rows
};

std::string shape_name(const Shape& s) {
  return std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.N) + "x" +
         std::to_string(s.K) + "x" + std::to_string(s.H) + "x" + std::to_string(s.page_size) +
         "x" + std::to_string(s.M) + (s.window ? "w" : "") + (s.soft_cap ? "s" : "") +
         (s.Hv != s.H ? "v" + std::to_string(s.Hv) : "") + (s.in_keys ? "k" : "");
}

template <typename KV>
const char* page_type_name() {
  if (std::is_same<KV, int8_t>::value) return "int8";
  return type_name<KV>();
}

// Random elements of a type and the doubles they hold: normals for the float
// types, integers in [-127, 127] for int8.
template <typename T>
T random_element(std::mt19937& rng) {
  if constexpr (std::is_same<T, int8_t>::value) {
    return static_cast<int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng));
  } else {
    return T(std::normal_distribution<float>(0.f, 1.f)(rng));
  }
}

template <typename T>
void fill(Buffer<T>& buffer, std::mt19937& rng) {
  for (size_t i = 0; i < buffer.size; ++i) buffer.data[i] = random_element<T>(rng);
}

template <typename T>
double value_of(T v) {
  return static_cast<double>(static_cast<float>(v));
}

// The cache and its tables for one shape: page ids with out-of-range entries,
// and kv_lens / query_lens that take every clamping branch.
struct Cache {
  Cache(const Shape& s, std::mt19937& rng)
      : num_pages(s.B * s.M > 1 ? s.B * s.M - 1 : 1),
        block_tables(s.B * s.M),
        kv_lens(s.B),
        query_lens(s.B) {
    const int64_t capacity = s.M * s.page_size;
    std::uniform_int_distribution<int32_t> page(0, static_cast<int32_t>(num_pages - 1));
    for (int64_t i = 0; i < s.B * s.M; ++i) block_tables.data[i] = page(rng);
    block_tables.data[0] = -3;  // clamped to page 0
    block_tables.data[s.B * s.M - 1] = static_cast<int32_t>(num_pages + 5);  // to the last page
    const int64_t kv_choices[4] = {capacity, 0, capacity / 2 + 1, capacity + 7};
    const int64_t q_choices[4] = {s.T, 1, s.T + 3, s.T - 1};
    for (int64_t b = 0; b < s.B; ++b) {
      kv_lens.data[b] = static_cast<int32_t>(s.B == 1 ? capacity - 1 : kv_choices[b % 4]);
      query_lens.data[b] = static_cast<int32_t>(q_choices[b % 4]);
    }
  }
  int64_t num_pages;
  Buffer<int32_t> block_tables, kv_lens, query_lens;
};

template <typename Q, typename KV>
struct Problem {
  Problem(const Shape& shape, const Cache& cache, std::mt19937& rng)
      : s(shape),
        page_elements(cache.num_pages * s.page_size * s.K * s.H),
        query(s.B * s.T * s.N * s.H),
        key_pages(page_elements),
        value_pages(s.in_keys ? 0 : cache.num_pages * s.page_size * s.K * s.Hv),
        key_scales(kQuantized ? cache.num_pages * s.page_size * s.K : 0),
        value_scales(s.in_keys ? 0 : key_scales.size) {
    fill(query, rng);
    fill(key_pages, rng);
    fill(value_pages, rng);
    std::uniform_real_distribution<float> scale(0.002f, 0.02f);
    for (size_t i = 0; i < key_scales.size; ++i) key_scales.data[i] = scale(rng);
    for (size_t i = 0; i < value_scales.size; ++i) value_scales.data[i] = scale(rng);
    name = std::string(type_name<Q>()) + "/" + page_type_name<KV>() + " " + shape_name(s);
    p.batch = s.B;
    p.q_len = s.T;
    p.num_heads = s.N;
    p.num_kv_heads = s.K;
    p.head_dim = s.H;
    p.value_head_dim = s.Hv;
    p.values_in_keys = s.in_keys;
    p.num_pages = cache.num_pages;
    p.page_size = s.page_size;
    p.max_pages_per_seq = s.M;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.H)));
    p.logits_soft_cap = s.soft_cap ? 5.0f : 0.0f;
    p.window_left = s.window ? 3 : -1;
    p.block_tables = cache.block_tables.data;
    p.kv_lens = cache.kv_lens.data;
    p.query_lens = s.T > 1 ? cache.query_lens.data : nullptr;
    p.key_scales = kQuantized ? key_scales.data : nullptr;
    p.value_scales = kQuantized && !s.in_keys ? value_scales.data : nullptr;
    reference();
  }

  static constexpr bool kQuantized = std::is_same<KV, int8_t>::value;

  // Element h of token j's row (of `width` elements) of kv head k in
  // sequence b, dequantized.
  double page_value(const Buffer<KV>& pages, const Buffer<float>& scales, int64_t width,
                    int64_t b, int64_t j, int64_t k, int64_t h) const {
    const int64_t row = (params::paged_page_id(p, b, j) * s.page_size + j % s.page_size) * s.K + k;
    const double scale = kQuantized ? scales.data[row] : 1.0;
    return value_of(pages.data[row * width + h]) * scale;
  }

  void reference() {
    out_r.assign(s.B * s.T * s.N * s.Hv, 0.0);
    lse_r.assign(s.B * s.N * s.T, -INFINITY);
    const int64_t group = s.N / s.K;
    for (int64_t b = 0; b < s.B; ++b) {
      const int64_t kv_len = params::paged_kv_len(p, b), q_len = params::paged_query_len(p, b);
      for (int64_t n = 0; n < s.N; ++n) {
        for (int64_t t = 0; t < q_len; ++t) {
          const int64_t position = kv_len - q_len + t;
          std::vector<double> logit(kv_len, -INFINITY);
          for (int64_t j = 0; j <= position; ++j) {
            if (p.window_left >= 0 && j < position - p.window_left) continue;
            double dot = 0.0;
            for (int64_t h = 0; h < s.H; ++h) {
              dot += value_of(query.data[((b * s.T + t) * s.N + n) * s.H + h]) *
                     page_value(key_pages, key_scales, s.H, b, j, n / group, h);
            }
            double x = dot * p.scale;
            if (s.soft_cap) x = p.logits_soft_cap * std::tanh(x / p.logits_soft_cap);
            logit[j] = x;
          }
          lse_r[(b * s.N + n) * s.T + t] = attend_row(
              logit, s.Hv,
              [&](int64_t j, int64_t h) {
                return s.in_keys ? page_value(key_pages, key_scales, s.H, b, j, n / group, h)
                                 : page_value(value_pages, value_scales, s.Hv, b, j, n / group, h);
              },
              &out_r[((b * s.T + t) * s.N + n) * s.Hv]);
        }
      }
    }
  }

  // One launch with `plan` (null: the launcher's own, with or without a
  // workspace), checked against the reference.
  void run(const std::string& how, const cuda::PagedAttentionPlan* plan, bool with_workspace,
           bool with_lse) {
    Buffer<Q> out(s.B * s.T * s.N * s.Hv);
    Buffer<float> lse(s.B * s.N * s.T);
    for (size_t i = 0; i < lse.size; ++i) lse.data[i] = NAN;
    const size_t bytes = plan != nullptr ? cuda::paged_attention_workspace_bytes(p, *plan)
                                         : (with_workspace ? cuda::paged_attention_workspace_bytes(p) : 0);
    Buffer<unsigned char> workspace(bytes);
    void* ws = plan != nullptr ? (bytes > 0 ? workspace.data : nullptr)
                               : (with_workspace ? workspace.data : nullptr);
    float* lse_ptr = with_lse ? lse.data : nullptr;
    const cudaError_t status =
        plan != nullptr
            ? cuda::launch_paged_attention<Q, KV>(nullptr, p, *plan, query.data, key_pages.data,
                                                  value_pages.data, out.data, lse_ptr, ws)
            : cuda::launch_paged_attention<Q, KV>(nullptr, p, query.data, key_pages.data,
                                                  value_pages.data, out.data, lse_ptr, ws);
    check(status, name + " " + how);
    if (status != cudaSuccess) return;
    compare_with_reference(name + " " + how + " out", out.data, out_r, attention_tolerance<Q>());
    if (with_lse) compare_with_reference(name + " " + how + " logsumexp", lse.data, lse_r, 1e-4);
  }

  Shape s;
  int64_t page_elements;
  Buffer<Q> query;
  Buffer<KV> key_pages, value_pages;
  Buffer<float> key_scales, value_scales;
  params::PagedAttentionParams p;
  std::vector<double> out_r, lse_r;
  std::string name;
};

template <typename Q, typename KV>
void run_attention(const Shape& s, const Cache& cache, std::mt19937& rng) {
  Problem<Q, KV> problem(s, cache, rng);
  problem.run("unsplit", nullptr, false, true);
  const cuda::PagedAttentionPlan three = cuda::paged_attention_plan_with_splits(problem.p, 3);
  problem.run("3 splits", &three, true, true);
  problem.run("default plan", nullptr, true, true);
  problem.run("3 splits, no logsumexp", &three, true, false);
}

// paged_kv_update of 2 * B + 5 tokens, three of them padding, two with NaN and
// infinities in their rows, into a copy of the problem's pages.
template <typename In, typename KV>
void run_update(const Shape& s, const Cache& cache, std::mt19937& rng) {
  constexpr bool kQuantized = std::is_same<KV, int8_t>::value;
  const std::string name = std::string("kv_update ") + type_name<In>() + "/" +
                           page_type_name<KV>() + " " + std::to_string(s.K) + "x" +
                           std::to_string(s.H) + "x" + std::to_string(s.page_size) +
                           (s.Hv != s.H ? "v" + std::to_string(s.Hv) : "") +
                           (s.in_keys ? "k" : "");
  params::PagedKvUpdateParams p;
  p.num_tokens = 2 * s.B + 5;
  p.num_kv_heads = s.K;
  p.head_dim = s.H;
  p.value_head_dim = s.Hv;
  p.values_in_keys = s.in_keys;
  p.num_pages = cache.num_pages;
  p.page_size = s.page_size;
  // No value rows (nor pages) where the values are in the keys.
  const int64_t Hv = s.in_keys ? 0 : s.Hv;
  const int64_t slots = p.num_pages * p.page_size, row = s.K * s.H, value_row = s.K * Hv;
  Buffer<In> key(p.num_tokens * row), value(p.num_tokens * value_row);
  fill(key, rng);
  fill(value, rng);
  for (int64_t h = 0; h < s.H; ++h) key.data[3 * row + h] = In(0.0f);  // all zero: scale 0
  // Non-finite rows (int8 pages: a NaN scale and zeros; an inf scale and zeros).
  const int64_t special = p.num_tokens - 3;
  key.data[special * row + s.H - 1] = In(NAN);
  key.data[(special + 1) * row + (s.K - 1) * s.H] = In(-INFINITY);
  if (Hv > 0) {
    value.data[special * value_row] = In(INFINITY);
    value.data[special * value_row + Hv - 1] = In(-INFINITY);
    value.data[(special + 1) * value_row + (s.K - 1) * Hv] = In(NAN);
    value.data[(special + 1) * value_row + s.K * Hv - 1] = In(INFINITY);
  }
  Buffer<int32_t> slot_mapping(p.num_tokens);
  std::vector<int32_t> order(slots);
  for (int64_t i = 0; i < slots; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    slot_mapping.data[i] = i < slots ? order[i] : -1;  // distinct slots (no race)
  }
  slot_mapping.data[3] = slot_mapping.data[0];  // token 3 lands, token 0 does not
  slot_mapping.data[1] = -1;
  slot_mapping.data[2] = static_cast<int32_t>(slots);
  slot_mapping.data[p.num_tokens - 1] = -7;
  const int64_t elements = slots * row, value_elements = slots * value_row;
  Buffer<KV> key_pages(elements), value_pages(value_elements);
  fill(key_pages, rng);
  fill(value_pages, rng);
  Buffer<float> key_scales(kQuantized ? slots * s.K : 0),
      value_scales(kQuantized && !s.in_keys ? slots * s.K : 0);
  for (size_t i = 0; i < key_scales.size; ++i) key_scales.data[i] = -1.f;
  for (size_t i = 0; i < value_scales.size; ++i) value_scales.data[i] = -1.f;
  std::vector<KV> key_expected(key_pages.data, key_pages.data + elements);
  std::vector<KV> value_expected(value_pages.data, value_pages.data + value_elements);
  std::vector<float> key_scales_expected(key_scales.data, key_scales.data + key_scales.size);
  std::vector<float> value_scales_expected(value_scales.data,
                                           value_scales.data + value_scales.size);
  auto write = [&](const In* src, KV* dst, float* scale, int64_t width) {
    if constexpr (kQuantized) {
      // jaxops.reference.quantize_int8_rows: NaN propagates into max|x|; a NaN
      // quotient (inf / inf) converts to 0.
      float amax = 0.0f;
      for (int64_t h = 0; h < width; ++h) {
        const float a = std::fabs(static_cast<float>(src[h]));
        if (a > amax || std::isnan(a)) amax = a;
      }
      *scale = amax / 127.0f;
      for (int64_t h = 0; h < width; ++h) {
        const float q = *scale > 0.0f ? std::nearbyint(static_cast<float>(src[h]) / *scale) : 0.0f;
        dst[h] = std::isnan(q) ? 0 : static_cast<int8_t>(std::min(std::max(q, -127.0f), 127.0f));
      }
    } else {
      (void)scale;
      std::copy(src, src + width, dst);
    }
  };
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    const int64_t slot = slot_mapping.data[i];
    if (slot < 0 || slot >= slots) continue;
    for (int64_t k = 0; k < s.K; ++k) {
      const int64_t to = slot * s.K + k;
      write(key.data + (i * s.K + k) * s.H, key_expected.data() + to * s.H,
            kQuantized ? &key_scales_expected[to] : nullptr, s.H);
      if (Hv > 0) {
        write(value.data + (i * s.K + k) * Hv, value_expected.data() + to * Hv,
              kQuantized ? &value_scales_expected[to] : nullptr, Hv);
      }
    }
  }
  const cudaError_t status = cuda::launch_paged_kv_update<In, KV>(
      nullptr, p, key.data, s.in_keys ? nullptr : value.data, slot_mapping.data, key_pages.data,
      s.in_keys ? nullptr : value_pages.data, kQuantized ? key_scales.data : nullptr,
      kQuantized && !s.in_keys ? value_scales.data : nullptr);
  check(status, name);
  if (status != cudaSuccess) return;
  const bool same =
      std::memcmp(key_pages.data, key_expected.data(), elements * sizeof(KV)) == 0 &&
      std::memcmp(value_pages.data, value_expected.data(), value_elements * sizeof(KV)) == 0 &&
      std::memcmp(key_scales.data, key_scales_expected.data(), key_scales.size * sizeof(float)) ==
          0 &&
      std::memcmp(value_scales.data, value_scales_expected.data(),
                  value_scales.size * sizeof(float)) == 0;
  if (!same) {
    std::fprintf(stderr, "FAIL %s: pages or scales differ from the reference\n", name.c_str());
    ++g_failures;
  }
}

template <typename Q, typename KV>
void run_pair(const Shape& s, const Cache& cache, std::mt19937& rng) {
  run_attention<Q, KV>(s, cache, rng);
  run_update<Q, KV>(s, cache, rng);
}

// What the launchers refuse before launching anything.
void run_rejections(const Shape& s, const Cache& cache, std::mt19937& rng) {
  Problem<float, float> problem(s, cache, rng);
  params::PagedAttentionParams p = problem.p;
  p.head_dim = cuda::kCudaPagedAttentionMaxHeadDim + 1;
  if (cuda::launch_paged_attention<float, float>(nullptr, p, problem.query.data,
                                                 problem.key_pages.data, problem.value_pages.data,
                                                 nullptr, nullptr, nullptr) != cudaErrorInvalidValue) {
    std::fprintf(stderr, "FAIL head dim %lld accepted\n", static_cast<long long>(p.head_dim));
    ++g_failures;
  }
  p = problem.p;
  p.value_head_dim = cuda::kCudaPagedAttentionMaxValueHeadDim + 1;
  p.values_in_keys = false;
  const cudaError_t wide = cuda::launch_paged_attention<float, float>(
      nullptr, p, problem.query.data, problem.key_pages.data, problem.key_pages.data, nullptr,
      nullptr, nullptr);
  if (wide != cudaErrorInvalidValue) {
    std::fprintf(stderr, "FAIL value head dim %lld accepted\n",
                 static_cast<long long>(p.value_head_dim));
    ++g_failures;
  }
  const int8_t* no_pages = nullptr;
  if (cuda::launch_paged_attention<float, int8_t>(nullptr, problem.p, problem.query.data, no_pages,
                                                  no_pages, nullptr, nullptr, nullptr) !=
      cudaErrorInvalidValue) {
    std::fprintf(stderr, "FAIL int8 pages without scales accepted\n");
    ++g_failures;
  }
}

bool parse(const std::string& text, Shape* s) {
  long long v[7];
  char flags[17] = {0};
  const int n = std::sscanf(text.c_str(), "%lldx%lldx%lldx%lldx%lldx%lldx%lld%16s", &v[0], &v[1],
                            &v[2], &v[3], &v[4], &v[5], &v[6], flags);
  if (n < 7 || v[3] <= 0 || v[2] % v[3] != 0 || v[0] <= 0 || v[5] <= 0 || v[6] <= 0) return false;
  const std::string f(flags);
  const size_t at = f.find('v');
  const long long hv = at == std::string::npos ? v[4] : std::atoll(f.c_str() + at + 1);
  const bool in_keys = f.find('k') != std::string::npos;
  if (hv < 0 || (in_keys && hv > v[4])) return false;
  *s = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], f.find('w') != std::string::npos,
        f.find('s') != std::string::npos, hv, in_keys};
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  return run_shapes<Shape>(argc, argv, parse, [](const Shape& s, std::mt19937& rng, int index) {
    const Cache cache(s, rng);
    run_pair<float, float>(s, cache, rng);
    run_pair<__nv_bfloat16, __nv_bfloat16>(s, cache, rng);
    run_pair<__half, __half>(s, cache, rng);
    run_pair<float, int8_t>(s, cache, rng);
    run_pair<__nv_bfloat16, int8_t>(s, cache, rng);
    run_pair<__half, int8_t>(s, cache, rng);
    if (index == 0) run_rejections(s, cache, rng);
  });
}
