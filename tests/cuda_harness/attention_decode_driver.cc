// Test-only: runs jaxops.attention's CUDA decode path (cuda/attention_decode.cu
// on cuda/kv_decode.cuh, compiled by the harness) on the shapes given on the
// command line, in float32, bfloat16 and float16, and checks the output and
// log-sum-exp against a double-precision reference that follows
// params/attention.h's masks:
//   - the default plan with its workspace exactly sized
//     (params::attention_fwd_workspace_bytes): split-K and the merge where the
//     keys split, one kernel where they do not;
//   - causal with a query offset, a two-sided window, sequence lengths (0, part
//     of the cache, beyond it: clamped) and rows past the query lengths;
//   - every key that no query row of its sequence attends holds NaN: the
//     kernels never read it, so the results are the reference's;
//   - what the launcher refuses (a bias, a split plan without a workspace)
//     returns cudaErrorInvalidValue without launching.
// Built under AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_paged_attention_sanitizers.py: each buffer is its own
// exact-size allocation, so a read past the cache or the workspace is caught.
//
// usage: attention_decode_driver BxTxSxNxKxH[c][w][l] ...   (c: causal; w: window
// (5, 2); l: sequence lengths)
// exit status 0 when all agree
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_decode.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;
namespace params = jaxops::params;

struct Shape {
  int64_t B, T, S, N, K, H;
  bool causal, window, lengths;
};

template <typename T>
double value_of(T v) {
  return static_cast<double>(static_cast<float>(v));
}

