// Standalone test of cpu/attention against a naive double-precision loop, and a
// quick timing. The suite builds and runs it (tests/test_cpp_kernels.py: a
// test here prints "ALL PASSED" and exits 0 when every case passes); CMake
// builds it with -DJAXOPS_BUILD_CPP_TESTS=ON (run by ctest), or by hand from
// the repository root:
//   g++ -std=c++17 -O2 -fopenmp -march=native -I. -I<eigen3 include dir>
//       cpu/attention*.cc tests/cpp/attention_test.cc -o attention_test
// Run: ./attention_test                  (correctness; exit status 1 on failure)
//      ./attention_test quick            (fewer runs of the same cases, ~1/2 of the
//      time: 2 threads only, not float32 on 1 as well; in the forward-mode
//      checks, one tangent subset per case in turn besides all tangents; the
//      suite's run under qemu-aarch64)
//      ./attention_test bench [reps]     (timing of a standard set of shapes)
//      ./attention_test bench reps B T S N K H causal {f32,bf16,f16} [fwd|bwd|jvp]
//      (jvp: the forward-mode kernel timed alternately with the forward)
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
  int32_t offset = 0;
  int64_t wl = -1, wr = -1;
  bool q_lengths = false, kv_lengths = false;
  // Broadcast shape of mask / bias over [B, N, T, S]: 1 = broadcast, 0 = full; empty = absent.
  std::vector<int> mask_bcast = {}, bias_bcast = {};
  float scale = 0;  // 0: 1/sqrt(H)
  bool with_dlse = false;  // backward also gets a logsumexp cotangent
  // Forward mode: a full-shaped bias tangent is NaN at every masked (b, n, t, key).
  bool nan_dbias_where_masked = false;
};

