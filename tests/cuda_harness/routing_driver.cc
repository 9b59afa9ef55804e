// Test-only: runs the CUDA router kernels (cuda/routing.cu, compiled by the
// harness) on the shapes given on the command line, in float32, bfloat16 and
// float16, for both scores, with and without renormalisation and bias, and
// checks them against a double-precision reference: the chosen experts exactly,
// the weights, the JVP and the backward (also with out-of-range expert ids,
// which the kernels clamp). Built under AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_routing_sanitizers.py, where what matters most is that
// the sanitizers stay silent; each buffer is its own exact-size allocation.
//
// usage: routing_driver TOKENSxEXPERTS/K[/GROUPS/GROUP_TOPK] ...   exit status 0 when all agree
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/routing.h"
#include "driver_common.h"

namespace {

using jaxops::params::RouterScore;
using jaxops::params::RouterShape;

void compare(const std::string& what, const float* actual, const std::vector<double>& expected,
             double tol) {
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!(std::fabs(actual[i] - expected[i]) <= tol * (1.0 + std::fabs(expected[i])))) {
      std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i,
                   static_cast<double>(actual[i]), expected[i]);
      ++g_failures;
      return;
    }
  }
}

std::vector<double> scores_of(const std::vector<double>& x, int64_t experts, RouterScore kind) {
  std::vector<double> p(x.size());
  for (size_t row = 0; row < x.size() / experts; ++row) {
    const double* xr = &x[row * experts];
    double max = *std::max_element(xr, xr + experts), sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) {
      p[row * experts + e] = kind == RouterScore::kSigmoid ? 1.0 / (1.0 + std::exp(-xr[e]))
                                                           : std::exp(xr[e] - max);
      sum += p[row * experts + e];
    }
    if (kind == RouterScore::kSoftmax) {
      for (int64_t e = 0; e < experts; ++e) p[row * experts + e] /= sum;
    }
  }
  return p;
}

// The indices of `keys` in selection order (higher first, ties to the lower index).
std::vector<int64_t> ranked(const std::vector<double>& keys, const std::vector<int64_t>& among) {
  std::vector<int64_t> order = among;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys[a] > keys[b]; });
  return order;
}

// The reference's experts of one row.
std::vector<int64_t> select_row(const double* p, const float* bias, const RouterShape& s) {
  std::vector<double> keys(s.experts);
  for (int64_t e = 0; e < s.experts; ++e) keys[e] = p[e] + (bias ? bias[e] : 0.0);
  std::vector<int64_t> among;
  const int64_t size = s.experts / s.num_groups;
  std::vector<double> group_keys(s.num_groups);
  for (int64_t g = 0; g < s.num_groups; ++g) {
    std::vector<int64_t> members(size);
    std::iota(members.begin(), members.end(), g * size);
    const auto best = ranked(keys, members);
    group_keys[g] = keys[best[0]] + (size > 1 ? keys[best[1]] : 0.0);
  }
  std::vector<int64_t> groups(s.num_groups);
  std::iota(groups.begin(), groups.end(), 0);
  const auto kept = ranked(group_keys, groups);
  for (int64_t i = 0; i < s.group_topk; ++i) {
    for (int64_t e = kept[i] * size; e < (kept[i] + 1) * size; ++e) among.push_back(e);
  }
  std::sort(among.begin(), among.end());
  auto order = ranked(keys, among);
  order.resize(s.k);
  return order;
}

int64_t clamp_id(int32_t id, int64_t experts) {
  return std::min<int64_t>(std::max<int64_t>(id, 0), experts - 1);
}