template <typename T>
struct Problem {
  Problem(const Shape& shape, std::mt19937& rng)
      : s(shape),
        q(s.B * s.T * s.N * s.H),
        k(s.B * s.S * s.K * s.H),
        v(s.B * s.S * s.K * s.H),
        q_lengths(s.B),
        kv_lengths(s.B),
        offset(1) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t i = 0; i < q.size; ++i) q.data[i] = T(normal(rng));
    for (size_t i = 0; i < k.size; ++i) k.data[i] = T(normal(rng));
    for (size_t i = 0; i < v.size; ++i) v.data[i] = T(normal(rng));
    const int64_t kv_choices[4] = {s.S, 0, s.S / 2 + 1, s.S + 9};
    for (int64_t b = 0; b < s.B; ++b) {
      kv_lengths.data[b] = static_cast<int32_t>(s.B == 1 ? s.S - 2 : kv_choices[b % 4]);
      q_lengths.data[b] = static_cast<int32_t>(b % 2 == 0 ? s.T : std::max<int64_t>(s.T - 1, 0));
    }
    offset.data[0] = static_cast<int32_t>(s.S - s.T - 1);
    p.batch = s.B;
    p.q_len = s.T;
    p.kv_len = s.S;
    p.num_heads = s.N;
    p.num_kv_heads = s.K;
    p.head_dim = s.H;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(s.H, 1))));
    p.is_causal = s.causal;
    p.window_left = s.window ? 5 : -1;
    p.window_right = s.window ? 2 : -1;
    p.query_offset = offset.data;
    p.q_seq_lengths = s.lengths ? q_lengths.data : nullptr;
    p.kv_seq_lengths = s.lengths ? kv_lengths.data : nullptr;
    name = std::string(type_name<T>()) + " " + std::to_string(s.B) + "x" + std::to_string(s.T) +
           "x" + std::to_string(s.S) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
           "x" + std::to_string(s.H) + (s.causal ? "c" : "") + (s.window ? "w" : "") +
           (s.lengths ? "l" : "");
    poison_unread_keys();
    reference();
  }

  int64_t q_valid(int64_t b) const {
    return p.q_seq_lengths ? std::clamp<int64_t>(p.q_seq_lengths[b], 0, s.T) : s.T;
  }
  int64_t kv_valid(int64_t b) const {
    return p.kv_seq_lengths ? std::clamp<int64_t>(p.kv_seq_lengths[b], 0, s.S) : s.S;
  }
  bool attends(int64_t b, int64_t t, int64_t j) const {
    const int64_t position = offset.data[0] + t;
    if (t >= q_valid(b) || j >= kv_valid(b)) return false;
    if (p.is_causal && j > position) return false;
    if (p.window_left >= 0 && j < position - p.window_left) return false;
    if (p.window_right >= 0 && j > position + p.window_right) return false;
    return true;
  }

  // NaN in every key and value row no query row of its sequence attends.
  void poison_unread_keys() {
    for (int64_t b = 0; b < s.B; ++b) {
      for (int64_t j = 0; j < s.S; ++j) {
        bool read = false;
        for (int64_t t = 0; t < s.T && !read; ++t) read = attends(b, t, j);
        if (read) continue;
        for (int64_t i = 0; i < s.K * s.H; ++i) {
          k.data[(b * s.S + j) * s.K * s.H + i] = T(NAN);
          v.data[(b * s.S + j) * s.K * s.H + i] = T(NAN);
        }
      }
    }
  }

  void reference() {
    out_r.assign(q.size, 0.0);
    lse_r.assign(s.B * s.N * s.T, -INFINITY);
    const int64_t group = s.N / s.K;
    for (int64_t b = 0; b < s.B; ++b) {
      for (int64_t n = 0; n < s.N; ++n) {
        for (int64_t t = 0; t < s.T; ++t) {
          std::vector<double> logit(s.S, -INFINITY);
          for (int64_t j = 0; j < s.S; ++j) {
            if (!attends(b, t, j)) continue;
            double dot = 0.0;
            for (int64_t h = 0; h < s.H; ++h) {
              dot += value_of(q.data[((b * s.T + t) * s.N + n) * s.H + h]) *
                     value_of(k.data[((b * s.S + j) * s.K + n / group) * s.H + h]);
            }
            logit[j] = dot * p.scale;
          }
          lse_r[(b * s.N + n) * s.T + t] = attend_row(
              logit, s.H,
              [&](int64_t j, int64_t h) {
                return value_of(v.data[((b * s.S + j) * s.K + n / group) * s.H + h]);
              },
              &out_r[((b * s.T + t) * s.N + n) * s.H]);
        }
      }
    }
  }

  void run() {
    if (!params::attention_decode_applies(s.T, s.N, s.K, s.H, false, false)) {
      std::fprintf(stderr, "FAIL %s: decode does not apply to this shape\n", name.c_str());
      ++g_failures;
      return;
    }
    Buffer<T> out(q.size);
    Buffer<float> lse(s.B * s.N * s.T);
    const int64_t bytes = params::attention_fwd_workspace_bytes(s.B, s.T, s.S, s.N, s.K, s.H,
                                                                false, false);
    Buffer<unsigned char> workspace(bytes);
    const cudaError_t status = cuda::attention_decode_fwd<T>(
        nullptr, p, q.data, k.data, v.data, out.data, lse.data,
        bytes > 0 ? workspace.data : nullptr);
    check(status, name);
    if (status != cudaSuccess) return;
    compare_with_reference(name + " out", out.data, out_r, attention_tolerance<T>());
    compare_with_reference(name + " logsumexp", lse.data, lse_r, 1e-4);
    if (bytes > 0) {
      // A split plan without its workspace, and a bias: refused.
      params::AttentionParams biased = p;
      const float bias = 0.0f;
      biased.bias = &bias;
      if (cuda::attention_decode_fwd<T>(nullptr, p, q.data, k.data, v.data, out.data, lse.data,
                                        nullptr) != cudaErrorInvalidValue ||
          cuda::attention_decode_fwd<T>(nullptr, biased, q.data, k.data, v.data, out.data,
                                        lse.data, workspace.data) != cudaErrorInvalidValue) {
        std::fprintf(stderr, "FAIL %s: the launcher accepted what it must refuse\n",
                     name.c_str());
        ++g_failures;
      }
    }
  }

  Shape s;
  Buffer<T> q, k, v;
  Buffer<int32_t> q_lengths, kv_lengths, offset;
  params::AttentionParams p;
  std::vector<double> out_r, lse_r;
  std::string name;
};

bool parse(const std::string& text, Shape* s) {
  long long d[6];
  char flags[4] = {0, 0, 0, 0};
  const int n = std::sscanf(text.c_str(), "%lldx%lldx%lldx%lldx%lldx%lld%3s", &d[0], &d[1], &d[2],
                            &d[3], &d[4], &d[5], flags);
  if (n < 6 || d[4] <= 0 || d[3] % d[4] != 0 || d[0] <= 0 || d[1] <= 0 || d[2] <= d[1]) {
    return false;
  }
  const std::string f(flags);
  *s = {d[0], d[1], d[2], d[3], d[4], d[5], f.find('c') != std::string::npos,
        f.find('w') != std::string::npos, f.find('l') != std::string::npos};
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  return run_shapes<Shape>(argc, argv, parse, [](const Shape& s, std::mt19937& rng, int) {
    Problem<float>(s, rng).run();
    Problem<__nv_bfloat16>(s, rng).run();
    Problem<__half>(s, rng).run();
  });
}
