// Test-only: runs the CUDA attention kernels (cuda/attention*.cu, compiled by
// the harness) on the shapes given on the command line, in float32 (twice: in
// full float32 on the SIMT kernels, and with allow_tf32 on the tensor-core
// kernels, mma.sync m16n8k8 emulated), bfloat16 and float16 (the tensor-core
// kernels, mma.sync m16n8k16, ldmatrix and cp.async emulated), with a
// broadcast [T, S] mask that empties query row 1, sequence lengths and, for
// shapes ending in "c", the causal mask with query_offset S - T, and checks
// every result against a double-precision reference:
//   - forward and backward with a full bias (and its gradient);
//   - forward mode with a [1, N, T, S] bias and its tangent, with every
//     tangent (query, key, value, bias), with none, and with the subsets that
//     take each variant of the tangent products; the bias tangent is NaN on
//     masked keys, which must not reach any result.
// Built under AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_attention_sanitizers.py, where what matters most is
// that the sanitizers stay silent: each buffer is its own exact-size
// allocation, so a read past any tile edge is caught, and under
// ThreadSanitizer a shared-memory stage reloaded before every warp is done
// with it is a race (the emulated cp.async writes at its wait).
// Every shape runs a second time with the features of current models: a
// logit soft cap of 2, segment ids (documents of 5 positions, the first query
// row of each batch in a document with no key) and a value head dim of its
// own, Hv = H / 2 + 3 (H = 200 takes the tensor cores' (256, 128)
// configuration); forward, backward and the forward mode with every tangent.
//
// usage: attention_driver BxTxSxNxKxH[c] ...     exit status 0 when all agree
#include <algorithm>
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
namespace params = jaxops::params;  // the parameter structs cuda/ shares

struct Shape {
  int64_t B, T, S, N, K, H;
  bool causal;
};

// The soft cap of the features' pass.
constexpr double kSoftCap = 2.0;

template <typename V>
void compare(const std::string& what, const std::vector<V>& actual,
             const std::vector<double>& expected, double tol) {
  compare_with_reference(what, actual.data(), expected, tol);
}

