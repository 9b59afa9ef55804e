// Standalone test of cpu/attention against a naive double-precision loop, and a
// quick timing. Built by CMake with -DJAXOPS_BUILD_CPP_TESTS=ON (run by ctest),
// or directly from the repository root:
//   g++ -std=c++17 -O2 -fopenmp -march=native -I. -I<eigen3 include dir>
//       cpu/attention.cc tests/cpp/attention_test.cc -o attention_test
// Run: ./attention_test                  (correctness; exit status 1 on failure)
//      ./attention_test bench [reps]     (timing of a standard set of shapes)
//      ./attention_test bench reps B T S N K H causal {f32,bf16,f16} [fwd|bwd]
#include "cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using jaxops::cpu::AttentionParams;
using bfloat16 = Eigen::bfloat16;
using float16 = Eigen::half;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Case {
  std::string name;
  int64_t B, T, S, N, K, H;
  bool causal = false;
  int64_t offset = 0;
  int64_t wl = -1, wr = -1;
  bool q_lengths = false, kv_lengths = false;
  // Broadcast shape of mask / bias over [B, N, T, S]: 1 = broadcast, 0 = full; empty = absent.
  std::vector<int> mask_bcast = {}, bias_bcast = {};
  float scale = 0;  // 0: 1/sqrt(H)
  bool with_dlse = false;  // backward also gets a logsumexp cotangent
};

struct Problem {
  AttentionParams p;
  std::vector<int32_t> q_len, kv_len;
  std::vector<uint8_t> mask;
  std::vector<float> bias;
  std::vector<int64_t> bias_shape;  // per dim extent of the bias buffer
};

void set_strides(const std::vector<int>& bcast, const int64_t full[4], int64_t strides[4],
                 std::vector<int64_t>* shape) {
  shape->assign(4, 1);
  for (int d = 0; d < 4; ++d) (*shape)[d] = bcast[d] ? 1 : full[d];
  int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    strides[d] = (*shape)[d] == 1 ? 0 : stride;
    stride *= (*shape)[d];
  }
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Problem make_problem(const Case& c, std::mt19937& rng, int threads) {
  Problem pr;
  AttentionParams& p = pr.p;
  p.batch = c.B;
  p.q_len = c.T;
  p.kv_len = c.S;
  p.num_heads = c.N;
  p.num_kv_heads = c.K;
  p.head_dim = c.H;
  p.scale = c.scale != 0 ? c.scale : 1.0f / std::sqrt(static_cast<float>(c.H));
  p.is_causal = c.causal;
  p.query_offset = c.offset;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.num_threads = threads;
  std::uniform_int_distribution<int> tl(0, static_cast<int>(c.T)), sl(0, static_cast<int>(c.S));
  if (c.q_lengths) {
    for (int64_t b = 0; b < c.B; ++b) pr.q_len.push_back(b == 0 ? static_cast<int32_t>(c.T) : tl(rng));
    p.q_seq_lengths = pr.q_len.data();
  }
  if (c.kv_lengths) {
    for (int64_t b = 0; b < c.B; ++b) pr.kv_len.push_back(b == 1 ? 0 : sl(rng));
    p.kv_seq_lengths = pr.kv_len.data();
  }
  const int64_t full[4] = {c.B, c.N, c.T, c.S};
  if (!c.mask_bcast.empty()) {
    std::vector<int64_t> shape;
    set_strides(c.mask_bcast, full, p.mask_strides, &shape);
    std::bernoulli_distribution keep(0.75);
    pr.mask.resize(numel(shape));
    for (auto& m : pr.mask) m = keep(rng);
    p.mask = pr.mask.data();
  }
  if (!c.bias_bcast.empty()) {
    set_strides(c.bias_bcast, full, p.bias_strides, &pr.bias_shape);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    pr.bias.resize(numel(pr.bias_shape));
    for (auto& x : pr.bias) x = nd(rng);
    p.bias = pr.bias.data();
  }
  return pr;
}

bool attended(const AttentionParams& p, int64_t b, int64_t n, int64_t t, int64_t j) {
  const int64_t pos = t + p.query_offset;
  if (p.is_causal && j > pos) return false;
  if (p.window_left >= 0 && j < pos - p.window_left) return false;
  if (p.window_right >= 0 && j > pos + p.window_right) return false;
  if (p.q_seq_lengths && t >= p.q_seq_lengths[b]) return false;
  if (p.kv_seq_lengths && j >= p.kv_seq_lengths[b]) return false;
  if (p.mask) {
    const int64_t* s = p.mask_strides;
    if (!p.mask[b * s[0] + n * s[1] + t * s[2] + j * s[3]]) return false;
  }
  return true;
}

