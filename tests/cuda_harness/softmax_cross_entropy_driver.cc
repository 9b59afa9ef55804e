// Test-only: runs every CUDA softmax and cross-entropy kernel (cuda/softmax.cu,
// cuda/cross_entropy.cu, compiled by the harness) on the shapes given on the
// command line, in float32, bfloat16 and float16, and checks the results
// against a double-precision reference: forward, backward and JVP (absent
// tangents, broadcast dbias, ignored and out-of-range labels). Built under
// AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_softmax_cross_entropy_sanitizers.py, where what
// matters most is that the sanitizers stay silent; each buffer is its own
// exact-size allocation, so a read past any row end (or past a broadcast mask
// or bias) is caught.
//
// usage: softmax_cross_entropy_driver ROWSxCOLS ...     exit status 0 when all agree
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/cross_entropy.h"
#include "cuda/softmax.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;
namespace params = jaxops::params;  // the parameter structs cuda/ shares

template <typename T>
double tolerance() {
  if (std::is_same<T, float>::value) return 2e-5;
  if (std::is_same<T, __half>::value) return 2e-3;
  return 1.6e-2;
}

// Kernel output against the reference: infinities must match, NaN must be NaN.
template <typename V>
void compare(const std::string& what, const V* actual, const std::vector<double>& expected,
             double tol) {
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<double>(static_cast<float>(actual[i]));
    const double e = expected[i];
    const bool ok = std::isnan(e)   ? std::isnan(a)
                    : std::isinf(e) ? a == e
                                    : std::fabs(a - e) <= tol * (1.0 + std::fabs(e));
    if (!ok) {
      std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i, a, e);
      ++g_failures;
      return;
    }
  }
}

template <typename T>
void fill(Buffer<T>& b, std::vector<double>& rounded, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.f, scale);
  rounded.resize(b.size);
  for (size_t i = 0; i < b.size; ++i) {
    b.data[i] = T(normal(rng));
    rounded[i] = static_cast<float>(b.data[i]);
  }
}

template <typename T>
std::vector<double> rounded_to(const std::vector<double>& values) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    out[i] = static_cast<float>(T(static_cast<float>(values[i])));
  }
  return out;
}

// Softmax of z (-inf: invisible) into p and log p; all 0 / -inf without a visible entry.
void softmax_row(const double* z, int64_t n, double* p, double* logp) {
  double m = -INFINITY;
  for (int64_t c = 0; c < n; ++c) m = std::fmax(m, z[c]);
  double s = 0.0;
  for (int64_t c = 0; c < n; ++c) s += m == -INFINITY ? 0.0 : std::exp(z[c] - m);
  for (int64_t c = 0; c < n; ++c) {
    p[c] = m == -INFINITY ? 0.0 : std::exp(z[c] - m) / s;
    logp[c] = m == -INFINITY || z[c] == -INFINITY ? -INFINITY : z[c] - m - std::log(s);
  }
}

