// Test-only: runs the CUDA attention kernels (cuda/attention.cu, compiled by the
// harness) forward and backward on the shapes given on the command line, in
// float32, bfloat16 and float16, with a full bias (and its gradient), a
// broadcast [T, S] mask, sequence lengths and, for shapes ending in "c", the
// causal mask with query_offset S - T, and checks every result against a
// double-precision reference. Built under AddressSanitizer and ThreadSanitizer
// by tests/test_cuda_harness_attention_sanitizers.py, where what matters most is
// that the sanitizers stay silent: each buffer is its own exact-size
// allocation, so a read past any tile edge is caught.
//
// usage: attention_driver BxTxSxNxKxH[c] ...     exit status 0 when all agree
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;

struct Shape {
  int64_t B, T, S, N, K, H;
  bool causal;
};

template <typename T>
double tolerance() {
  if (std::is_same<T, float>::value) return 1e-4;
  if (std::is_same<T, __half>::value) return 1e-2;
  return 6e-2;
}

template <typename V>
void compare(const std::string& what, const std::vector<V>& actual,
             const std::vector<double>& expected, double tol) {
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<double>(static_cast<float>(actual[i]));
    const double e = expected[i];
    const bool ok = std::isinf(e) ? a == e : std::fabs(a - e) <= tol * (1.0 + std::fabs(e));
    if (!ok) {
      std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i, a, e);
      ++g_failures;
      return;
    }
  }
}

template <typename T>
std::vector<T> random_vector(size_t n, std::mt19937& rng, std::vector<double>* rounded) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<T> out(n);
  rounded->resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = T(normal(rng));
    (*rounded)[i] = static_cast<float>(out[i]);
  }
  return out;
}