double bias_at(const AttentionParams& p, int64_t b, int64_t n, int64_t t, int64_t j) {
  if (!p.bias) return 0.0;
  const int64_t* s = p.bias_strides;
  return p.bias[b * s[0] + n * s[1] + t * s[2] + j * s[3]];
}

struct Reference {
  std::vector<double> out, lse, dq, dk, dv, dbias;
};

// Naive attention in double: per (b, n, t) row, logits over all keys.
// dlse (may be empty) is the cotangent of the logsumexp.
Reference reference(const Problem& pr, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout,
                    const std::vector<double>& dlse) {
  const AttentionParams& p = pr.p;
  const int64_t B = p.batch, T = p.q_len, S = p.kv_len, N = p.num_heads, K = p.num_kv_heads,
                H = p.head_dim, G = N / K;
  Reference r;
  r.out.assign(B * T * N * H, 0.0);
  r.lse.assign(B * N * T, kNegInf);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  if (p.bias) r.dbias.assign(pr.bias.size(), 0.0);
  std::vector<double> prob(S), dprob(S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t kh = n / G;
      for (int64_t t = 0; t < T; ++t) {
        const double* qr = &q[((b * T + t) * N + n) * H];
        const double* dor = &dout[((b * T + t) * N + n) * H];
        double mx = kNegInf;
        for (int64_t j = 0; j < S; ++j) {
          if (!attended(p, b, n, t, j)) {
            prob[j] = kNegInf;
            continue;
          }
          const double* kr = &k[((b * S + j) * K + kh) * H];
          double dot = 0;
          for (int64_t h = 0; h < H; ++h) dot += qr[h] * kr[h];
          prob[j] = dot * p.scale + bias_at(p, b, n, t, j);
          mx = std::max(mx, prob[j]);
        }
        if (mx == kNegInf) continue;
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          prob[j] = prob[j] == kNegInf ? 0.0 : std::exp(prob[j] - mx);
          sum += prob[j];
        }
        r.lse[(b * N + n) * T + t] = mx + std::log(sum);
        double* o = &r.out[((b * T + t) * N + n) * H];
        for (int64_t j = 0; j < S; ++j) {
          prob[j] /= sum;
          const double* vr = &v[((b * S + j) * K + kh) * H];
          for (int64_t h = 0; h < H; ++h) o[h] += prob[j] * vr[h];
        }
        double delta = 0;
        for (int64_t h = 0; h < H; ++h) delta += dor[h] * o[h];
        if (!dlse.empty()) delta -= dlse[(b * N + n) * T + t];
        for (int64_t j = 0; j < S; ++j) {
          if (prob[j] == 0.0) continue;
          const double* vr = &v[((b * S + j) * K + kh) * H];
          double dp = 0;
          for (int64_t h = 0; h < H; ++h) dp += dor[h] * vr[h];
          const double ds = prob[j] * (dp - delta);
          const double* kr = &k[((b * S + j) * K + kh) * H];
          double* dqr = &r.dq[((b * T + t) * N + n) * H];
          double* dkr = &r.dk[((b * S + j) * K + kh) * H];
          double* dvr = &r.dv[((b * S + j) * K + kh) * H];
          for (int64_t h = 0; h < H; ++h) {
            dqr[h] += p.scale * ds * kr[h];
            dkr[h] += p.scale * ds * qr[h];
            dvr[h] += prob[j] * dor[h];
          }
          if (p.bias) {
            const int64_t* s = p.bias_strides;
            r.dbias[b * s[0] + n * s[1] + t * s[2] + j * s[3]] += ds;
          }
        }
      }
    }
  }
  return r;
}

template <typename T>
std::vector<T> random_tensor(int64_t count, std::mt19937& rng, std::vector<double>* as_double) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<T> x(count);
  as_double->resize(count);
  for (int64_t i = 0; i < count; ++i) {
    x[i] = static_cast<T>(nd(rng));
    (*as_double)[i] = static_cast<double>(static_cast<float>(x[i]));
  }
  return x;
}

template <typename T>
double tolerance();
template <>
double tolerance<float>() { return 2e-5; }
template <>
double tolerance<bfloat16>() { return 1.6e-2; }
template <>
double tolerance<float16>() { return 2e-3; }