template <typename T>
void run(const RouterShape& base, std::mt19937& rng) {
  const int64_t tokens = base.tokens, experts = base.experts, k = base.k;
  const size_t n = static_cast<size_t>(tokens * experts), nk = static_cast<size_t>(tokens * k);
  std::normal_distribution<float> normal(0.f, 1.5f);
  Buffer<T> logits(n), dlogits(n), dx(n);
  Buffer<float> bias(experts), weights(nk), dweights(nk), g(nk);
  Buffer<int32_t> ids(nk), bad_ids(nk);
  std::vector<double> x(n), t(n);
  for (size_t i = 0; i < n; ++i) {
    logits.data[i] = T(normal(rng));
    dlogits.data[i] = T(normal(rng));
    x[i] = static_cast<float>(logits.data[i]);
    t[i] = static_cast<float>(dlogits.data[i]);
  }
  for (int64_t e = 0; e < experts; ++e) bias.data[e] = 0.05f * normal(rng);
  for (size_t i = 0; i < nk; ++i) g.data[i] = normal(rng);
  for (int kind = 0; kind < 2; ++kind) {
    for (int flags = 0; flags < 4; ++flags) {
      RouterShape s = base;
      s.score = static_cast<RouterScore>(kind);
      s.renormalize = flags & 1;
      const float* b = (flags & 2) ? bias.data : nullptr;
      const std::string what = std::string(type_name<T>()) + " " + std::to_string(tokens) + "x" +
                               std::to_string(experts) + "/" + std::to_string(k) + " score " +
                               std::to_string(kind) + " flags " + std::to_string(flags);
      const auto p = scores_of(x, experts, s.score);
      check(jaxops::cuda::topk_router_fwd<T>(nullptr, logits.data, b, weights.data, ids.data, s),
            "fwd " + what);
      std::vector<double> w_ref(nk);
      for (int64_t r = 0; r < tokens; ++r) {
        const auto chosen = select_row(&p[r * experts], b, s);
        double sum = 0.0;
        for (int64_t j = 0; j < k; ++j) sum += p[r * experts + chosen[j]];
        for (int64_t j = 0; j < k; ++j) {
          if (ids.data[r * k + j] != chosen[j]) {
            std::fprintf(stderr, "FAIL fwd experts %s: row %lld choice %lld is %d, expected %lld\n",
                         what.c_str(), static_cast<long long>(r), static_cast<long long>(j),
                         ids.data[r * k + j], static_cast<long long>(chosen[j]));
            ++g_failures;
          }
          w_ref[r * k + j] = p[r * experts + chosen[j]] / (s.renormalize ? sum : 1.0);
        }
      }
      compare("fwd weights " + what, weights.data, w_ref, 2e-5);
      // The derivatives for the kernel's ids, then for ids out of range.
      for (size_t i = 0; i < nk; ++i) bad_ids.data[i] = ids.data[i] + (i % 3 == 0 ? experts : 0) - (i % 5 == 0 ? 3 * experts : 0);
      for (const Buffer<int32_t>* chosen : {&ids, &bad_ids}) {
        std::vector<double> dw_ref(nk), dx_ref(n, 0.0);
        for (int64_t r = 0; r < tokens; ++r) {
          const double* pr = &p[r * experts];
          const double* tr = &t[r * experts];
          double mean_t = 0.0, sum = 0.0, dsum = 0.0, gw = 0.0;
          for (int64_t e = 0; e < experts; ++e) mean_t += pr[e] * tr[e];
          std::vector<double> dp(k);
          for (int64_t j = 0; j < k; ++j) {
            const int64_t e = clamp_id(chosen->data[r * k + j], experts);
            dp[j] = kind == 0 ? pr[e] * (tr[e] - mean_t) : pr[e] * (1 - pr[e]) * tr[e];
            sum += pr[e];
            dsum += dp[j];
          }
          for (int64_t j = 0; j < k; ++j) {
            const int64_t e = clamp_id(chosen->data[r * k + j], experts);
            dw_ref[r * k + j] = s.renormalize ? (dp[j] - pr[e] / sum * dsum) / sum : dp[j];
            gw += g.data[r * k + j] * pr[e] / sum;
          }
          double c = 0.0;
          std::vector<double> gs(k);
          for (int64_t j = 0; j < k; ++j) {
            gs[j] = s.renormalize ? (g.data[r * k + j] - gw) / sum : g.data[r * k + j];
            c += gs[j] * pr[clamp_id(chosen->data[r * k + j], experts)];
          }
          for (int64_t e = 0; e < experts; ++e) dx_ref[r * experts + e] = kind == 0 ? -pr[e] * c : 0.0;
          for (int64_t j = 0; j < k; ++j) {
            const int64_t e = clamp_id(chosen->data[r * k + j], experts);
            dx_ref[r * experts + e] += (kind == 0 ? pr[e] : pr[e] * (1 - pr[e])) * gs[j];
          }
        }
        const std::string which = (chosen == &ids ? " " : " clamped ") + what;
        check(jaxops::cuda::topk_router_jvp<T>(nullptr, logits.data, chosen->data, dlogits.data,
                                               dweights.data, s),
              "jvp" + which);
        compare("jvp" + which, dweights.data, dw_ref, 1e-4);
        check(jaxops::cuda::topk_router_bwd<T>(nullptr, g.data, logits.data, chosen->data, dx.data,
                                               s),
              "bwd" + which);
        std::vector<float> dx_float(n);
        for (size_t i = 0; i < n; ++i) dx_float[i] = static_cast<float>(dx.data[i]);
        compare("bwd" + which, dx_float.data(), dx_ref,
                std::is_same<T, float>::value ? 1e-4 : (std::is_same<T, __half>::value ? 2e-3 : 1.6e-2));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  for (int i = 1; i < argc; ++i) {
    long long tokens = 0, experts = 0, k = 0, groups = 1, group_topk = 1;
    const int read = std::sscanf(argv[i], "%lldx%lld/%lld/%lld/%lld", &tokens, &experts, &k,
                                 &groups, &group_topk);
    if (read < 3 || read == 4 || tokens < 1 || experts < 1 || k < 1 || groups < 1 ||
        experts % groups != 0 || group_topk < 1 || group_topk > groups ||
        k > group_topk * (experts / groups)) {
      std::fprintf(stderr, "bad shape %s (TOKENSxEXPERTS/K[/GROUPS/GROUP_TOPK])\n", argv[i]);
      return 2;
    }
    const RouterShape shape{tokens, experts, k, RouterScore::kSoftmax, true, groups, group_topk};
    run<float>(shape, rng);
    run<__nv_bfloat16>(shape, rng);
    run<__half>(shape, rng);
  }
  std::printf("%s: %d failure(s)\n", argv[0], g_failures);
  return g_failures == 0 ? 0 : 1;
}