// The JVPs from the forward's input and statistics (`input`, the masked
// softmax's) against the exact probabilities p (masked columns: 0) for the
// input tangent t = dx + dbias: dx present or absent, dbias absent, [1, cols]
// (inf at the masked columns, which must not reach the result) or [rows, 1].
template <typename T>
void run_softmax_jvp(const params::SoftmaxInput<T>& input, const std::vector<double>& p_exact,
                     const std::vector<double>& logp_exact, const Buffer<uint8_t>& where,
                     params::SoftmaxShape shape, const std::string& name, std::mt19937& rng) {
  const int64_t rows = shape.rows, cols = shape.cols;
  const size_t n = static_cast<size_t>(rows * cols);
  Buffer<T> dx(n), col_dbias(cols), row_dbias(rows), dy(n);
  std::vector<double> dxr, col_r, row_r;
  fill(dx, dxr, rng, 1.f);
  fill(col_dbias, col_r, rng, 1.f);
  fill(row_dbias, row_r, rng, 1.f);
  for (int64_t c = 0; c < cols; ++c) {
    if (!where.data[c]) {
      col_dbias.data[c] = T(INFINITY);
      col_r[c] = INFINITY;
    }
  }
  params::BroadcastOperand<T> by_col;  // [1, cols]
  by_col.data = col_dbias.data;
  by_col.axes = 1;
  by_col.row_sizes[0] = rows;
  by_col.row_strides[0] = 0;
  params::BroadcastOperand<T> by_row;  // [rows, 1]
  by_row.data = row_dbias.data;
  by_row.axes = 1;
  by_row.row_sizes[0] = rows;
  by_row.row_strides[0] = 1;
  by_row.col_stride = 0;
  const params::BroadcastOperand<T> dbias_cases[] = {{}, by_col, by_row};
  const char* dbias_names[] = {"no dbias", "dbias [1, cols]", "dbias [rows, 1]"};

  for (int log = 0; log < 2; ++log) {
    for (int has_dx = 0; has_dx < 2; ++has_dx) {
      for (int b = 0; b < 3; ++b) {
        const std::string what = std::string(log ? "log_softmax_jvp " : "softmax_jvp ") + name +
                                 (has_dx ? " dx, " : " no dx, ") + dbias_names[b];
        std::vector<double> ref(n);
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<double> t(cols), p(cols);
          double s = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            const size_t i = r * cols + c;
            t[c] = (has_dx ? dxr[i] : 0.0) + (b == 1 ? col_r[c] : 0.0) + (b == 2 ? row_r[r] : 0.0);
            p[c] = p_exact[i];
            if (logp_exact[i] > -INFINITY) s += p[c] * t[c];
          }
          for (int64_t c = 0; c < cols; ++c) {
            const bool part = logp_exact[r * cols + c] > -INFINITY;
            ref[r * cols + c] = !part ? 0.0 : (log ? t[c] - s : p[c] * (t[c] - s));
          }
        }
        const T* dx_data = has_dx ? dx.data : nullptr;
        check(log ? cuda::log_softmax_jvp<T>(nullptr, input, dx_data, dbias_cases[b], dy.data,
                                             shape)
                  : cuda::softmax_jvp<T>(nullptr, input, dx_data, dbias_cases[b], dy.data,
                                         shape, {}),
              what);
        compare(what, dy.data, ref, tolerance<T>() * 4);
      }
    }
  }
}