// Max |got - want| relative to max |want| (at least 1); also fails on NaN and on
// an infinity where the reference is finite (or the reverse).
template <typename U>
double compare(const char* what, const std::vector<U>& got, const std::vector<double>& want,
               double tol, bool* ok) {
  double max_diff = 0, max_ref = 1.0;
  int64_t worst = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = static_cast<double>(static_cast<float>(got[i]));
    const double w = want[i];
    if (std::isinf(w) || std::isinf(g)) {
      if (g != w) {
        std::printf("    %s[%zu]: got %g want %g\n", what, i, g, w);
        *ok = false;
        return INFINITY;
      }
      continue;
    }
    if (std::isnan(g)) {
      std::printf("    %s[%zu]: NaN\n", what, i);
      *ok = false;
      return NAN;
    }
    max_ref = std::max(max_ref, std::abs(w));
    if (std::abs(g - w) > max_diff) {
      max_diff = std::abs(g - w);
      worst = static_cast<int64_t>(i);
    }
  }
  const double err = max_diff / max_ref;
  if (err > tol) {
    std::printf("    %s: error %.3g > %.3g at %lld (got %g want %g)\n", what, err, tol,
                static_cast<long long>(worst), static_cast<double>(static_cast<float>(got[worst])),
                want[worst]);
    *ok = false;
  }
  return err;
}

template <typename T>
bool run_case(const Case& c, int threads, const char* type_name) {
  std::mt19937 rng(1234 + c.T * 7 + c.S * 13 + c.H);
  Problem pr = make_problem(c, rng, threads);
  const AttentionParams& p = pr.p;
  if (const char* err = jaxops::cpu::attention_params_error(p)) {
    std::printf("  %s: invalid params: %s\n", c.name.c_str(), err);
    return false;
  }
  const int64_t qn = c.B * c.T * c.N * c.H, kn = c.B * c.S * c.K * c.H;
  std::vector<double> qd, kd, vd, dod;
  auto q = random_tensor<T>(qn, rng, &qd);
  auto k = random_tensor<T>(kn, rng, &kd);
  auto v = random_tensor<T>(kn, rng, &vd);
  auto dout = random_tensor<T>(qn, rng, &dod);
  std::vector<double> dlse_d;
  std::vector<float> dlse;
  if (c.with_dlse) dlse = random_tensor<float>(c.B * c.N * c.T, rng, &dlse_d);
  Reference ref = reference(pr, qd, kd, vd, dod, dlse_d);

  std::vector<T> out(qn), dq(qn), dk(kn), dv(kn);
  std::vector<float> lse(c.B * c.N * c.T);
  std::vector<float> dbias(pr.bias.size());
  std::vector<char> ws(std::max(jaxops::cpu::attention_fwd_workspace_bytes<T>(p),
                                jaxops::cpu::attention_bwd_workspace_bytes<T>(p, true)));
  // Poison outputs and workspace: every element must be written.
  std::fill(ws.begin(), ws.end(), static_cast<char>(0xff));
  for (auto& x : out) x = static_cast<T>(NAN);
  for (auto& x : dq) x = static_cast<T>(NAN);
  for (auto& x : dk) x = static_cast<T>(NAN);
  for (auto& x : dv) x = static_cast<T>(NAN);
  std::fill(lse.begin(), lse.end(), NAN);
  std::fill(dbias.begin(), dbias.end(), NAN);

  jaxops::cpu::attention_fwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(), ws.data());
  jaxops::cpu::attention_bwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(),
                                dout.data(), c.with_dlse ? dlse.data() : nullptr, dq.data(),
                                dk.data(), dv.data(), p.bias ? dbias.data() : nullptr, ws.data());

  bool ok = true;
  const double tol = tolerance<T>();
  double e_out = compare("out", out, ref.out, tol, &ok);
  double e_lse = compare("lse", lse, ref.lse, std::max(tol, 1e-5), &ok);
  // Gradients go through the rounded output (delta = rowsum(dout * out)).
  double e_dq = compare("dq", dq, ref.dq, 2 * tol, &ok);
  double e_dk = compare("dk", dk, ref.dk, 2 * tol, &ok);
  double e_dv = compare("dv", dv, ref.dv, 2 * tol, &ok);
  double e_db = p.bias ? compare("dbias", dbias, ref.dbias, 2 * tol, &ok) : 0.0;
  std::printf("  %-5s %-34s %s  out %.1e lse %.1e dq %.1e dk %.1e dv %.1e db %.1e\n", type_name,
              c.name.c_str(), ok ? "ok  " : "FAIL", e_out, e_lse, e_dq, e_dk, e_dv, e_db);
  return ok;
}

