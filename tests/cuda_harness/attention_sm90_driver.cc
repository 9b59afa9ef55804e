// Test-only: runs the sm_90a FlashAttention-3 forward (cuda/attention_forward_sm90.cu,
// hopper_fwd) in the CPU harness, with wgmma, TMA and mbarriers emulated and
// their hazards checked (an accumulator read before its wait_group, a TMA
// destination read before its phase completed, a product without a fence, a
// deadlock), on the shapes given on the command line, in bfloat16 and float16,
// against a double-precision reference of every output element and every
// logsumexp (-inf exactly for rows that attend nothing).
//
// Every shape runs with sequence lengths (q_len - b % 2, kv_len - b % 3), and
// the keys, values and query rows past them hold NaN: the kernel must mask
// the keys and zero the values it loads but no row attends (a NaN must not
// meet a zero probability), and rows past the length must give 0 and -inf.
// The shape's suffix letters add: c the causal mask with query_offset S - T
// (S - T + 5 with o), w a window (left 37, right 3), f the soft cap 2 and
// segment ids (documents of 5 positions; the first query row of each batch
// in a document with no key). The count of emulated wgmma products is
// checked against the key tiles the CTAs' rows can see (whole tiles that the
// limits exclude must be skipped). Also checked: hopper_fwd_supports refuses
// float32, a mask, a bias, H != Hv, H > 128 and H not a multiple of 8.
//
// usage: attention_sm90_driver BxTxSxNxKxH[cowf] ...     exit status 0 when all agree
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_kernels.h"
#include "driver_common.h"

extern "C" unsigned long long jaxops_harness_wgmmas(int kind);