struct Problem {
  AttentionParams p;
  // The operands p points to; on the heap, so they stay put when a Problem moves.
  std::vector<int32_t> query_offset, q_len, kv_len;
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
  pr.query_offset = {c.offset};
  p.query_offset = pr.query_offset.data();
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
  const int64_t pos = t + *p.query_offset;
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

// The probabilities of row t of head n over all S keys (0 at the keys it does
// not attend) and the row's logsumexp: -inf when it attends no key, and then
// every probability is 0.
double row_softmax(const AttentionParams& p, const std::vector<double>& q,
                   const std::vector<double>& k, int64_t b, int64_t n, int64_t t,
                   std::vector<double>* prob) {
  const int64_t T = p.q_len, S = p.kv_len, N = p.num_heads, K = p.num_kv_heads, H = p.head_dim;
  const int64_t kh = n / (N / K);
  const double* qr = &q[((b * T + t) * N + n) * H];
  double mx = kNegInf;
  for (int64_t j = 0; j < S; ++j) {
    if (!attended(p, b, n, t, j)) {
      (*prob)[j] = kNegInf;
      continue;
    }
    const double* kr = &k[((b * S + j) * K + kh) * H];
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += qr[h] * kr[h];
    (*prob)[j] = dot * p.scale + bias_at(p, b, n, t, j);
    mx = std::max(mx, (*prob)[j]);
  }
  if (mx == kNegInf) {
    std::fill(prob->begin(), prob->end(), 0.0);
    return kNegInf;
  }
  double sum = 0;
  for (int64_t j = 0; j < S; ++j) {
    (*prob)[j] = (*prob)[j] == kNegInf ? 0.0 : std::exp((*prob)[j] - mx);
    sum += (*prob)[j];
  }
  for (int64_t j = 0; j < S; ++j) (*prob)[j] /= sum;
  return mx + std::log(sum);
}

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
        const double lse = row_softmax(p, q, k, b, n, t, &prob);
        if (lse == kNegInf) continue;
        r.lse[(b * N + n) * T + t] = lse;
        double* o = &r.out[((b * T + t) * N + n) * H];
        for (int64_t j = 0; j < S; ++j) {
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

// A case's problem and random query, key and value, as T and as the doubles
// they round to.
template <typename T>
struct Inputs {
  Problem pr;
  std::vector<T> q, k, v;
  std::vector<double> qd, kd, vd;
};

template <typename T>
Inputs<T> make_inputs(const Case& c, std::mt19937& rng, int threads) {
  Inputs<T> in;
  in.pr = make_problem(c, rng, threads);
  in.q = random_tensor<T>(c.B * c.T * c.N * c.H, rng, &in.qd);
  in.k = random_tensor<T>(c.B * c.S * c.K * c.H, rng, &in.kd);
  in.v = random_tensor<T>(c.B * c.S * c.K * c.H, rng, &in.vd);
  return in;
}

template <typename T>
bool run_case(const Case& c, int threads, const char* type_name) {
  std::mt19937 rng(1234 + c.T * 7 + c.S * 13 + c.H);
  const Inputs<T> in = make_inputs<T>(c, rng, threads);
  const Problem& pr = in.pr;
  const AttentionParams& p = pr.p;
  if (const char* err = jaxops::cpu::attention_params_error(p)) {
    std::printf("  %s: invalid params: %s\n", c.name.c_str(), err);
    return false;
  }
  const int64_t qn = c.B * c.T * c.N * c.H, kn = c.B * c.S * c.K * c.H;
  std::vector<double> dod;
  auto dout = random_tensor<T>(qn, rng, &dod);
  std::vector<double> dlse_d;
  std::vector<float> dlse;
  if (c.with_dlse) dlse = random_tensor<float>(c.B * c.N * c.T, rng, &dlse_d);
  Reference ref = reference(pr, in.qd, in.kd, in.vd, dod, dlse_d);

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

  jaxops::cpu::attention_fwd<T>(p, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data(),
                                ws.data());
  jaxops::cpu::attention_bwd<T>(p, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data(),
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

struct JvpReference {
  std::vector<double> out, lse, dout, dlse;
};

// Forward mode, naively in double from the definition: per (b, n, t) row, the
// logits' tangents ds_j = scale (dq . k_j + q . dk_j) + dbias_j over the
// attended keys, dlse = sum_j p_j ds_j and dout = sum_j p_j (ds_j - dlse) v_j
// + sum_j p_j dv_j. An empty tangent is zero.
JvpReference reference_jvp(const Problem& pr, const std::vector<double>& q,
                           const std::vector<double>& k, const std::vector<double>& v,
                           const std::vector<double>& dq, const std::vector<double>& dk,
                           const std::vector<double>& dv, const std::vector<double>& dbias) {
  const AttentionParams& p = pr.p;
  const int64_t B = p.batch, T = p.q_len, S = p.kv_len, N = p.num_heads, K = p.num_kv_heads,
                H = p.head_dim, G = N / K;
  JvpReference r;
  r.out.assign(B * T * N * H, 0.0);
  r.dout.assign(B * T * N * H, 0.0);
  r.lse.assign(B * N * T, kNegInf);
  r.dlse.assign(B * N * T, 0.0);
  std::vector<double> prob(S), ds(S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t kh = n / G;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = ((b * T + t) * N + n) * H, stat = (b * N + n) * T + t;
        const double lse = row_softmax(p, q, k, b, n, t, &prob);
        if (lse == kNegInf) continue;
        r.lse[stat] = lse;
        double mu = 0;
        for (int64_t j = 0; j < S; ++j) {
          ds[j] = 0;
          if (!attended(p, b, n, t, j)) continue;
          const int64_t key = ((b * S + j) * K + kh) * H;
          double dot = 0;
          for (int64_t h = 0; h < H; ++h) {
            if (!dq.empty()) dot += dq[row + h] * k[key + h];
            if (!dk.empty()) dot += q[row + h] * dk[key + h];
          }
          ds[j] = p.scale * dot;
          if (!dbias.empty()) {
            const int64_t* s = p.bias_strides;
            ds[j] += dbias[b * s[0] + n * s[1] + t * s[2] + j * s[3]];
          }
          mu += prob[j] * ds[j];
        }
        r.dlse[stat] = mu;
        for (int64_t j = 0; j < S; ++j) {
          if (prob[j] == 0.0) continue;
          const int64_t key = ((b * S + j) * K + kh) * H;
          for (int64_t h = 0; h < H; ++h) {
            r.out[row + h] += prob[j] * v[key + h];
            r.dout[row + h] += prob[j] * (ds[j] - mu) * v[key + h];
            if (!dv.empty()) r.dout[row + h] += prob[j] * dv[key + h];
          }
        }
      }
    }
  }
  return r;
}

// Which tangents a forward-mode run passes (the others are null: zero).
enum TangentSet { kDq = 1, kDk = 2, kDv = 4, kDbias = 8 };

std::string tangent_set_name(int set) {
  if (set == 0) return "none";
  std::string name;
  for (auto [bit, what] : {std::pair{kDq, "dq"}, {kDk, "dk"}, {kDv, "dv"}, {kDbias, "dbias"}}) {
    if (set & bit) name += name.empty() ? what : std::string("+") + what;
  }
  return name;
}

// attention_fwd_jvp against reference_jvp for each tangent absent and
// present (none, each alone, all), and its primal results against
// attention_fwd's. With pick >= 0 (quick), only the sets of every tangent and
// one other, number pick of the rest in turn: the cases together still cover each.
template <typename T>
bool run_jvp_case(const Case& c, int threads, const char* type_name, int pick = -1) {
  std::mt19937 rng(4321 + c.T * 7 + c.S * 13 + c.H);
  const Inputs<T> in = make_inputs<T>(c, rng, threads);
  const AttentionParams& p = in.pr.p;
  const int64_t qn = c.B * c.T * c.N * c.H, kn = c.B * c.S * c.K * c.H, stats = c.B * c.N * c.T;
  std::vector<double> dqd, dkd, dvd, dbd;
  auto dq = random_tensor<T>(qn, rng, &dqd);
  auto dk = random_tensor<T>(kn, rng, &dkd);
  auto dv = random_tensor<T>(kn, rng, &dvd);
  std::vector<float> dbias;
  if (p.bias) dbias = random_tensor<float>(in.pr.bias.size(), rng, &dbd);
  if (c.nan_dbias_where_masked) {
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t n = 0; n < c.N; ++n) {
        for (int64_t t = 0; t < c.T; ++t) {
          for (int64_t j = 0; j < c.S; ++j) {
            if (!attended(p, b, n, t, j)) dbias[((b * c.N + n) * c.T + t) * c.S + j] = NAN;
          }
        }
      }
    }
  }