bool failed(cudaError_t status, const std::string& name) {
  if (status == cudaSuccess) return false;
  std::fprintf(stderr, "FAIL %s: %s: %s\n", name.c_str(), cudaGetErrorName(status),
               cudaGetErrorString(status));
  ++g_failures;
  return true;
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

// A tensor in the kernel's type and the doubles its elements round to.
template <typename T>
struct Tensor {
  Tensor(size_t n, std::mt19937& rng) : data(random_vector<T>(n, rng, &value)) {}
  std::vector<double> value;
  std::vector<T> data;
};

// The tolerance of float32 results whose products ran on TF32 tensor cores,
// relative to 1 + |expected|: 8 units of TF32's rounding (2^-11), as
// tests/test_matmul_precision_kernels.py derives it.
constexpr double kTf32Tolerance = 8.0 / 2048.0;

// What the forward, the backward and the forward mode of one shape share: the
// random q, k, v, the mask, lengths and offset, and the reference's masking
// and logits.
template <typename T>
struct Problem {
  Problem(const Shape& shape, bool allow_tf32, bool with_features, std::mt19937& rng)
      : s(shape),
        features(with_features),
        hv(with_features ? s.H / 2 + 3 : s.H),
        nq(s.B * s.T * s.N * s.H),
        nk(s.B * s.S * s.K * s.H),
        no(s.B * s.T * s.N * hv),
        nv(s.B * s.S * s.K * hv),
        q(nq, rng),
        k(nk, rng),
        v(nv, rng),
        mask(s.T * s.S),
        q_lengths(s.B),
        kv_lengths(s.B),
        q_ids(s.B * s.T),
        kv_ids(s.B * s.S),
        offset(1, static_cast<int32_t>(s.S - s.T)) {
    name = std::string(type_name<T>()) + " " + std::to_string(s.B) + "x" + std::to_string(s.T) +
           "x" + std::to_string(s.S) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
           "x" + std::to_string(s.H) + (s.causal ? "c" : "") + (allow_tf32 ? " tf32" : "") +
           (features ? " cap+ids+Hv" + std::to_string(hv) : "");
    for (int64_t b = 0; b < s.B; ++b) {
      for (int64_t j = 0; j < s.S; ++j) kv_ids[b * s.S + j] = static_cast<int32_t>((j + b) / 5);
      for (int64_t t = 0; t < s.T; ++t) {
        q_ids[b * s.T + t] = t == 0 ? -1 : static_cast<int32_t>((t + s.S - s.T + b) / 5);
      }
    }
    for (int64_t i = 0; i < s.T * s.S; ++i) mask[i] = (i * 7 + 3) % 5 != 0 && i / s.S != 1;
    for (int64_t b = 0; b < s.B; ++b) {
      q_lengths[b] = static_cast<int32_t>(s.T - b % 2);
      kv_lengths[b] = static_cast<int32_t>(s.S - b % 3);
    }
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
    p.allow_tf32 = allow_tf32;
    if (features) {
      p.value_head_dim = hv;
      p.logits_soft_cap = static_cast<float>(kSoftCap);
      p.q_segment_ids = q_ids.data();
      p.kv_segment_ids = kv_ids.data();
    }
  }

  // `full`, the tolerance of a result computed in full float32 (or in T), or
  // the TF32 one where the products took the TF32 tensor cores.
  double tolerance(double full) const { return p.allow_tf32 ? kTf32Tolerance : full; }

  size_t q_row(int64_t b, int64_t t, int64_t n) const { return ((b * s.T + t) * s.N + n) * s.H; }
  size_t k_row(int64_t b, int64_t j, int64_t n) const {
    return ((b * s.S + j) * s.K + n / (s.N / s.K)) * s.H;
  }
  // Rows of value, dv ([B, S, K, Hv]) and of out, dout ([B, T, N, Hv]).
  size_t v_row(int64_t b, int64_t j, int64_t n) const {
    return ((b * s.S + j) * s.K + n / (s.N / s.K)) * hv;
  }
  size_t o_row(int64_t b, int64_t t, int64_t n) const { return ((b * s.T + t) * s.N + n) * hv; }
  // The capped logit of a scaled product and the cap's slope (1 without one).
  double capped(double x, double* slope) const {
    if (!features) {
      *slope = 1.0;
      return x;
    }
    const double th = std::tanh(x / kSoftCap);
    *slope = 1.0 - th * th;
    return kSoftCap * th;
  }
  size_t stat(int64_t b, int64_t n, int64_t t) const { return (b * s.N + n) * s.T + t; }
  bool visible(int64_t b, int64_t t, int64_t j) const {
    return t < q_lengths[b] && j < kv_lengths[b] && mask[t * s.S + j] &&
           (!s.causal || j <= t + offset[0]) &&
           (!features || q_ids[b * s.T + t] == kv_ids[b * s.S + j]);
  }
  double dot(const std::vector<double>& x, size_t x_row, const std::vector<double>& y,
             size_t y_row, int64_t d = -1) const {
    double sum = 0.0;
    for (int64_t h = 0; h < (d < 0 ? s.H : d); ++h) sum += x[x_row + h] * y[y_row + h];
    return sum;
  }
  // The probabilities of row (b, n, t) into prob from its logits (-inf where
  // masked); returns the logsumexp.
  double softmax(std::vector<double>* prob) const {
    double mx = -INFINITY;
    for (double x : *prob) mx = std::max(mx, x);
    double sum = 0.0;
    for (double& x : *prob) {
      x = mx == -INFINITY || x == -INFINITY ? 0.0 : std::exp(x - mx);
      sum += x;
    }
    for (double& x : *prob) x = sum > 0.0 ? x / sum : 0.0;
    return sum > 0.0 ? mx + std::log(sum) : -INFINITY;
  }

  Shape s;
  bool features;
  int64_t hv;
  size_t nq, nk, no, nv;
  Tensor<T> q, k, v;
  std::vector<uint8_t> mask;
  std::vector<int32_t> q_lengths, kv_lengths, q_ids, kv_ids, offset;
  params::AttentionParams p;
  std::string name;
};

template <typename T>
void run_fwd_bwd(const Problem<T>& pr, std::mt19937& rng) {
  const Shape& s = pr.s;
  const size_t nq = pr.nq, nk = pr.nk, no = pr.no, nv = pr.nv;
  Tensor<T> dout(no, rng);
  Tensor<float> bias(s.B * s.N * s.T * s.S, rng);
  params::AttentionParams p = pr.p;
  p.bias = bias.data.data();
  p.bias_strides[0] = s.N * s.T * s.S;
  p.bias_strides[1] = s.T * s.S;
  p.bias_strides[2] = s.S;
  p.bias_strides[3] = 1;

  std::vector<T> out(no), dq(nq), dk(nk), dv(nv);
  std::vector<float> lse(s.B * s.N * s.T), dbias(bias.value.size());
  std::vector<unsigned char> workspace(cuda::attention_bwd_workspace_bytes(p));
  cudaError_t status = cuda::attention_fwd<T>(nullptr, p, pr.q.data.data(), pr.k.data.data(),
                                              pr.v.data.data(), out.data(), lse.data());
  if (status == cudaSuccess) {
    status = cuda::attention_bwd<T>(nullptr, p, pr.q.data.data(), pr.k.data.data(),
                                    pr.v.data.data(), out.data(), lse.data(), dout.data.data(),
                                    nullptr, dq.data(), dk.data(), dv.data(), dbias.data(),
                                    workspace.data());
  }
  if (failed(status, pr.name)) return;

  // Reference in double: P, out, lse, then dP, D, dS and the gradients.
  const auto& q = pr.q.value;
  const auto& k = pr.k.value;
  const auto& v = pr.v.value;
  std::vector<double> out_r(no, 0.0), lse_r(lse.size()), dq_r(nq, 0.0), dk_r(nk, 0.0),
      dv_r(nv, 0.0), dbias_r(bias.value.size(), 0.0);
  std::vector<double> prob(s.S), slope(s.S);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t t = 0; t < s.T; ++t) {
        const size_t qrow = pr.q_row(b, t, n), orow = pr.o_row(b, t, n);
        for (int64_t j = 0; j < s.S; ++j) {
          const double x = pr.capped(p.scale * pr.dot(q, qrow, k, pr.k_row(b, j, n)), &slope[j]);
          prob[j] = pr.visible(b, t, j) ? x + bias.value[((b * s.N + n) * s.T + t) * s.S + j]
                                        : -INFINITY;
        }
        lse_r[pr.stat(b, n, t)] = pr.softmax(&prob);
        double d = 0.0;
        for (int64_t h = 0; h < pr.hv; ++h) {
          double o = 0.0;
          for (int64_t j = 0; j < s.S; ++j) o += prob[j] * v[pr.v_row(b, j, n) + h];
          out_r[orow + h] = o;
          d += o * dout.value[orow + h];
        }
        for (int64_t j = 0; j < s.S; ++j) {
          const size_t krow = pr.k_row(b, j, n), vrow = pr.v_row(b, j, n);
          const double ds = prob[j] * (pr.dot(dout.value, orow, v, vrow, pr.hv) - d);
          dbias_r[((b * s.N + n) * s.T + t) * s.S + j] = ds;
          for (int64_t h = 0; h < s.H; ++h) {
            dq_r[qrow + h] += p.scale * ds * slope[j] * k[krow + h];
            dk_r[krow + h] += p.scale * ds * slope[j] * q[qrow + h];
          }
          for (int64_t h = 0; h < pr.hv; ++h) dv_r[vrow + h] += prob[j] * dout.value[orow + h];
        }
      }
    }
  }
  const double tol = pr.tolerance(attention_tolerance<T>());
  compare(pr.name + " out", out, out_r, tol);
  compare(pr.name + " logsumexp", lse, lse_r, pr.tolerance(1e-4));
  compare(pr.name + " dq", dq, dq_r, tol);
  compare(pr.name + " dk", dk, dk_r, tol);
  compare(pr.name + " dv", dv, dv_r, tol);
  compare(pr.name + " dbias", dbias, dbias_r, tol);
}