// Fully masked rows must give exactly 0 and -inf, and gradients exactly 0.
bool run_fully_masked_rows() {
  Case c{"fully masked rows", 2, 5, 7, 2, 1, 16};
  c.kv_lengths = true;  // batch 1 has kv length 0
  c.causal = true;
  c.offset = -3;        // rows 0..2 of batch 0 attend nothing
  std::mt19937 rng(7);
  Problem pr = make_problem(c, rng, 2);
  pr.kv_len[0] = 7;
  const AttentionParams& p = pr.p;
  const int64_t qn = c.B * c.T * c.N * c.H, kn = c.B * c.S * c.K * c.H;
  std::vector<double> qd, kd, vd, dod;
  auto q = random_tensor<float>(qn, rng, &qd);
  auto k = random_tensor<float>(kn, rng, &kd);
  auto v = random_tensor<float>(kn, rng, &vd);
  auto dout = random_tensor<float>(qn, rng, &dod);
  std::vector<float> out(qn), lse(c.B * c.N * c.T), dq(qn), dk(kn), dv(kn);
  std::vector<char> ws(std::max(jaxops::cpu::attention_fwd_workspace_bytes<float>(p),
                                jaxops::cpu::attention_bwd_workspace_bytes<float>(p, false)));
  jaxops::cpu::attention_fwd<float>(p, q.data(), k.data(), v.data(), out.data(), lse.data(), ws.data());
  jaxops::cpu::attention_bwd<float>(p, q.data(), k.data(), v.data(), out.data(), lse.data(),
                                    dout.data(), nullptr, dq.data(), dk.data(), dv.data(), nullptr,
                                    ws.data());
  bool ok = true;
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t b = 0; b < c.B; ++b) {
        const bool masked = b == 1 || t < 3;
        const float* o = &out[((b * c.T + t) * c.N + n) * c.H];
        const float* g = &dq[((b * c.T + t) * c.N + n) * c.H];
        const float l = lse[(b * c.N + n) * c.T + t];
        if (masked) {
          for (int64_t h = 0; h < c.H; ++h) ok &= o[h] == 0.0f && g[h] == 0.0f;
          ok &= l == -std::numeric_limits<float>::infinity();
        } else {
          ok &= std::isfinite(l);
        }
      }
    }
  }
  for (int64_t i = 0; i < kn / 2; ++i) ok &= dk[kn / 2 + i] == 0.0f && dv[kn / 2 + i] == 0.0f;
  std::printf("  float fully masked rows exact zeros     %s\n", ok ? "ok" : "FAIL");
  return ok;
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  cs.push_back({"basic", 2, 37, 53, 4, 4, 32});
  cs.push_back({"gqa", 2, 70, 91, 6, 2, 64});
  cs.push_back({"mqa T!=S", 1, 130, 67, 4, 1, 80});
  cs.push_back({"T=1 decode", 3, 1, 150, 4, 2, 64});
  cs.push_back({"T=1 mha", 2, 1, 77, 3, 3, 128});
  cs.push_back({"S=1", 2, 19, 1, 2, 2, 32});
  {
    Case c{"causal", 2, 150, 150, 2, 1, 64};
    c.causal = true;
    cs.push_back(c);
  }
  {
    Case c{"causal T<S offset", 1, 40, 170, 4, 2, 32};
    c.causal = true;
    c.offset = 130;
    cs.push_back(c);
  }
  {
    Case c{"causal T>S", 1, 150, 70, 2, 2, 48};
    c.causal = true;
    cs.push_back(c);
  }
  {
    Case c{"causal negative offset", 1, 90, 90, 2, 2, 32};
    c.causal = true;
    c.offset = -20;
    cs.push_back(c);
  }
  {
    Case c{"window (7,3)", 2, 160, 160, 2, 2, 32};
    c.wl = 7;
    c.wr = 3;
    cs.push_back(c);
  }
  {
    Case c{"window (0,0) causal", 1, 70, 70, 2, 1, 32};
    c.wl = 0;
    c.wr = 0;
    c.causal = true;
    cs.push_back(c);
  }
  {
    Case c{"window left only + causal", 1, 200, 200, 2, 2, 64};
    c.wl = 33;
    c.causal = true;
    cs.push_back(c);
  }
  {
    Case c{"seq lengths", 3, 75, 100, 4, 2, 32};
    c.q_lengths = true;
    c.kv_lengths = true;
    cs.push_back(c);
  }
  {
    Case c{"seq lengths + causal + window", 3, 100, 100, 2, 1, 32};
    c.q_lengths = true;
    c.kv_lengths = true;
    c.causal = true;
    c.wl = 20;
    c.wr = 5;
    cs.push_back(c);
  }
  {
    Case c{"mask full", 2, 45, 66, 4, 2, 32};
    c.mask_bcast = {0, 0, 0, 0};
    cs.push_back(c);
  }
  {
    Case c{"mask [B,1,1,S] + causal", 2, 65, 65, 4, 2, 32};
    c.mask_bcast = {0, 1, 1, 0};
    c.causal = true;
    cs.push_back(c);
  }
  {
    Case c{"bias full", 2, 33, 70, 2, 2, 32};
    c.bias_bcast = {0, 0, 0, 0};
    cs.push_back(c);
  }
  {
    Case c{"bias [1,N,T,S] gqa", 2, 70, 40, 4, 2, 32};
    c.bias_bcast = {1, 0, 0, 0};
    cs.push_back(c);
  }
  {
    Case c{"bias [B,1,1,S] + mask", 2, 50, 130, 2, 1, 64};
    c.bias_bcast = {0, 1, 1, 0};
    c.mask_bcast = {1, 0, 0, 0};
    cs.push_back(c);
  }
  {
    Case c{"bias scalar + causal + lengths", 2, 70, 70, 2, 2, 32};
    c.bias_bcast = {1, 1, 1, 1};
    c.causal = true;
    c.q_lengths = true;
    c.kv_lengths = true;
    cs.push_back(c);
  }
  {
    Case c{"bias [1,1,T,1] all masks", 2, 81, 97, 4, 2, 32};
    c.bias_bcast = {1, 1, 0, 1};
    c.mask_bcast = {0, 1, 0, 0};
    c.with_dlse = true;
    c.causal = true;
    c.offset = 16;
    c.wl = 40;
    c.wr = 2;
    c.q_lengths = true;
    c.kv_lengths = true;
    cs.push_back(c);
  }
  {
    Case c{"few rows (T*G < 16), all masks", 3, 3, 90, 8, 2, 48};
    c.bias_bcast = {0, 0, 1, 0};
    c.mask_bcast = {1, 0, 0, 0};
    c.causal = true;
    c.offset = 60;
    c.wl = 50;
    c.wr = 3;
    c.q_lengths = true;
    c.kv_lengths = true;
    c.with_dlse = true;
    cs.push_back(c);
  }
  for (int64_t h : {32, 64, 80, 128, 256}) {
    Case c{"H=" + std::to_string(h), 1, 67, 131, 2, 1, h};
    c.causal = h == 128;
    cs.push_back(c);
  }
  cs.push_back({"odd H=7", 1, 20, 30, 2, 2, 7});
  {
    Case c{"scale 0.5, dlse", 1, 20, 30, 2, 2, 16};
    c.scale = 0.5f;
    c.with_dlse = true;
    cs.push_back(c);
  }
  return cs;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU time of the whole process: on a shared machine, wall time includes other
