// Standalone test of the decode core (cpu/kv_decode.h) against a naive
// double-precision loop, through a row source the Python tests do not reach:
// rows scattered in pages (the paged cache's layout: a tile's rows are
// uniformly strided only inside a page), int8 rows with per-row scales, the
// logits soft cap, empty and partial per-row key intervals, and key splits
// across threads (one group on four threads) with their merge, which must be
// deterministic; few rows (cpu/kv_decode_few_rows.h on AVX-512 and AVX2, else
// a dot product per row and key) and a full vector of rows (products with the rows
// along the lanes); walks of several groups (DecodeShape::groups_per_walk);
// the pair kernels (cpu/kv_decode_pairs.h, where the CPU has AVX512_VNNI or
// AVX512_BF16) and the kernels they replace. Every element type (float,
// bfloat16: the AVX512_BF16 dot path where the CPU has it, float16, int8).
// Prints "ALL PASSED" and exits 0
// when every case passes (tests/test_cpp_kernels.py builds and runs it).
#include "cpu/kv_decode.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using jaxops::cpu::bfloat16;
using jaxops::cpu::float16;
namespace kd = jaxops::cpu::kv_decode;

int failures = 0;

template <typename E>
E quantize(float x) {
  if constexpr (std::is_same_v<E, int8_t>) {
    return static_cast<int8_t>(std::lround(std::clamp(x * 40.0f, -127.0f, 127.0f)));
  } else {
    return static_cast<E>(x);
  }
}
template <typename E>
double dequantize(E x, float scale) {
  if constexpr (std::is_same_v<E, int8_t>) return static_cast<double>(x) * scale;
  else return static_cast<double>(static_cast<float>(x));
}

// Keys of one kv head in pages of page_size rows, the pages in shuffled order.
// Value rows are v_stride apart (their own head dim), or are the key rows'
// first features (v == k, v_stride == stride: absorbed MLA).
template <typename E>
struct PagedRows {
  using Element = E;
  const E* k;
  const E* v;
  const float* k_scale;
  const float* v_scale;
  const int64_t* page_of;  // logical page -> physical page
  int64_t page_size, stride, v_stride;
  int64_t slot(int64_t j) const { return page_of[j / page_size] * page_size + j % page_size; }
  const E* key(int64_t j) const { return k + slot(j) * stride; }
  const E* value(int64_t j) const { return v + slot(j) * v_stride; }
  void key_scales(int64_t j, int64_t n, float* out) const {
    for (int64_t i = 0; i < n; ++i) out[i] = k_scale[slot(j + i)];
  }
  void value_scales(int64_t j, int64_t n, float* out) const {
    for (int64_t i = 0; i < n; ++i) out[i] = v_scale[slot(j + i)];
  }
  int64_t uniform_stride(int64_t j, int64_t n) const {
    return j / page_size == (j + n - 1) / page_size ? stride : 0;
  }
  int64_t uniform_value_stride(int64_t j, int64_t n) const {
    return j / page_size == (j + n - 1) / page_size ? v_stride : 0;
  }
  int64_t run_length(int64_t j, int64_t n) const {
    return std::min(n, page_size - j % page_size);
  }
};

struct Case {
  int64_t groups, rows, keys, H, page_size;
  float soft_cap;
  int threads;
  int64_t walk = 1;  // DecodeShape::groups_per_walk
  int64_t Hv = -1;    // the value head dim (-1: H)
  bool in_keys = false;  // the values are the keys' first Hv features
  int64_t value_dim() const { return Hv >= 0 ? Hv : H; }
};

template <typename E>
struct Groups {
  using Source = PagedRows<E>;
  const Case& c;
  const std::vector<float>& q;            // [groups][rows][H]
  const std::vector<int64_t>& begin;      // [groups][rows]
  const std::vector<int64_t>& end;
  const std::vector<Source>& sources;     // [groups]
  std::vector<float>* out;                // [groups][rows][Hv]
  std::vector<float>* lse;                // [groups][rows]