namespace {

namespace cuda = jaxops::cuda;
namespace kernels = jaxops::cuda::attention_kernels;
namespace params = jaxops::params;

struct Shape {
  int64_t B, T, S, N, K, H;
  bool causal, more_offset, window, features;
};

constexpr double kSoftCap = 2.0;
constexpr int64_t kWindowLeft = 37, kWindowRight = 3;
constexpr int64_t kBlockM = 128, kBlockN = 128;

template <typename T>
void run_shape(const Shape& s, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t nq = s.B * s.T * s.N * s.H, nk = s.B * s.S * s.K * s.H;
  std::vector<int32_t> q_lengths(s.B), kv_lengths(s.B), q_ids(s.B * s.T), kv_ids(s.B * s.S);
  std::vector<int32_t> offset(1, static_cast<int32_t>(s.S - s.T + (s.more_offset ? 5 : 0)));
  for (int64_t b = 0; b < s.B; ++b) {
    q_lengths[b] = static_cast<int32_t>(s.T - b % 2);
    kv_lengths[b] = static_cast<int32_t>(s.S - b % 3);
    for (int64_t j = 0; j < s.S; ++j) kv_ids[b * s.S + j] = static_cast<int32_t>((j + b) / 5);
    for (int64_t t = 0; t < s.T; ++t) {
      q_ids[b * s.T + t] = t == 0 ? -1 : static_cast<int32_t>((t + offset[0] + b) / 5);
    }
  }
  // Exact-size buffers (ASan), NaN past the lengths.
  Buffer<T> q(nq), k(nk), v(nk), out(nq);
  Buffer<float> lse(s.B * s.N * s.T);
  std::vector<double> qd(nq), kd(nk), vd(nk);
  const float nan = std::nanf("");
  for (size_t i = 0; i < nq; ++i) {
    const int64_t b = static_cast<int64_t>(i / (s.T * s.N * s.H)), t = i / (s.N * s.H) % s.T;
    q.data[i] = T(t < q_lengths[b] ? normal(rng) : nan);
    qd[i] = static_cast<float>(q.data[i]);
  }
  for (size_t i = 0; i < nk; ++i) {
    const int64_t b = static_cast<int64_t>(i / (s.S * s.K * s.H)), j = i / (s.K * s.H) % s.S;
    const bool valid = j < kv_lengths[b];
    k.data[i] = T(valid ? normal(rng) : nan);
    v.data[i] = T(valid ? normal(rng) : nan);
    kd[i] = static_cast<float>(k.data[i]);
    vd[i] = static_cast<float>(v.data[i]);
  }
  for (size_t i = 0; i < nq; ++i) out.data[i] = T(nan);

  params::AttentionParams p;
  p.batch = s.B;
  p.q_len = s.T;
  p.kv_len = s.S;
  p.num_heads = s.N;
  p.num_kv_heads = s.K;
  p.head_dim = s.H;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.H)));
  p.is_causal = s.causal;
  p.query_offset = offset.data();
  p.q_seq_lengths = q_lengths.data();
  p.kv_seq_lengths = kv_lengths.data();
  if (s.window) {
    p.window_left = kWindowLeft;
    p.window_right = kWindowRight;
  }
  if (s.features) {
    p.logits_soft_cap = static_cast<float>(kSoftCap);
    p.q_segment_ids = q_ids.data();
    p.kv_segment_ids = kv_ids.data();
  }
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(s.B) + "x" +
                           std::to_string(s.T) + "x" + std::to_string(s.S) + "x" +
                           std::to_string(s.N) + "x" + std::to_string(s.K) + "x" +
                           std::to_string(s.H) + (s.causal ? "c" : "") +
                           (s.more_offset ? "o" : "") + (s.window ? "w" : "") +
                           (s.features ? "f" : "");
  const kernels::HopperDtype dtype = std::is_same<T, __half>::value
                                         ? kernels::HopperDtype::kFloat16
                                         : kernels::HopperDtype::kBfloat16;
  if (!kernels::hopper_fwd_supports(p, dtype)) {
    std::fprintf(stderr, "FAIL %s: hopper_fwd_supports refused it\n", name.c_str());
    ++g_failures;
    return;
  }
  const int kind = std::is_same<T, __half>::value ? 0 : 1;
  const unsigned long long products_before = jaxops_harness_wgmmas(kind);
  check(kernels::hopper_fwd<T>(nullptr, p, q.data, k.data, v.data, out.data, lse.data), name);
  if (g_failures != 0) return;
  const unsigned long long products = jaxops_harness_wgmmas(kind) - products_before;

  // The reference, and the key tiles each CTA walks (key_range of its 128 rows).
  const auto visible = [&](int64_t b, int64_t t, int64_t j) {
    if (t >= q_lengths[b] || j >= kv_lengths[b]) return false;
    const int64_t pos = t + offset[0];
    if (s.causal && j > pos) return false;
    if (s.window && (j < pos - kWindowLeft || j > pos + kWindowRight)) return false;
    return !s.features || q_ids[b * s.T + t] == kv_ids[b * s.S + j];
  };
  std::vector<double> out_r(nq, 0.0), lse_r(s.B * s.N * s.T);
  std::vector<double> logit(s.S);
  const int64_t group = s.N / s.K;
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t t = 0; t < s.T; ++t) {
        const size_t qrow = ((b * s.T + t) * s.N + n) * s.H;
        for (int64_t j = 0; j < s.S; ++j) {
          const size_t krow = ((b * s.S + j) * s.K + n / group) * s.H;
          if (!visible(b, t, j)) {
            logit[j] = -INFINITY;
            continue;
          }
          double dot = 0.0;
          for (int64_t h = 0; h < s.H; ++h) dot += qd[qrow + h] * kd[krow + h];
          double x = p.scale * dot;
          if (s.features) x = kSoftCap * std::tanh(x / kSoftCap);
          logit[j] = x;
        }
        lse_r[(b * s.N + n) * s.T + t] = attend_row(
            logit, s.H,
            [&](int64_t j, int64_t h) { return vd[((b * s.S + j) * s.K + n / group) * s.H + h]; },
            &out_r[qrow]);
      }
    }
  }
  unsigned long long expected_products = 0;
  const unsigned long long per_tile = 2 * ((s.H <= 64 ? 64 : 128) / 16 + kBlockN / 16);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t t0 = 0; t0 < s.T; t0 += kBlockM) {
      const int64_t t1 = std::min<int64_t>(t0 + kBlockM, q_lengths[b]);
      if (t0 >= t1) continue;
      const int64_t first = t0 + offset[0], last = t1 - 1 + offset[0];
      int64_t lo = 0, hi = kv_lengths[b];
      if (s.causal) hi = std::min(hi, last + 1);
      if (s.window) {
        hi = std::min(hi, last + kWindowRight + 1);
        lo = std::max<int64_t>(lo, first - kWindowLeft);
      }
      if (lo >= hi) continue;
      const int64_t tiles = (hi - lo / kBlockN * kBlockN + kBlockN - 1) / kBlockN;
      expected_products += s.N * tiles * per_tile;
    }
  }
  compare_with_reference(name + " out", out.data, out_r, attention_tolerance<T>());
  compare_with_reference(name + " logsumexp", lse.data, lse_r, 1e-3);
  if (products != expected_products) {
    std::fprintf(stderr, "FAIL %s: %llu wgmma products, expected %llu\n", name.c_str(), products,
                 expected_products);
    ++g_failures;
  }
  std::printf("%s: %llu wgmma products\n", name.c_str(), products);
}