// tenants' time slices; CPU time divided by the thread count does not.
double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

template <typename T>
void bench_case(int64_t B, int64_t T_len, int64_t S, int64_t N, int64_t K, int64_t H, bool causal,
                bool backward, const char* type_name, int reps) {
  AttentionParams p;
  p.batch = B;
  p.q_len = T_len;
  p.kv_len = S;
  p.num_heads = N;
  p.num_kv_heads = K;
  p.head_dim = H;
  p.scale = 1.0f / std::sqrt(static_cast<float>(H));
  p.is_causal = causal;
  p.query_offset = causal ? S - T_len : 0;
  p.num_threads = omp_get_max_threads();
  std::mt19937 rng(1);
  std::vector<double> tmp;
  const int64_t nq = B * T_len * N * H, nk = B * S * K * H;
  auto q = random_tensor<T>(nq, rng, &tmp);
  auto k = random_tensor<T>(nk, rng, &tmp);
  auto v = random_tensor<T>(nk, rng, &tmp);
  auto dout = random_tensor<T>(nq, rng, &tmp);
  std::vector<T> out(nq), dq(nq), dk(nk), dv(nk);
  std::vector<float> lse(B * N * T_len);
  std::vector<char> ws(std::max(jaxops::cpu::attention_fwd_workspace_bytes<T>(p),
                                jaxops::cpu::attention_bwd_workspace_bytes<T>(p, false)));
  jaxops::cpu::attention_fwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(), ws.data());
  std::vector<double> times, cpu_times;
  for (int r = 0; r < reps + 1; ++r) {
    const double t0 = now_seconds(), c0 = cpu_seconds();
    if (backward) {
      jaxops::cpu::attention_bwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(),
                                    dout.data(), nullptr, dq.data(), dk.data(), dv.data(), nullptr,
                                    ws.data());
    } else {
      jaxops::cpu::attention_fwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(), ws.data());
    }
    if (r > 0) {
      times.push_back(now_seconds() - t0);
      cpu_times.push_back((cpu_seconds() - c0) / p.num_threads);
    }
  }
  std::sort(times.begin(), times.end());
  std::sort(cpu_times.begin(), cpu_times.end());
  const double median = times[times.size() / 2], cpu = cpu_times[cpu_times.size() / 2];
  // Attended (query, key) pairs times 4H flops forward, 10H backward.
  double pairs = 0;
  for (int64_t t = 0; t < T_len; ++t) pairs += causal ? std::min<int64_t>(S, t + p.query_offset + 1) : S;
  const double flops = pairs * B * N * H * (backward ? 10.0 : 4.0);
  std::printf("  %-5s B=%lld T=%lld S=%lld N=%lld K=%lld H=%lld %-6s %-3s median %8.2f ms %6.1f GFLOP/s"
              "  cpu-time per thread %8.2f ms %6.1f GFLOP/s\n",
              type_name, static_cast<long long>(B), static_cast<long long>(T_len),
              static_cast<long long>(S), static_cast<long long>(N), static_cast<long long>(K),
              static_cast<long long>(H), causal ? "causal" : "full", backward ? "bwd" : "fwd",
              median * 1e3, flops / median * 1e-9, cpu * 1e3, flops / cpu * 1e-9);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "bench") {
    // bench [reps] [B T S N K H causal dtype [fwd|bwd]]: one case, else the standard set.
    const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
    std::printf("threads: %d\n", omp_get_max_threads());
    if (argc > 10) {
      const int64_t B = std::atoll(argv[3]), T = std::atoll(argv[4]), S = std::atoll(argv[5]),
                    N = std::atoll(argv[6]), K = std::atoll(argv[7]), H = std::atoll(argv[8]);
      const bool causal = std::atoi(argv[9]) != 0;
      const std::string dtype = argv[10];
      const std::string pass = argc > 11 ? argv[11] : "both";
      for (bool backward : {false, true}) {
        if ((pass == "fwd" && backward) || (pass == "bwd" && !backward)) continue;
        if (dtype == "bf16") bench_case<bfloat16>(B, T, S, N, K, H, causal, backward, "bf16", reps);
        else if (dtype == "f16") bench_case<float16>(B, T, S, N, K, H, causal, backward, "f16", reps);
        else bench_case<float>(B, T, S, N, K, H, causal, backward, "f32", reps);
      }
      return 0;
    }
    for (bool causal : {false, true}) {
      for (bool backward : {false, true}) {
        bench_case<float>(1, 2048, 2048, 8, 8, 64, causal, backward, "f32", reps);
        bench_case<float>(4, 1024, 1024, 12, 12, 64, causal, backward, "f32", reps);
        bench_case<float>(1, 4096, 4096, 8, 8, 128, causal, backward, "f32", reps);
        bench_case<bfloat16>(1, 2048, 2048, 8, 8, 64, causal, backward, "bf16", reps);
      }
    }
    bench_case<float>(8, 1, 4096, 32, 8, 128, false, false, "f32", reps);
    bench_case<float>(8, 1, 4096, 32, 32, 128, false, false, "f32", reps);
    return 0;
  }
  bool ok = true;
  for (int threads : {1, 2}) {
    std::printf("threads=%d\n", threads);
    for (const Case& c : cases()) {
      ok &= run_case<float>(c, threads, "f32");
      if (threads == 2) {
        ok &= run_case<bfloat16>(c, threads, "bf16");
        ok &= run_case<float16>(c, threads, "f16");
      }
    }
  }
  ok &= run_fully_masked_rows();
  std::printf(ok ? "ALL PASSED\n" : "FAILURES\n");
  return ok ? 0 : 1;
}