template <typename T>
void run_softmax(int64_t rows, int64_t cols, std::mt19937& rng) {
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(rows) + "x" +
                           std::to_string(cols);
  const size_t n = static_cast<size_t>(rows * cols);
  Buffer<T> x(n), dy(n), bias(rows), y(n), logy(n), causal(n), dx(n), dlogx(n);
  Buffer<float> stats(rows * params::kStatsPerRow), log_stats(rows * params::kStatsPerRow),
      causal_stats(rows * params::kStatsPerRow);
  Buffer<uint8_t> where(cols);
  std::vector<double> xr, dyr, br;
  fill(x, xr, rng, 2.f);
  fill(dy, dyr, rng, 1.f);
  fill(bias, br, rng, 1.f);
  for (int64_t c = 0; c < cols; ++c) where.data[c] = (c * 7) % 3 != 0;
  // A mask of shape [1, cols] and a bias of shape [rows, 1].
  params::BroadcastOperand<uint8_t> where_view;
  where_view.data = where.data;
  params::BroadcastOperand<T> bias_view;
  bias_view.data = bias.data;
  bias_view.axes = 1;
  bias_view.row_sizes[0] = rows;
  bias_view.row_strides[0] = 1;
  bias_view.col_stride = 0;

  std::vector<double> p(n), logp(n), causal_p(n), causal_logp(n), z(cols);
  // The statistics the forwards must save (params/softmax.h): m and 1 / sum.
  std::vector<double> stats_ref(rows * params::kStatsPerRow),
      causal_stats_ref(rows * params::kStatsPerRow);
  const auto row_stats = [](const double* v, int64_t count, double* out) {
    double m = -INFINITY, sum = 0.0;
    for (int64_t c = 0; c < count; ++c) m = std::fmax(m, v[c]);
    for (int64_t c = 0; c < count; ++c) sum += v[c] == -INFINITY ? 0.0 : std::exp(v[c] - m);
    out[0] = m;
    out[1] = m == -INFINITY ? 0.0 : 1.0 / sum;
  };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      // (x + bias is rounded to float32 as the kernel rounds it.)
      z[c] = where.data[c] ? static_cast<float>(static_cast<float>(xr[r * cols + c]) +
                                                static_cast<float>(bias.data[r]))
                           : -INFINITY;
    }
    softmax_row(z.data(), cols, &p[r * cols], &logp[r * cols]);
    row_stats(z.data(), cols, &stats_ref[r * params::kStatsPerRow]);
    row_stats(&xr[r * cols], std::min<int64_t>(r + 1, cols),
              &causal_stats_ref[r * params::kStatsPerRow]);
    // Causal over [rows, cols] with offset 0: row r sees columns <= r.
    const int64_t visible = std::min<int64_t>(r + 1, cols);
    softmax_row(&xr[r * cols], visible, &causal_p[r * cols], &causal_logp[r * cols]);
    for (int64_t c = visible; c < cols; ++c) causal_p[r * cols + c] = 0.0;
  }
  const params::SoftmaxShape shape{rows, cols};
  const double tol = tolerance<T>();
  check(cuda::softmax_fwd<T>(nullptr, x.data, where_view, bias_view, y.data, stats.data, shape,
                             params::SoftmaxOutput::kProbabilities, {}),
        "softmax_fwd " + name);
  compare("softmax_fwd " + name, y.data, p, tol);
  compare("softmax_fwd stats " + name, stats.data, stats_ref, 2e-6);
  check(cuda::softmax_fwd<T>(nullptr, x.data, where_view, bias_view, logy.data, log_stats.data,
                             shape, params::SoftmaxOutput::kLogProbabilities, {}),
        "log_softmax_fwd " + name);
  compare("log_softmax_fwd " + name, logy.data, logp, tol * 4);
  compare("log_softmax_fwd stats " + name, log_stats.data, stats_ref, 2e-6);
  check(cuda::softmax_fwd<T>(nullptr, x.data, {}, {}, causal.data, causal_stats.data, shape,
                             params::SoftmaxOutput::kProbabilities, {rows, 0}),
        "causal_softmax_fwd " + name);
  compare("causal_softmax_fwd " + name, causal.data, causal_p, tol);
  compare("causal_softmax_fwd stats " + name, causal_stats.data, causal_stats_ref, 2e-6);

  // The derivatives recompute p in float32 from x and the statistics: they
  // are compared with the exact derivatives, not with ones from the rounded y.
  std::vector<double> dx_ref(n), dlogx_ref(n);
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0.0, visible_sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = r * cols + c;
      dot += p[i] * dyr[i];
      if (logp[i] > -INFINITY) visible_sum += dyr[i];
    }
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = r * cols + c;
      dx_ref[i] = p[i] * (dyr[i] - dot);
      dlogx_ref[i] = logp[i] > -INFINITY ? dyr[i] - p[i] * visible_sum : 0.0;
    }
  }
  const params::SoftmaxInput<T> masked{x.data, where_view, bias_view, stats.data};
  check(cuda::softmax_bwd<T>(nullptr, dy.data, masked, dx.data, shape, {}),
        "softmax_bwd " + name);
  compare("softmax_bwd " + name, dx.data, dx_ref, tol * 4);
  // causal_softmax's backward: softmax's over each row's visible prefix, 0 past it.
  std::vector<double> causal_dx_ref(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = std::min<int64_t>(r + 1, cols);
    double dot = 0.0;
    for (int64_t c = 0; c < visible; ++c) dot += causal_p[r * cols + c] * dyr[r * cols + c];
    for (int64_t c = 0; c < visible; ++c) {
      const size_t i = r * cols + c;
      causal_dx_ref[i] = causal_p[i] * (dyr[i] - dot);
    }
  }
  const params::SoftmaxInput<T> causal_input{x.data, {}, {}, causal_stats.data};
  check(cuda::softmax_bwd<T>(nullptr, dy.data, causal_input, dx.data, shape, {rows, 0}),
        "causal_softmax_bwd " + name);
  compare("causal_softmax_bwd " + name, dx.data, causal_dx_ref, tol * 4);
  // causal_softmax's tangent is the same map over the prefix.
  check(cuda::softmax_jvp<T>(nullptr, causal_input, dy.data, {}, dx.data, shape, {rows, 0}),
        "causal_softmax_jvp " + name);
  compare("causal_softmax_jvp " + name, dx.data, causal_dx_ref, tol * 4);
  const params::SoftmaxInput<T> log_masked{x.data, where_view, bias_view, log_stats.data};
  check(cuda::log_softmax_bwd<T>(nullptr, dy.data, log_masked, dlogx.data, shape),
        "log_softmax_bwd " + name);
  compare("log_softmax_bwd " + name, dlogx.data, dlogx_ref, tol * 4);
  run_softmax_jvp<T>(masked, p, logp, where, shape, name, rng);
}