  std::vector<T> fwd_out(qn), out(qn), dout(qn);
  std::vector<float> fwd_lse(stats), lse(stats), dlse(stats);
  std::vector<char> ws(std::max(jaxops::cpu::attention_fwd_workspace_bytes<T>(p),
                                jaxops::cpu::attention_fwd_jvp_workspace_bytes<T>(p)));
  jaxops::cpu::attention_fwd<T>(p, in.q.data(), in.k.data(), in.v.data(), fwd_out.data(),
                                fwd_lse.data(), ws.data());
  std::vector<int> sets = {0, kDq, kDk, kDv, kDq | kDk | kDv};
  if (p.bias) {
    sets.push_back(kDbias);
    sets.push_back(kDq | kDk | kDv | kDbias);
  }
  if (pick >= 0) {
    std::vector<int> every, others;
    for (int set : sets) {
      ((set | kDbias) == (kDq | kDk | kDv | kDbias) ? every : others).push_back(set);
    }
    every.push_back(others[pick % others.size()]);
    sets = every;
  }
  bool ok = true;
  const double tol = tolerance<T>();
  double e_out = 0, e_lse = 0, e_dout = 0, e_dlse = 0, e_primal = 0;
  for (int set : sets) {
    const std::vector<double> none;
    JvpReference ref = reference_jvp(in.pr, in.qd, in.kd, in.vd, set & kDq ? dqd : none,
                                     set & kDk ? dkd : none, set & kDv ? dvd : none,
                                     set & kDbias ? dbd : none);
    // Poison outputs and workspace: every element must be written.
    std::fill(ws.begin(), ws.end(), static_cast<char>(0xff));
    for (auto* x : {&out, &dout}) std::fill(x->begin(), x->end(), static_cast<T>(NAN));
    for (auto* x : {&lse, &dlse}) std::fill(x->begin(), x->end(), NAN);
    jaxops::cpu::attention_fwd_jvp<T>(
        p, in.q.data(), in.k.data(), in.v.data(), set & kDq ? dq.data() : nullptr,
        set & kDk ? dk.data() : nullptr, set & kDv ? dv.data() : nullptr,
        set & kDbias ? dbias.data() : nullptr, out.data(), lse.data(), dout.data(), dlse.data(),
        ws.data());
    bool set_ok = true;
    e_out = std::max(e_out, compare("out", out, ref.out, tol, &set_ok));
    e_lse = std::max(e_lse, compare("lse", lse, ref.lse, std::max(tol, 1e-5), &set_ok));
    e_dout = std::max(e_dout, compare("dout", dout, ref.dout, 2 * tol, &set_ok));
    e_dlse = std::max(e_dlse, compare("dlse", dlse, ref.dlse, 2 * tol, &set_ok));
    // The primal results are the forward's up to float32 rounding (the
    // outputs' own rounding for bf16 and f16: one unit in the last place).
    std::vector<double> fwd_out_d(fwd_out.begin(), fwd_out.end());
    std::vector<double> fwd_lse_d(fwd_lse.begin(), fwd_lse.end());
    e_primal = std::max(e_primal, compare("out vs forward", out, fwd_out_d, tol, &set_ok));
    e_primal = std::max(e_primal, compare("lse vs forward", lse, fwd_lse_d, 1e-5, &set_ok));
    if (!set_ok) std::printf("    (tangents: %s)\n", tangent_set_name(set).c_str());
    ok &= set_ok;
  }
  std::printf("  %-5s %-34s %s  jvp out %.1e lse %.1e dout %.1e dlse %.1e vs fwd %.1e\n",
              type_name, c.name.c_str(), ok ? "ok  " : "FAIL", e_out, e_lse, e_dout, e_dlse,
              e_primal);
  return ok;
}