template <typename T>
void run(const Shape& s, std::mt19937& rng) {
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(s.B) + "x" +
                           std::to_string(s.T) + "x" + std::to_string(s.S) + "x" +
                           std::to_string(s.N) + "x" + std::to_string(s.K) + "x" +
                           std::to_string(s.H) + (s.causal ? "c" : "");
  const size_t nq = s.B * s.T * s.N * s.H, nk = s.B * s.S * s.K * s.H;
  std::vector<double> q, k, v, dout, bias;
  auto q_t = random_vector<T>(nq, rng, &q), k_t = random_vector<T>(nk, rng, &k),
       v_t = random_vector<T>(nk, rng, &v), dout_t = random_vector<T>(nq, rng, &dout);
  auto bias_f = random_vector<float>(s.B * s.N * s.T * s.S, rng, &bias);
  std::vector<uint8_t> mask(s.T * s.S);
  for (int64_t i = 0; i < s.T * s.S; ++i) mask[i] = (i * 7 + 3) % 5 != 0;
  std::vector<int32_t> q_lengths(s.B), kv_lengths(s.B);
  for (int64_t b = 0; b < s.B; ++b) {
    q_lengths[b] = static_cast<int32_t>(s.T - b % 2);
    kv_lengths[b] = static_cast<int32_t>(s.S - b % 3);
  }
  std::vector<int32_t> offset(1, static_cast<int32_t>(s.S - s.T));

  cuda::AttentionParams p;
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
  p.mask = mask.data();
  p.mask_strides[2] = s.S;
  p.mask_strides[3] = 1;
  p.bias = bias_f.data();
  p.bias_strides[0] = s.N * s.T * s.S;
  p.bias_strides[1] = s.T * s.S;
  p.bias_strides[2] = s.S;
  p.bias_strides[3] = 1;

  std::vector<T> out(nq), dq(nq), dk(nk), dv(nk);
  std::vector<float> lse(s.B * s.N * s.T), dbias(bias.size());
  std::vector<unsigned char> workspace(cuda::attention_bwd_workspace_bytes(p));
  cudaError_t status = cuda::attention_fwd<T>(nullptr, p, q_t.data(), k_t.data(), v_t.data(),
                                              out.data(), lse.data());
  if (status == cudaSuccess) {
    status = cuda::attention_bwd<T>(nullptr, p, q_t.data(), k_t.data(), v_t.data(), out.data(),
                                    lse.data(), dout_t.data(), nullptr, dq.data(), dk.data(),
                                    dv.data(), dbias.data(), workspace.data());
  }
  if (status != cudaSuccess) {
    std::fprintf(stderr, "FAIL %s: %s: %s\n", name.c_str(), cudaGetErrorName(status),
                 cudaGetErrorString(status));
    ++g_failures;
    return;
  }

  // Reference in double: P, out, lse, then dP, D, dS and the gradients.
  std::vector<double> out_r(nq, 0.0), lse_r(lse.size()), dq_r(nq, 0.0), dk_r(nk, 0.0),
      dv_r(nk, 0.0), dbias_r(bias.size(), 0.0);
  const int64_t group = s.N / s.K;
  std::vector<double> prob(s.S), dprob(s.S);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t n = 0; n < s.N; ++n) {
      const int64_t kh = n / group;
      for (int64_t t = 0; t < s.T; ++t) {
        const size_t qrow = ((b * s.T + t) * s.N + n) * s.H;
        const size_t stat = (b * s.N + n) * s.T + t;
        double mx = -INFINITY;
        for (int64_t j = 0; j < s.S; ++j) {
          const bool visible = t < q_lengths[b] && j < kv_lengths[b] && mask[t * s.S + j] &&
                               (!s.causal || j <= t + offset[0]);
          double x = -INFINITY;
          if (visible) {
            const size_t krow = ((b * s.S + j) * s.K + kh) * s.H;
            double dot = 0.0;
            for (int64_t h = 0; h < s.H; ++h) dot += q[qrow + h] * k[krow + h];
            x = p.scale * dot + bias[((b * s.N + n) * s.T + t) * s.S + j];
          }
          prob[j] = x;
          mx = std::max(mx, x);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < s.S; ++j) {
          prob[j] = mx == -INFINITY || prob[j] == -INFINITY ? 0.0 : std::exp(prob[j] - mx);
          sum += prob[j];
        }
        lse_r[stat] = sum > 0.0 ? mx + std::log(sum) : -INFINITY;
        for (int64_t j = 0; j < s.S; ++j) prob[j] = sum > 0.0 ? prob[j] / sum : 0.0;
        double d = 0.0;
        for (int64_t h = 0; h < s.H; ++h) {
          double o = 0.0;
          for (int64_t j = 0; j < s.S; ++j) o += prob[j] * v[((b * s.S + j) * s.K + kh) * s.H + h];
          out_r[qrow + h] = o;
          d += o * dout[qrow + h];
        }
        for (int64_t j = 0; j < s.S; ++j) {
          const size_t krow = ((b * s.S + j) * s.K + kh) * s.H;
          double dp = 0.0;
          for (int64_t h = 0; h < s.H; ++h) dp += dout[qrow + h] * v[krow + h];
          const double ds = prob[j] * (dp - d);
          dbias_r[((b * s.N + n) * s.T + t) * s.S + j] = ds;
          for (int64_t h = 0; h < s.H; ++h) {
            dq_r[qrow + h] += p.scale * ds * k[krow + h];
            dk_r[krow + h] += p.scale * ds * q[qrow + h];
            dv_r[krow + h] += prob[j] * dout[qrow + h];
          }
        }
      }
    }
  }
  const double tol = tolerance<T>();
  compare(name + " out", out, out_r, tol);
  compare(name + " logsumexp", lse, lse_r, 1e-4);
  compare(name + " dq", dq, dq_r, tol);
  compare(name + " dk", dk, dk_r, tol);
  compare(name + " dv", dv, dv_r, tol);
  compare(name + " dbias", dbias, dbias_r, tol);
}

bool parse(const std::string& text, Shape* s) {
  long long v[6];
  char c = 0;
  const int n = std::sscanf(text.c_str(), "%lldx%lldx%lldx%lldx%lldx%lld%c", &v[0], &v[1], &v[2],
                            &v[3], &v[4], &v[5], &c);
  if (n < 6 || v[4] <= 0 || v[3] % v[4] != 0) return false;
  *s = {v[0], v[1], v[2], v[3], v[4], v[5], c == 'c'};
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(1234);
  for (int i = 1; i < argc; ++i) {
    Shape s;
    if (!parse(argv[i], &s)) {
      std::fprintf(stderr, "bad shape %s\n", argv[i]);
      return 2;
    }
    run<float>(s, rng);
    run<__nv_bfloat16>(s, rng);
    run<__half>(s, rng);
  }
  if (g_failures != 0) return 3;
  std::printf("all agree\n");
  return 0;
}