// The loss's tangent from the forward's lse, with int32 and int64 labels
// (ignored and out-of-range ones among them: 0).
template <typename T>
void run_cross_entropy_jvp(const Buffer<T>& logits, const std::vector<double>& xr,
                           const Buffer<int32_t>& labels, const Buffer<float>& lse,
                           params::CrossEntropyShape shape, params::CrossEntropyOptions options,
                           const std::string& name, std::mt19937& rng) {
  const int64_t rows = shape.rows, vocab = shape.vocab;
  const double eps = options.label_smoothing, z_loss = options.z_loss;
  Buffer<T> dlogits(static_cast<size_t>(rows * vocab));
  Buffer<int64_t> wide_labels(rows);
  Buffer<float> dloss(rows), wide_dloss(rows);
  std::vector<double> dr;
  fill(dlogits, dr, rng, 1.f);
  std::vector<double> ref(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t l = labels.data[r];
    wide_labels.data[r] = l;
    if (l == options.ignore_index || l < 0 || l >= vocab) continue;
    double p_dot = 0.0, total = 0.0;
    for (int64_t c = 0; c < vocab; ++c) {
      const size_t i = r * vocab + c;
      p_dot += std::exp(xr[i] - lse.data[r]) * dr[i];
      total += dr[i];
    }
    ref[r] = (1 + 2 * z_loss * lse.data[r]) * p_dot - eps * total / vocab -
             (1 - eps) * dr[r * vocab + l];
  }
  const double tol = 1e-5 * std::sqrt(vocab);
  check(cuda::cross_entropy_jvp<T, int32_t>(nullptr, logits.data, labels.data, lse.data,
                                            dlogits.data, dloss.data, shape, options),
        "cross_entropy_jvp " + name);
  compare("cross_entropy_jvp " + name, dloss.data, ref, tol);
  check(cuda::cross_entropy_jvp<T, int64_t>(nullptr, logits.data, wide_labels.data, lse.data,
                                            dlogits.data, wide_dloss.data, shape, options),
        "cross_entropy_jvp int64 labels " + name);
  compare("cross_entropy_jvp int64 labels " + name, wide_dloss.data, ref, tol);
}