// Which tangents of the forward mode are present: bits of kQuery... kBias.
enum Tangent { kQuery = 1, kKey = 2, kValue = 4, kBias = 8 };

template <typename T>
void run_fwd_jvp(const Problem<T>& pr, int present, std::mt19937& rng) {
  const Shape& s = pr.s;
  const size_t nq = pr.nq, nk = pr.nk, no = pr.no, nv = pr.nv;
  const std::string name = pr.name + " jvp" + (present & kQuery ? " dq" : "") +
                           (present & kKey ? " dk" : "") + (present & kValue ? " dv" : "") +
                           (present & kBias ? " dbias" : "");
  Tensor<T> dq(nq, rng), dk(nk, rng), dv(nv, rng);
  // bias and its tangent [1, N, T, S]; the tangent is NaN where the mask is false.
  const size_t bias_size = s.N * s.T * s.S;
  Tensor<float> bias(bias_size, rng), dbias(bias_size, rng);
  for (size_t i = 0; i < bias_size; ++i) {
    if (!pr.mask[i % (s.T * s.S)]) dbias.data[i] = NAN;
  }
  // Absent tangents are zero in the reference and null for the kernel.
  const auto zero_unless = [present](int which, std::vector<double>* x) {
    if (!(present & which)) x->assign(x->size(), 0.0);
  };
  zero_unless(kQuery, &dq.value);
  zero_unless(kKey, &dk.value);
  zero_unless(kValue, &dv.value);
  zero_unless(kBias, &dbias.value);
  params::AttentionParams p = pr.p;
  p.bias = bias.data.data();
  p.bias_strides[1] = s.T * s.S;
  p.bias_strides[2] = s.S;
  p.bias_strides[3] = 1;

  std::vector<T> out(no), dout(no);
  std::vector<float> lse(s.B * s.N * s.T), dlse(lse.size());
  const cudaError_t status = cuda::attention_fwd_jvp<T>(
      nullptr, p, pr.q.data.data(), pr.k.data.data(), pr.v.data.data(),
      present & kQuery ? dq.data.data() : nullptr, present & kKey ? dk.data.data() : nullptr,
      present & kValue ? dv.data.data() : nullptr, present & kBias ? dbias.data.data() : nullptr,
      out.data(), lse.data(), dout.data(), dlse.data());
  if (failed(status, name)) return;

  // Reference in double: P, then the logit tangents dS, their mean mu (the
  // logsumexp tangent) and dout = sum_j P (dS - mu) v_j + P dv_j.
  const auto& q = pr.q.value;
  const auto& k = pr.k.value;
  const auto& v = pr.v.value;
  std::vector<double> out_r(no, 0.0), lse_r(lse.size()), dout_r(no, 0.0), dlse_r(lse.size());
  std::vector<double> prob(s.S), dscore(s.S);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t t = 0; t < s.T; ++t) {
        const size_t qrow = pr.q_row(b, t, n), orow = pr.o_row(b, t, n);
        for (int64_t j = 0; j < s.S; ++j) {
          const size_t krow = pr.k_row(b, j, n);
          const bool visible = pr.visible(b, t, j);
          const size_t at = (n * s.T + t) * s.S + j;
          double slope = 1.0;
          const double x = pr.capped(p.scale * pr.dot(q, qrow, k, krow), &slope);
          prob[j] = visible ? x + bias.value[at] : -INFINITY;
          dscore[j] = visible ? p.scale * slope * (pr.dot(dq.value, qrow, k, krow) +
                                                   pr.dot(q, qrow, dk.value, krow)) +
                                    dbias.value[at]
                              : 0.0;
        }
        lse_r[pr.stat(b, n, t)] = pr.softmax(&prob);
        double mu = 0.0;
        for (int64_t j = 0; j < s.S; ++j) mu += prob[j] * dscore[j];
        dlse_r[pr.stat(b, n, t)] = mu;
        for (int64_t h = 0; h < pr.hv; ++h) {
          double o = 0.0, dot = 0.0;
          for (int64_t j = 0; j < s.S; ++j) {
            const size_t at = pr.v_row(b, j, n) + h;
            o += prob[j] * v[at];
            dot += prob[j] * ((dscore[j] - mu) * v[at] + dv.value[at]);
          }
          out_r[orow + h] = o;
          dout_r[orow + h] = dot;
        }
      }
    }
  }
  const double tol = pr.tolerance(attention_tolerance<T>());
  compare(name + " out", out, out_r, tol);
  compare(name + " logsumexp", lse, lse_r, pr.tolerance(1e-4));
  compare(name + " dout", dout, dout_r, tol);
  compare(name + " dlogsumexp", dlse, dlse_r, tol);
}

template <typename T>
void run(const Shape& s, std::mt19937& rng, bool allow_tf32 = false) {
  const Problem<T> problem(s, allow_tf32, false, rng);
  run_fwd_bwd(problem, rng);
  // Each product's variants: dS from dq, dk or both, or from dbias alone; the
  // output tangent from dS, dv or both.
  for (int present : {kQuery | kKey | kValue | kBias, 0, int{kQuery}, kKey | kValue, int{kValue},
                      int{kBias}}) {
    run_fwd_jvp(problem, present, rng);
  }
  // The features' instantiations: forward, backward and every tangent.
  const Problem<T> with_features(s, allow_tf32, true, rng);
  run_fwd_bwd(with_features, rng);
  run_fwd_jvp(with_features, kQuery | kKey | kValue | kBias, rng);
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
  return run_shapes<Shape>(argc, argv, parse, [](const Shape& s, std::mt19937& rng, int) {
    run<float>(s, rng);
    run<float>(s, rng, /*allow_tf32=*/true);
    run<__nv_bfloat16>(s, rng);
    run<__half>(s, rng);
  });
}