  Source setup(int64_t g, float* qf, int64_t ld, int64_t* b, int64_t* e) const {
    for (int64_t i = 0; i < c.rows; ++i) {
      kd::load_query_row(q.data() + (g * c.rows + i) * c.H, qf + i * ld, c.H, ld);
      b[i] = begin[g * c.rows + i];
      e[i] = end[g * c.rows + i];
    }
    return sources[g];
  }
  void store(int64_t g, int64_t i, const float* row, float l) const {
    // (std::copy: with head_dim 0 the rows are empty and data() may be null,
    // which memcpy may not be given.)
    const int64_t Hv = c.value_dim();
    std::copy(row, row + Hv, out->begin() + (g * c.rows + i) * Hv);
    (*lse)[g * c.rows + i] = l;
  }
};

// Bitwise equality (NaNs included); empty vectors are equal.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The reference for query row q over keys [begin, end) of src, in Real
// (double: the reference; float: how far a plain float32 loop gets): the
// normalised output row into o (0 for no key), the natural-log logsumexp
// returned (-inf for no key).
template <typename Real, typename E>
Real reference_row(const Case& c, const kd::DecodeShape& shape, const PagedRows<E>& src,
                   const float* q, int64_t begin, int64_t end, Real* o) {
  std::vector<Real> logit;
  Real m = -std::numeric_limits<Real>::infinity();
  for (int64_t j = begin; j < end; ++j) {
    Real dot = 0;
    for (int64_t h = 0; h < c.H; ++h) {
      dot += q[h] * static_cast<Real>(dequantize(src.key(j)[h], src.k_scale[src.slot(j)]));
    }
    Real x = dot * static_cast<Real>(shape.scale);
    if (c.soft_cap > 0) x = c.soft_cap * std::tanh(x / c.soft_cap);
    logit.push_back(x);
    m = std::max(m, x);
  }
  const int64_t Hv = c.value_dim();
  std::fill(o, o + Hv, Real(0));
  Real sum = 0;
  for (int64_t j = begin; j < end; ++j) {
    const Real p = std::exp(logit[j - begin] - m);
    sum += p;
    for (int64_t h = 0; h < Hv; ++h) {
      o[h] += p * static_cast<Real>(dequantize(src.value(j)[h], src.v_scale[src.slot(j)]));
    }
  }
  if (sum == 0) return -std::numeric_limits<Real>::infinity();
  for (int64_t h = 0; h < Hv; ++h) o[h] /= sum;
  return m + std::log(sum);
}