template <typename T>
void run_cross_entropy(int64_t rows, int64_t vocab, std::mt19937& rng) {
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(rows) + "x" +
                           std::to_string(vocab);
  const size_t n = static_cast<size_t>(rows * vocab);
  const params::CrossEntropyOptions options{-100, 0.1f, 1e-3f};
  const double eps = options.label_smoothing, z_loss = options.z_loss;
  Buffer<T> logits(n), dlogits(n), in_place(n);
  Buffer<int32_t> labels(rows);
  Buffer<float> loss(rows), lse(rows), dloss(rows), grad_loss(rows);
  std::vector<double> xr, unused;
  fill(logits, xr, rng, 2.f);
  std::uniform_int_distribution<int32_t> label(0, static_cast<int32_t>(vocab - 1));
  for (int64_t r = 0; r < rows; ++r) {
    labels.data[r] = r % 5 == 1 ? -100 : (r % 7 == 3 ? static_cast<int32_t>(vocab) : label(rng));
    dloss.data[r] = 0.5f + static_cast<float>(r % 3);
  }
  std::vector<double> loss_ref(rows), lse_ref(rows), d_ref(n), unit_ref(n);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t l = labels.data[r];
    const bool ignored = l == -100, valid = !ignored && l >= 0 && l < vocab;
    const double* z = &xr[r * vocab];
    if (!valid) {
      loss_ref[r] = ignored ? 0.0 : NAN;
      lse_ref[r] = 0.0;
      for (int64_t c = 0; c < vocab; ++c) d_ref[r * vocab + c] = unit_ref[r * vocab + c] = 0.0;
      continue;
    }
    double m = -INFINITY, total = 0.0, s = 0.0;
    for (int64_t c = 0; c < vocab; ++c) m = std::fmax(m, z[c]), total += z[c];
    for (int64_t c = 0; c < vocab; ++c) s += std::exp(z[c] - m);
    const double l_se = m + std::log(s);
    lse_ref[r] = l_se;
    loss_ref[r] = (1 - eps) * (l_se - z[l]) + eps * (l_se - total / vocab) + z_loss * l_se * l_se;
    for (int64_t c = 0; c < vocab; ++c) {
      const double unit = std::exp(z[c] - l_se) * (1 + 2 * z_loss * l_se) - eps / vocab -
                          (c == l ? 1 - eps : 0.0);
      unit_ref[r * vocab + c] = unit;
      d_ref[r * vocab + c] = unit * static_cast<double>(dloss.data[r]);
    }
  }
  const params::CrossEntropyShape shape{rows, vocab};
  const double tol = tolerance<T>();
  check(cuda::cross_entropy_fwd<T, int32_t>(nullptr, logits.data, labels.data, loss.data, lse.data,
                                            shape, options),
        "cross_entropy_fwd " + name);
  compare("cross_entropy_fwd loss " + name, loss.data, loss_ref, 1e-5 * std::sqrt(vocab));
  compare("cross_entropy_fwd lse " + name, lse.data, lse_ref, 1e-5 * std::sqrt(vocab));
  check(cuda::cross_entropy_bwd<T, int32_t>(nullptr, logits.data, labels.data, lse.data,
                                            dloss.data, dlogits.data, shape, options),
        "cross_entropy_bwd " + name);
  compare("cross_entropy_bwd " + name, dlogits.data, rounded_to<T>(d_ref), tol * 4);
  // In place: dlogits written over a copy of the logits.
  for (size_t i = 0; i < n; ++i) in_place.data[i] = logits.data[i];
  check(cuda::cross_entropy_fwd_grad<T, int32_t>(nullptr, in_place.data, labels.data,
                                                 grad_loss.data, in_place.data, shape, options),
        "cross_entropy_fwd_grad " + name);
  compare("cross_entropy_fwd_grad loss " + name, grad_loss.data, loss_ref, 1e-5 * std::sqrt(vocab));
  compare("cross_entropy_fwd_grad dlogits " + name, in_place.data, rounded_to<T>(unit_ref),
          tol * 4);
  run_cross_entropy_jvp<T>(logits, xr, labels, lse, shape, options, name, rng);
}

template <typename T>
void run(int64_t rows, int64_t cols, std::mt19937& rng) {
  run_softmax<T>(rows, cols, rng);
  run_cross_entropy<T>(rows, cols, rng);
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  for (int i = 1; i < argc; ++i) {
    long long rows = 0, cols = 0;
    if (std::sscanf(argv[i], "%lldx%lld", &rows, &cols) != 2 || rows < 1 || cols < 1) {
      std::fprintf(stderr, "bad shape %s (ROWSxCOLS)\n", argv[i]);
      return 2;
    }
    run<float>(rows, cols, rng);
    run<__nv_bfloat16>(rows, cols, rng);
    run<__half>(rows, cols, rng);
  }
  std::printf("%s: %d failure(s)\n", argv[0], g_failures);
  return g_failures == 0 ? 0 : 1;
}