void check_refusals() {
  params::AttentionParams p;
  int32_t offset = 0;
  p.batch = 1;
  p.q_len = 3;
  p.kv_len = 5;
  p.num_heads = 2;
  p.num_kv_heads = 1;
  p.head_dim = 64;
  p.query_offset = &offset;
  const auto expect = [](bool got, bool want, const char* what) {
    if (got != want) {
      std::fprintf(stderr, "FAIL hopper_fwd_supports(%s) is %d\n", what, got);
      ++g_failures;
    }
  };
  const auto bf16 = kernels::HopperDtype::kBfloat16;
  expect(kernels::hopper_fwd_supports(p, bf16), true, "bf16, H 64");
  expect(kernels::hopper_fwd_supports(p, kernels::HopperDtype::kFloat16), true, "f16, H 64");
  expect(kernels::hopper_fwd_supports(p, kernels::HopperDtype::kFloat32), false, "float32");
  params::AttentionParams q = p;
  q.head_dim = 100;  // 200-byte rows: no 16-byte TMA stride
  expect(kernels::hopper_fwd_supports(q, bf16), false, "H 100");
  q.head_dim = 136;
  expect(kernels::hopper_fwd_supports(q, bf16), false, "H 136");
  q = p;
  q.value_head_dim = 32;
  expect(kernels::hopper_fwd_supports(q, bf16), false, "Hv != H");
  q = p;
  const uint8_t mask = 1;
  q.mask = &mask;
  expect(kernels::hopper_fwd_supports(q, bf16), false, "a mask");
  q = p;
  const float bias = 0.f;
  q.bias = &bias;
  expect(kernels::hopper_fwd_supports(q, bf16), false, "a bias");
  q = p;
  q.kv_len = 0;
  expect(kernels::hopper_fwd_supports(q, bf16), false, "no keys");
}

bool parse(const char* arg, Shape* s) {
  char flags[8] = {0};
  long long B, T, S, N, K, H;
  const int got = std::sscanf(arg, "%lldx%lldx%lldx%lldx%lldx%lld%7s", &B, &T, &S, &N, &K, &H, flags);
  if (got < 6 || N % K != 0) return false;
  *s = Shape{B, T, S, N, K, H, false, false, false, false};
  for (const char* f = flags; *f; ++f) {
    switch (*f) {
      case 'c': s->causal = true; break;
      case 'o': s->more_offset = true; break;
      case 'w': s->window = true; break;
      case 'f': s->features = true; break;
      default: return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  check_refusals();
  return run_shapes<Shape>(argc, argv, parse, [](const Shape& s, std::mt19937& rng, int) {
    run_shape<__nv_bfloat16>(s, rng);
    run_shape<__half>(s, rng);
  });
}
