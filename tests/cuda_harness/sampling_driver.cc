// Test-only: runs the CUDA sampling kernel (cuda/sampling.cu, compiled by the
// harness) on the shapes given on the command line, in float32, bfloat16 and
// float16, with per-row temperature (greedy rows included), top_k, top_p and
// min_p (disabled values included), rows with a NaN, with +inf and with only
// -inf logits, and checks every token against a double-precision oracle: the
// token is in the row's kept set and is the inverse-CDF draw at the row's
// uniform (unless the uniform lies within a rounding error of a boundary).
// Built under AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_sampling_sanitizers.py; each buffer is its own
// exact-size allocation, so a read past any row or parameter array is caught.
//
// usage: sampling_driver BATCHxVOCAB ...     exit status 0 when all agree
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/sampling.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;
namespace params = jaxops::params;

constexpr double kSlack = 1e-4;  // relative mass within which float32 and double may differ

struct Expected {
  int64_t token;              // the double-precision draw (-1: an invalid row)
  std::vector<bool> allowed;  // tokens the float32 arithmetic may return
};

// The kept set for top_p + slack (a superset of what float32 can keep), and
// the draw in double for the exact top_p; `ambiguous` when a boundary is near.
Expected oracle(const std::vector<double>& x, const params::SampleRow& p, bool* ambiguous) {
  const int64_t vocab = static_cast<int64_t>(x.size());
  Expected out{-1, std::vector<bool>(vocab, false)};
  *ambiguous = false;
  std::vector<double> z(vocab), w(vocab);
  double top = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(x[i])) return out;
    z[i] = static_cast<float>(x[i]) / p.temperature;  // the kernels' float32 division
    top = std::max(top, z[i]);
  }
  if (top == -INFINITY) return out;
  for (int64_t i = 0; i < vocab; ++i) {
    w[i] = top == INFINITY ? (z[i] == INFINITY ? 1.0 : 0.0) : std::exp(z[i] - top);
  }
  if (p.greedy) {
    out.token = std::max_element(z.begin(), z.end()) - z.begin();
    out.allowed[out.token] = true;
    return out;
  }
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
  double top_k_mass = 0.0;
  for (int64_t r = 0; r < p.top_k; ++r) top_k_mass += w[order[r]];
  std::vector<bool> exact(vocab, false);
  double before = 0.0;
  for (int64_t r = 0; r < p.top_k; ++r) {
    const int64_t i = order[r];
    const bool in_min_p = w[i] >= p.min_p;
    const bool loose = r == 0 || p.top_p >= 1.f || before < (p.top_p + kSlack) * top_k_mass;
    const bool strict = r == 0 || p.top_p >= 1.f || before < p.top_p * top_k_mass;
    if (loose != strict || std::fabs(w[i] - p.min_p) < 1e-6) *ambiguous = true;
    out.allowed[i] = loose && in_min_p;
    exact[i] = strict && in_min_p;
    before += w[i];
  }
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += exact[i] ? w[i] : 0.0;
  const double target = p.uniform * total;
  double cumulative = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!exact[i]) continue;
    cumulative += w[i];
    if (std::fabs(cumulative - target) < kSlack * total) *ambiguous = true;
    if (cumulative > target && out.token < 0) out.token = i;
  }
  return out;
}

template <typename T>
void run_case(int64_t batch, int64_t vocab, std::mt19937& rng) {
  Buffer<T> logits(batch * vocab);
  Buffer<float> row_floats(batch * params::kRowFloats);
  Buffer<int32_t> top_k(batch), tokens(batch);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<std::vector<double>> rows(batch, std::vector<double>(vocab));
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t c = 0; c < vocab; ++c) {
      float v = r % 3 == 1 ? std::round(normal(rng)) : normal(rng);  // ties on every third row
      if (r % 7 == 3 && c % 5 == 0) v = INFINITY;
      if (r % 7 == 4) v = -INFINITY;
      if (r % 7 == 5 && c == vocab / 2) v = NAN;
      logits.data[r * vocab + c] = T(v);
      rows[r][c] = static_cast<float>(logits.data[r * vocab + c]);
    }
    float* floats = row_floats.data + r * params::kRowFloats;
    floats[params::kUniform] = unit(rng);
    floats[params::kTemperature] = r % 6 == 0 ? 0.f : 0.3f + 1.7f * unit(rng);
    top_k.data[r] = static_cast<int32_t>(rng() % (vocab + 2)) - 1;
    floats[params::kTopP] = r % 4 == 0 ? 1.f : 0.05f + 0.95f * unit(rng);
    floats[params::kMinP] = r % 3 == 0 ? 0.f : 0.4f * unit(rng);
  }
  const params::SampleShape shape{batch, vocab};
  check(cuda::sample<T>(nullptr, logits.data, row_floats.data, top_k.data, tokens.data, shape),
        std::string("sample ") + type_name<T>());
  for (int64_t r = 0; r < batch; ++r) {
    const params::SampleRow p = params::sample_row_params(
        row_floats.data + r * params::kRowFloats, top_k.data[r], vocab);
    bool ambiguous = false;
    const Expected e = oracle(rows[r], p, &ambiguous);
    const int32_t token = tokens.data[r];
    const bool in_set = token >= 0 && token < vocab && e.allowed[token];
    const bool ok = e.token < 0 ? token == -1 : (in_set && (ambiguous || token == e.token));
    if (!ok) {
      std::fprintf(stderr, "FAIL %s %lldx%lld row %lld: token %d, expected %lld\n",
                   type_name<T>(), static_cast<long long>(batch), static_cast<long long>(vocab),
                   static_cast<long long>(r), token, static_cast<long long>(e.token));
      ++g_failures;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(1234);
  for (int a = 1; a < argc; ++a) {
    long long batch = 0, vocab = 0;
    if (std::sscanf(argv[a], "%lldx%lld", &batch, &vocab) != 2) {
      std::fprintf(stderr, "bad shape %s\n", argv[a]);
      return 2;
    }
    run_case<float>(batch, vocab, rng);
    run_case<__nv_bfloat16>(batch, vocab, rng);
    run_case<__half>(batch, vocab, rng);
  }
  if (g_failures) return 3;
  std::printf("sampling: all agree\n");
  return 0;
}