template <typename E>
void run_case(const Case& c, const char* type, double tol, std::mt19937& rng,
              bool pair_kernels = true) {
  std::normal_distribution<float> normal;
  const int64_t pages = kd::ceil_div(c.keys, c.page_size);
  const int64_t slots = pages * c.page_size;
  // One cache per group, pages shuffled.
  std::vector<std::vector<E>> k(c.groups), v(c.groups);
  std::vector<std::vector<float>> ks(c.groups), vs(c.groups);
  std::vector<std::vector<int64_t>> page_of(c.groups);
  std::vector<PagedRows<E>> sources;
  const int64_t Hv = c.value_dim();
  for (int64_t g = 0; g < c.groups; ++g) {
    k[g].resize(slots * c.H);
    v[g].resize(slots * Hv);
    for (auto& x : k[g]) x = quantize<E>(normal(rng));
    for (auto& x : v[g]) x = quantize<E>(normal(rng));
    ks[g].resize(slots);
    vs[g].resize(slots);
    for (auto& x : ks[g]) x = std::is_same_v<E, int8_t> ? 0.01f + 0.04f * std::abs(normal(rng)) : 1.0f;
    for (auto& x : vs[g]) x = std::is_same_v<E, int8_t> ? 0.01f + 0.04f * std::abs(normal(rng)) : 1.0f;
    page_of[g].resize(pages);
    for (int64_t p = 0; p < pages; ++p) page_of[g][p] = p;
    std::shuffle(page_of[g].begin(), page_of[g].end(), rng);
  }
  for (int64_t g = 0; g < c.groups; ++g) {
    if (c.in_keys) {
      sources.push_back({k[g].data(), k[g].data(), ks[g].data(), ks[g].data(),
                         page_of[g].data(), c.page_size, c.H, c.H});
    } else {
      sources.push_back({k[g].data(), v[g].data(), ks[g].data(), vs[g].data(),
                         page_of[g].data(), c.page_size, c.H, Hv});
    }
  }
  // Queries representable in bf16 (the bf16 dot path rounds them).
  std::vector<float> q(c.groups * c.rows * c.H);
  for (auto& x : q) x = static_cast<float>(static_cast<bfloat16>(normal(rng)));
  // Intervals: the full range, a causal-like prefix, a window, an empty row.
  std::vector<int64_t> begin(c.groups * c.rows), end(c.groups * c.rows);
  std::uniform_int_distribution<int64_t> key(0, c.keys);
  for (int64_t r = 0; r < c.groups * c.rows; ++r) {
    switch (r % 4) {
      case 0: begin[r] = 0; end[r] = c.keys; break;
      case 1: begin[r] = 0; end[r] = key(rng); break;
      case 2: {
        const int64_t a = key(rng), b = key(rng);
        begin[r] = std::min(a, b);
        end[r] = std::max(a, b);
        break;
      }
      default: begin[r] = end[r] = r % 8 == 3 ? 0 : c.keys; break;
    }
  }
  kd::DecodeShape shape;
  shape.rows = c.rows;
  shape.head_dim = c.H;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(c.H));
  shape.soft_cap = c.soft_cap;
  shape.groups_per_walk = c.walk;
  shape.pair_kernels = pair_kernels;
  shape.value_dim = c.Hv;

  std::vector<float> out(c.groups * c.rows * Hv), lse(c.groups * c.rows);
  std::vector<float> out2 = out, lse2 = lse;
  std::vector<char> workspace(kd::decode_workspace_bytes(c.groups, shape, c.keys, c.threads));
  const Groups<E> groups{c, q, begin, end, sources, &out, &lse};
  kd::run_decode(groups, c.groups, shape, c.keys, c.threads, workspace.data());
  const Groups<E> again{c, q, begin, end, sources, &out2, &lse2};
  kd::run_decode(again, c.groups, shape, c.keys, c.threads, workspace.data());

  // worst: the kernel's largest error against the double loop; naive: the
  // same loop's in float32. A case passes within tol or within 4 times naive,
  // where float32 itself is further off than tol: int8 rows of H = 576 with
  // outputs up to 15, where the float32 loop is off by 3.7e-5 and the generic
  // kernels (4 lanes: one dot product per row and key, rows along the lanes)
  // by as much (3.5e-5 on aarch64, 3.7e-5 on x86-64-v2); the AVX-512 ones'
  // 16-lane partial sums came to 5.2e-6.
  double worst = 0.0, naive = 0.0;
  bool ok = same_bits(out, out2) && same_bits(lse, lse2);
  if (!ok) std::printf("  not deterministic\n");
  std::vector<double> want(Hv);
  std::vector<float> want_f32(Hv);
  for (int64_t g = 0; g < c.groups; ++g) {
    const PagedRows<E>& src = sources[g];
    for (int64_t i = 0; i < c.rows; ++i) {
      const int64_t r = g * c.rows + i;
      const double want_lse =
          reference_row(c, shape, src, &q[r * c.H], begin[r], end[r], want.data());
      const float want_lse_f32 =
          reference_row(c, shape, src, &q[r * c.H], begin[r], end[r], want_f32.data());
      if (std::isinf(want_lse)) {
        ok = ok && lse[r] == -std::numeric_limits<float>::infinity();
      } else {
        worst = std::max(worst, std::abs(lse[r] - want_lse));
        naive = std::max(naive, std::abs(want_lse_f32 - want_lse));
      }
      for (int64_t h = 0; h < Hv; ++h) {
        worst = std::max(worst, std::abs(out[r * Hv + h] - want[h]));
        naive = std::max(naive, std::abs(want_f32[h] - want[h]));
      }
    }
  }
  ok = ok && worst <= std::max(tol, 4 * naive);
  std::printf("%s %-8s%s groups=%ld rows=%ld keys=%ld H=%ld Hv=%ld%s page=%ld cap=%g threads=%d "
              "walk=%ld: max err %.2e (float32 loop %.2e)\n",
              ok ? "ok  " : "FAIL", type, pair_kernels ? "" : " (no pair kernels)",
              static_cast<long>(c.groups), static_cast<long>(c.rows), static_cast<long>(c.keys),
              static_cast<long>(c.H), static_cast<long>(Hv), c.in_keys ? " (in keys)" : "",
              static_cast<long>(c.page_size), c.soft_cap, c.threads, static_cast<long>(c.walk),
              worst, naive);
  if (!ok) ++failures;
}