// Fully masked rows must give exactly 0 and -inf, and gradients and tangents
// exactly 0.
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
  std::vector<float> jvp_out(qn), jvp_lse(c.B * c.N * c.T), jvp_dout(qn), jvp_dlse(c.B * c.N * c.T);
  std::vector<char> ws(std::max({jaxops::cpu::attention_fwd_workspace_bytes<float>(p),
                                 jaxops::cpu::attention_bwd_workspace_bytes<float>(p, false),
                                 jaxops::cpu::attention_fwd_jvp_workspace_bytes<float>(p)}));
  jaxops::cpu::attention_fwd<float>(p, q.data(), k.data(), v.data(), out.data(), lse.data(), ws.data());
  jaxops::cpu::attention_bwd<float>(p, q.data(), k.data(), v.data(), out.data(), lse.data(),
                                    dout.data(), nullptr, dq.data(), dk.data(), dv.data(), nullptr,
                                    ws.data());
  // Tangents: any nonzero data (dout, v and k).
  jaxops::cpu::attention_fwd_jvp<float>(p, q.data(), k.data(), v.data(), dout.data(), v.data(),
                                        k.data(), nullptr, jvp_out.data(), jvp_lse.data(),
                                        jvp_dout.data(), jvp_dlse.data(), ws.data());
  bool ok = true;
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t b = 0; b < c.B; ++b) {
        const bool masked = b == 1 || t < 3;
        const float* o = &out[((b * c.T + t) * c.N + n) * c.H];
        const float* g = &dq[((b * c.T + t) * c.N + n) * c.H];
        const float* jo = &jvp_out[((b * c.T + t) * c.N + n) * c.H];
        const float* jd = &jvp_dout[((b * c.T + t) * c.N + n) * c.H];
        const float l = lse[(b * c.N + n) * c.T + t];
        const float jl = jvp_lse[(b * c.N + n) * c.T + t];
        const float jdl = jvp_dlse[(b * c.N + n) * c.T + t];
        if (masked) {
          for (int64_t h = 0; h < c.H; ++h) {
            ok &= o[h] == 0.0f && g[h] == 0.0f && jo[h] == 0.0f && jd[h] == 0.0f;
          }
          ok &= l == -std::numeric_limits<float>::infinity() && jl == l && jdl == 0.0f;
        } else {
          ok &= std::isfinite(l) && std::isfinite(jl) && std::isfinite(jdl);
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
    // Causal with offset 10 and a left window of 30 keys.
    Case c{"NaN dbias at masked keys", 2, 40, 75, 2, 1, 16, true, 10, 30};
    c.bias_bcast = {0, 0, 0, 0};
    c.mask_bcast = {0, 0, 0, 0};
    c.kv_lengths = true;
    c.nan_dbias_where_masked = true;
    cs.push_back(c);
  }
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

enum class Pass { kForward, kBackward, kJvp };

// Flops per attended (query, key) pair and head dimension: 2 products of 2H
// flops forward, 5 backward, 6 in forward mode (scores, their tangent's two
// terms, and the three value-side products).
double flops_per_pair_and_dim(Pass pass) {
  return pass == Pass::kForward ? 4.0 : pass == Pass::kBackward ? 10.0 : 12.0;
}

const char* pass_name(Pass pass) {
  return pass == Pass::kForward ? "fwd" : pass == Pass::kBackward ? "bwd" : "jvp";
}

// Median of reps calls after a warm-up. Pass::kJvp times the forward and the
// forward-mode kernel (tangents of q, k and v) alternately, so both see the
// machine's load alike, and prints both and the ratio of their times.
template <typename T>
void bench_case(int64_t B, int64_t T_len, int64_t S, int64_t N, int64_t K, int64_t H, bool causal,
                Pass pass, const char* type_name, int reps) {
  AttentionParams p;
  p.batch = B;
  p.q_len = T_len;
  p.kv_len = S;
  p.num_heads = N;
  p.num_kv_heads = K;
  p.head_dim = H;
  p.scale = 1.0f / std::sqrt(static_cast<float>(H));
  p.is_causal = causal;
  const int32_t query_offset = static_cast<int32_t>(causal ? S - T_len : 0);
  p.query_offset = &query_offset;
  p.num_threads = omp_get_max_threads();
  std::mt19937 rng(1);
  std::vector<double> tmp;
  const int64_t nq = B * T_len * N * H, nk = B * S * K * H;
  auto q = random_tensor<T>(nq, rng, &tmp);
  auto k = random_tensor<T>(nk, rng, &tmp);
  auto v = random_tensor<T>(nk, rng, &tmp);
  auto dout = random_tensor<T>(nq, rng, &tmp);
  std::vector<T> out(nq), dq(nq), dk(nk), dv(nk);
  std::vector<float> lse(B * N * T_len), dlse(B * N * T_len);
  std::vector<T> q_tangent, k_tangent, v_tangent;
  if (pass == Pass::kJvp) {
    q_tangent = random_tensor<T>(nq, rng, &tmp);
    k_tangent = random_tensor<T>(nk, rng, &tmp);
    v_tangent = random_tensor<T>(nk, rng, &tmp);
  }
  std::vector<char> ws(std::max({jaxops::cpu::attention_fwd_workspace_bytes<T>(p),
                                 jaxops::cpu::attention_bwd_workspace_bytes<T>(p, false),
                                 jaxops::cpu::attention_fwd_jvp_workspace_bytes<T>(p)}));
  auto run = [&](Pass which) {
    if (which == Pass::kForward) {
      jaxops::cpu::attention_fwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(), ws.data());
    } else if (which == Pass::kBackward) {
      jaxops::cpu::attention_bwd<T>(p, q.data(), k.data(), v.data(), out.data(), lse.data(),
                                    dout.data(), nullptr, dq.data(), dk.data(), dv.data(), nullptr,
                                    ws.data());
    } else {
      jaxops::cpu::attention_fwd_jvp<T>(p, q.data(), k.data(), v.data(), q_tangent.data(),
                                        k_tangent.data(), v_tangent.data(), nullptr, out.data(),
                                        lse.data(), dout.data(), dlse.data(), ws.data());
    }
  };
  run(Pass::kForward);
  const std::vector<Pass> timed =
      pass == Pass::kJvp ? std::vector<Pass>{Pass::kForward, Pass::kJvp} : std::vector<Pass>{pass};
  std::vector<std::vector<double>> times(timed.size()), cpu_times(timed.size());
  for (int r = 0; r < reps + 1; ++r) {
    for (size_t i = 0; i < timed.size(); ++i) {
      const double t0 = now_seconds(), c0 = cpu_seconds();
      run(timed[i]);
      if (r > 0) {
        times[i].push_back(now_seconds() - t0);
        cpu_times[i].push_back((cpu_seconds() - c0) / p.num_threads);
      }
    }
  }
  // Attended (query, key) pairs: under a causal mask, those of the lower
  // triangle (query t of S - T + t + 1 keys).
  double pairs = 0;
  for (int64_t t = 0; t < T_len; ++t) {
    pairs += causal ? std::min<int64_t>(S, t + query_offset + 1) : S;
  }
  std::vector<double> medians, cpu_medians;
  for (size_t i = 0; i < timed.size(); ++i) {
    std::sort(times[i].begin(), times[i].end());
    std::sort(cpu_times[i].begin(), cpu_times[i].end());
    const double median = times[i][times[i].size() / 2];
    const double cpu = cpu_times[i][cpu_times[i].size() / 2];
    medians.push_back(median);
    cpu_medians.push_back(cpu);
    const double flops = pairs * B * N * H * flops_per_pair_and_dim(timed[i]);
    std::printf("  %-5s B=%lld T=%lld S=%lld N=%lld K=%lld H=%lld %-6s %-3s median %8.2f ms %6.1f GFLOP/s"
                "  cpu-time per thread %8.2f ms %6.1f GFLOP/s\n",
                type_name, static_cast<long long>(B), static_cast<long long>(T_len),
                static_cast<long long>(S), static_cast<long long>(N), static_cast<long long>(K),
                static_cast<long long>(H), causal ? "causal" : "full", pass_name(timed[i]),
                median * 1e3, flops / median * 1e-9, cpu * 1e3, flops / cpu * 1e-9);
  }
  if (pass == Pass::kJvp) {
    std::printf("  jvp / fwd time: %.2fx (cpu-time %.2fx)\n", medians[1] / medians[0],
                cpu_medians[1] / cpu_medians[0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "bench") {
    // bench [reps] [B T S N K H causal dtype [fwd|bwd|jvp]]: one case (fwd and
    // bwd when no pass is named), else the standard set.
    const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
    std::printf("threads: %d\n", omp_get_max_threads());
    if (argc > 10) {
      const int64_t B = std::atoll(argv[3]), T = std::atoll(argv[4]), S = std::atoll(argv[5]),
                    N = std::atoll(argv[6]), K = std::atoll(argv[7]), H = std::atoll(argv[8]);
      const bool causal = std::atoi(argv[9]) != 0;
      const std::string dtype = argv[10];
      const std::string name = argc > 11 ? argv[11] : "";
      std::vector<Pass> passes = {Pass::kForward, Pass::kBackward};
      if (name == "fwd") passes = {Pass::kForward};
      if (name == "bwd") passes = {Pass::kBackward};
      if (name == "jvp") passes = {Pass::kJvp};
      for (Pass pass : passes) {
        if (dtype == "bf16") bench_case<bfloat16>(B, T, S, N, K, H, causal, pass, "bf16", reps);
        else if (dtype == "f16") bench_case<float16>(B, T, S, N, K, H, causal, pass, "f16", reps);
        else bench_case<float>(B, T, S, N, K, H, causal, pass, "f32", reps);
      }
      return 0;
    }
    for (bool causal : {false, true}) {
      for (Pass pass : {Pass::kForward, Pass::kBackward}) {
        bench_case<float>(1, 2048, 2048, 8, 8, 64, causal, pass, "f32", reps);
        bench_case<float>(4, 1024, 1024, 12, 12, 64, causal, pass, "f32", reps);
        bench_case<float>(1, 4096, 4096, 8, 8, 128, causal, pass, "f32", reps);
        bench_case<bfloat16>(1, 2048, 2048, 8, 8, 64, causal, pass, "bf16", reps);
      }
    }
    bench_case<float>(8, 1, 4096, 32, 8, 128, false, Pass::kForward, "f32", reps);
    bench_case<float>(8, 1, 4096, 32, 32, 128, false, Pass::kForward, "f32", reps);
    return 0;
  }
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";
  bool ok = true;
  for (int threads : {1, 2}) {
    if (quick && threads == 1) continue;
    std::printf("threads=%d\n", threads);
    int pick = quick ? 0 : -1;
    auto next = [&] { return quick ? pick++ : -1; };
    for (const Case& c : cases()) {
      ok &= run_case<float>(c, threads, "f32");
      ok &= run_jvp_case<float>(c, threads, "f32", next());
      if (threads == 2) {
        ok &= run_case<bfloat16>(c, threads, "bf16");
        ok &= run_case<float16>(c, threads, "f16");
        ok &= run_jvp_case<bfloat16>(c, threads, "bf16", next());
        ok &= run_jvp_case<float16>(c, threads, "f16", next());
      }
    }
  }
  ok &= run_fully_masked_rows();
  std::printf(ok ? "ALL PASSED\n" : "FAILURES\n");
  return ok ? 0 : 1;
}