// A NaN in one key row makes exactly the rows that attend it NaN: float32
// rows (the general path), float16 rows (the few-rows kernels on AVX-512),
// bfloat16 rows (the pair kernels where the CPU has AVX512_BF16) and int8
// rows, where the NaN is the row's scale (a key scale: the pair kernels'
// scores; a value scale: their values hand the tile to the float32 kernel),
// each with the pair kernels and without.
template <typename E>
void nan_case(const char* type, bool in_value_scale = false, bool pair_kernels = true) {
  const Case c{1, 2, 100, 32, 16, 0.0f, 2};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<E> k(112 * 32, E(0.5f)), v(112 * 32, E(1.0f));
  std::vector<float> k_scale(112, 1.0f), v_scale(112, 1.0f);
  if constexpr (std::is_same_v<E, int8_t>) {
    (in_value_scale ? v_scale : k_scale)[50] = nan;
  } else {
    k[50 * 32 + 3] = E(nan);
  }
  const std::vector<int64_t> page_of = {0, 1, 2, 3, 4, 5, 6};
  const std::vector<PagedRows<E>> sources = {
      {k.data(), v.data(), k_scale.data(), v_scale.data(), page_of.data(), 16, 32, 32}};
  const std::vector<float> q(2 * 32, 0.25f);
  const std::vector<int64_t> begin = {0, 0}, end = {100, 50};
  std::vector<float> out(2 * 32), lse(2);
  kd::DecodeShape shape{2, 32, 1.0f, 0.0f};
  shape.pair_kernels = pair_kernels;
  std::vector<char> workspace(kd::decode_workspace_bytes(1, shape, 100, 2));
  kd::run_decode(Groups<E>{c, q, begin, end, sources, &out, &lse}, 1, shape, 100, 2,
                 workspace.data());
  // A NaN value scale leaves the scores and so the log-sum-exp finite; row 1,
  // which does not attend key 50, is not checked then: its probability 0
  // meets the NaN scale in the same tile (0 * NaN), on every path.
  const bool ok = in_value_scale
                      ? std::isnan(out[0]) && std::isfinite(lse[0]) && std::isfinite(lse[1])
                      : std::isnan(out[0]) && std::isnan(lse[0]) &&
                            std::abs(out[32] - 1.0f) < 1e-6f && std::isfinite(lse[1]);
  std::printf("%s %-8s nan propagation%s%s\n", ok ? "ok  " : "FAIL", type,
              in_value_scale ? " (value scale)" : "", pair_kernels ? "" : " (no pair kernels)");
  if (!ok) ++failures;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  const Case cases[] = {
      // groups, rows, keys, H, page, cap, threads
      {3, 4, 77, 128, 16, 0.0f, 2},    // tiles cross pages: converted rows
      {2, 12, 300, 64, 64, 0.0f, 2},   // tiles inside pages: rows read in place
      {1, 4, 1000, 128, 32, 0.0f, 4},  // one group, keys split across 4 threads
      {1, 32, 600, 32, 256, 30.0f, 4}, // T = 8 x G = 4, soft cap, splits
      {2, 1, 1, 17, 1, 5.0f, 1},       // one key, odd head_dim
      {5, 3, 45, 20, 8, 0.0f, 3},
      {2, 16, 200, 64, 8, 0.0f, 2},    // rows along the lanes, tiles crossing pages
      // The few-rows kernels (1 to 8 rows, head_dim a multiple of 16, AVX-512):
      // every row count, head dims of 1 to 16 chunks (uneven value blocks),
      // key counts that end a tile inside a score group, page sizes 1, 3, 5
      // and 7, next-tile prefetches up to the last key.
      {2, 1, 33, 64, 1, 0.0f, 2},
      {2, 2, 70, 32, 5, 0.0f, 2},
      {3, 3, 1, 32, 1, 0.0f, 1},
      {3, 5, 129, 48, 7, 10.0f, 2},
      {1, 6, 95, 96, 16, 0.0f, 1},
      {2, 7, 31, 256, 3, 0.0f, 2},
      {2, 8, 513, 128, 16, 0.0f, 2},
      {1, 8, 777, 16, 32, 0.0f, 3},
      // Head dims of whole 8-element chunks but not 16 (the AVX2 kernels of
      // cpu/kv_decode_few_rows_avx2.h; the general path with AVX-512): odd
      // chunk counts, value blocks of uneven chunks, a value dim of its own.
      {2, 1, 40, 8, 3, 0.0f, 1},
      {2, 3, 70, 24, 5, 0.0f, 2},
      {1, 8, 100, 40, 16, 5.0f, 2},
      {2, 5, 65, 56, 16, 0.0f, 2, 2, 24},
      {1, 12, 90, 72, 8, 0.0f, 2},
      // Walks (groups_per_walk): the keys of several groups a tile at a time,
      // one walk split across threads, walks of every thread, a width that
      // does not divide the groups (each group alone then).
      {4, 4, 300, 128, 16, 0.0f, 2, 4},
      {6, 2, 100, 64, 8, 0.0f, 3, 3},
      {8, 8, 513, 128, 16, 5.0f, 2, 2},
      {3, 16, 90, 32, 4, 0.0f, 2, 3},
      {5, 4, 50, 32, 4, 0.0f, 2, 2},
      // head_dim 0 (empty rows: the logits are 0), walked and split.
      {2, 4, 40, 0, 8, 0.0f, 2, 2},
      // A value head dim of its own (MLA 192/128; wider values than keys;
      // an odd one) and values that are the keys' first features (absorbed
      // MLA 576/512, every path: few rows, sliced rows, rows along the
      // lanes, splits, walks).
      {2, 4, 300, 192, 16, 0.0f, 2, 2, 128},
      {2, 16, 100, 192, 16, 0.0f, 2, 1, 128},
      {2, 3, 77, 32, 8, 0.0f, 2, 1, 64},
      {1, 2, 50, 48, 5, 0.0f, 1, 1, 17},
      {2, 4, 300, 576, 16, 0.0f, 2, 2, 512, true},
      {1, 16, 600, 576, 64, 0.0f, 4, 1, 512, true},
      {2, 1, 513, 576, 1, 0.0f, 2, 2, 512, true},
      {1, 20, 100, 96, 16, 0.0f, 2, 1, 80, true},
  };
  for (const Case& c : cases) {
    run_case<float>(c, "float32", 2e-5, rng);
    run_case<bfloat16>(c, "bfloat16", 2e-2, rng);
    run_case<float16>(c, "float16", 2e-5, rng);
    // int8 on the pair kernels (AVX512_VNNI): the queries in 16-bit fixed
    // point put ~2^-16 of max|q| * sum|k| into each logit (cpu/kv_decode_pairs.h).
    run_case<int8_t>(c, "int8", 1e-3, rng);
    // Without the pair kernels where they would run: the float32 few-rows
    // kernels (int8), the bfloat16 dot path's general kernels (bfloat16).
    run_case<bfloat16>(c, "bfloat16", 2e-2, rng, false);
    run_case<int8_t>(c, "int8", 2e-5, rng, false);
  }
  nan_case<float>("float32");
  nan_case<float16>("float16");
  for (const bool pair_kernels : {true, false}) {
    nan_case<bfloat16>("bfloat16", false, pair_kernels);
    nan_case<int8_t>("int8", false, pair_kernels);
    nan_case<int8_t>("int8", true, pair_kernels);
  }
  if (failures == 0) {
    std::printf("ALL PASSED\n");
    return 0;
  }
  std::printf("%d FAILED\n", failures);
  return 1;
}
