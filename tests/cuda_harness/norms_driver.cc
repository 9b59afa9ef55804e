// Test-only: runs every CUDA norm kernel (cuda/norms.cu, compiled by the harness)
// on the shapes given on the command line, in float32, bfloat16 and float16,
// and checks the results against a double-precision reference: forward,
// backward, and the JVP with absent (null) weight and tangents. Built under
// AddressSanitizer and ThreadSanitizer by tests/test_cuda_harness_checks.py,
// where what matters most is that the sanitizers stay silent; each buffer is its
// own exact-size allocation, so a read past any row end is caught.
//
// usage: norms_driver ROWSxCOLS[/GROUPS[/PARTS]] ...     exit status 0 when all agree
// PARTS: the backward's parts per group (default: as the contract sizes them for
// CUDA, 256 in all); fewer give each part several rows on small shapes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda/norms.h"
#include "driver_common.h"

namespace {

using jaxops::params::NormShape;
using jaxops::params::WeightGradLayout;

template <typename T>
double tolerance() {
  if (std::is_same<T, float>::value) return 2e-4;
  if (std::is_same<T, __half>::value) return 4e-3;
  return 3e-2;
}

// Compares a kernel output with the reference; `scale` widens the tolerance of
// sums over many rows.
template <typename V>
void compare(const std::string& what, const V* actual, const std::vector<double>& expected,
             double tol, double scale = 1.0) {
  double worst = 0.0;
  size_t worst_at = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<double>(static_cast<float>(actual[i]));
    const double excess = std::fabs(a - expected[i]) / (tol * scale * (1.0 + std::fabs(expected[i])));
    if (!(excess <= worst)) {
      worst = std::isnan(excess) ? INFINITY : excess;
      worst_at = i;
    }
  }
  if (worst > 1.0) {
    std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), worst_at,
                 static_cast<double>(static_cast<float>(actual[worst_at])), expected[worst_at]);
    ++g_failures;
  }
}

template <typename T>
void fill(Buffer<T>& b, std::vector<double>& rounded, std::mt19937& rng, double offset) {
  std::normal_distribution<float> normal(0.f, 1.f);
  rounded.resize(b.size);
  for (size_t i = 0; i < b.size; ++i) {
    b.data[i] = T(static_cast<float>(offset) + normal(rng));
    rounded[i] = static_cast<float>(b.data[i]);
  }
}

// Which of the JVP's optional operands a case passes (the others are null):
// each pointer is null in some case, and all are present in one.
struct JvpOperands {
  bool weight, dx, dweight, dbias;
};
constexpr JvpOperands kJvpCases[] = {{true, true, true, true},
                                     {false, true, false, false},
                                     {true, false, true, true},
                                     {false, true, false, true},
                                     {false, false, false, false}};

// layer_norm_jvp (centered) or rms_norm_jvp from the forward's statistics (mean
// null for rms_norm), against a double reference that reads the same float32
// statistics.
template <typename T>
void check_jvp(const Buffer<T>& x, const std::vector<double>& xr, const Buffer<T>& weight,
               const std::vector<double>& wr, const float* mean, const float* rstd,
               NormShape shape, const std::string& name, std::mt19937& rng) {
  const int64_t rows = shape.rows, cols = shape.cols;
  const size_t n = static_cast<size_t>(rows * cols);
  const bool centered = mean != nullptr;
  Buffer<T> dx(n), dweight(cols), dbias(cols), dy(n);
  std::vector<double> dxr, dwr, dbr;
  fill(dx, dxr, rng, 0.0);
  fill(dweight, dwr, rng, 0.0);
  fill(dbias, dbr, rng, 0.0);
  for (const JvpOperands& has : kJvpCases) {
    if (!centered && has.dbias) continue;
    const std::string what = std::string(centered ? "layer_norm_jvp " : "rms_norm_jvp ") + name +
                             " operands " + std::to_string(has.weight) + std::to_string(has.dx) +
                             std::to_string(has.dweight) + std::to_string(has.dbias);
    std::vector<double> dy_ref(n);
    for (int64_t r = 0; r < rows; ++r) {
      const double m = centered ? mean[r] : 0.0, s = rstd[r];
      double sum_dx = 0.0, sum_xhat_dx = 0.0;
      for (int64_t c = 0; c < cols; ++c) {
        const double d = has.dx ? dxr[r * cols + c] : 0.0;
        sum_dx += d;
        sum_xhat_dx += (xr[r * cols + c] - m) * s * d;
      }
      for (int64_t c = 0; c < cols; ++c) {
        const double xhat = (xr[r * cols + c] - m) * s;
        const double d = has.dx ? dxr[r * cols + c] : 0.0;
        const double mean_dx = centered ? sum_dx / cols : 0.0;
        const double dxhat = s * (d - mean_dx - xhat * sum_xhat_dx / cols);
        dy_ref[r * cols + c] = dxhat * (has.weight ? wr[c] : 1.0) +
                               xhat * (has.dweight ? dwr[c] : 0.0) + (has.dbias ? dbr[c] : 0.0);
      }
    }
    const T* w = has.weight ? weight.data : nullptr;
    const T* d = has.dx ? dx.data : nullptr;
    const T* dw = has.dweight ? dweight.data : nullptr;
    if (centered) {
      check(jaxops::cuda::layer_norm_jvp<T>(nullptr, x.data, w, mean, rstd, d, dw,
                                            has.dbias ? dbias.data : nullptr, dy.data, shape),
            what);
    } else {
      check(jaxops::cuda::rms_norm_jvp<T>(nullptr, x.data, w, rstd, d, dw, dy.data, shape), what);
    }
    compare(what, dy.data, dy_ref, tolerance<T>(), 4.0);
  }
}

template <typename T>
void run(int64_t rows, int64_t cols, int64_t groups, int64_t parts, std::mt19937& rng) {
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(rows) + "x" +
                           std::to_string(cols) + "/" + std::to_string(groups) + "/" +
                           std::to_string(parts);
  const size_t n = static_cast<size_t>(rows * cols);
  const double tol = tolerance<T>();
  const float eps = 1e-5f;
  const NormShape shape{rows, cols};
  const WeightGradLayout layout{groups, parts};
  const double rows_scale = std::sqrt(static_cast<double>(rows / groups)) + 1.0;

  Buffer<T> x(n), residual(n), dy(n), weight(cols), bias(cols);
  std::vector<double> xr, rr, dyr, wr, br;
  fill(x, xr, rng, 0.3);
  fill(residual, rr, rng, 0.0);
  fill(dy, dyr, rng, 0.0);
  fill(weight, wr, rng, 1.0);
  fill(bias, br, rng, 0.0);

  for (int centered = 0; centered < 2; ++centered) {
    // forward: rms_norm / layer_norm
    Buffer<T> y(n), dx(n), dweight(groups * cols), dbias(groups * cols);
    Buffer<float> mean(rows), rstd(rows), workspace(groups * parts * 2 * cols);
    std::vector<double> y_ref(n), mean_ref(rows), rstd_ref(rows), dx_ref(n),
        dw_ref(groups * cols, 0.0), db_ref(groups * cols, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const double* row = &xr[r * cols];
      double m = 0.0, v = 0.0;
      if (centered) {
        for (int64_t c = 0; c < cols; ++c) m += row[c];
        m /= cols;
      }
      for (int64_t c = 0; c < cols; ++c) v += (row[c] - m) * (row[c] - m);
      const double s = 1.0 / std::sqrt(v / cols + eps);
      mean_ref[r] = m;
      rstd_ref[r] = s;
      double sum_g = 0.0, sum_gx = 0.0;
      for (int64_t c = 0; c < cols; ++c) {
        const double xhat = (row[c] - m) * s;
        y_ref[r * cols + c] = xhat * wr[c] + (centered ? br[c] : 0.0);
        const double g = dyr[r * cols + c] * wr[c];
        sum_g += g;
        sum_gx += g * xhat;
        const int64_t group = r / (rows / groups);
        dw_ref[group * cols + c] += dyr[r * cols + c] * xhat;
        db_ref[group * cols + c] += dyr[r * cols + c];
      }
      for (int64_t c = 0; c < cols; ++c) {
        const double xhat = (row[c] - m) * s;
        const double g = dyr[r * cols + c] * wr[c];
        dx_ref[r * cols + c] =
            (g - (centered ? sum_g / cols : 0.0) - xhat * sum_gx / cols) * s;
      }
    }
    const std::string op = centered ? "layer_norm" : "rms_norm";
    if (centered) {
      check(jaxops::cuda::layer_norm_fwd<T>(nullptr, x.data, weight.data, bias.data, y.data,
                                            mean.data, rstd.data, shape, eps),
            op + "_fwd " + name);
      compare(op + "_fwd mean " + name, mean.data, mean_ref, 1e-5);
    } else {
      check(jaxops::cuda::rms_norm_fwd<T>(nullptr, x.data, weight.data, y.data, rstd.data, shape,
                                          eps),
            op + "_fwd " + name);
    }
    compare(op + "_fwd y " + name, y.data, y_ref, tol);
    compare(op + "_fwd rstd " + name, rstd.data, rstd_ref, 1e-5);
    check_jvp<T>(x, xr, weight, wr, centered ? mean.data : nullptr, rstd.data, shape, name, rng);
    if (centered) {
      check(jaxops::cuda::layer_norm_bwd<T>(nullptr, dy.data, x.data, weight.data, mean.data,
                                            rstd.data, dx.data, dweight.data, dbias.data,
                                            workspace.data, shape, layout),
            op + "_bwd " + name);
      compare(op + "_bwd dbias " + name, dbias.data, db_ref, tol, rows_scale);
    } else {
      check(jaxops::cuda::rms_norm_bwd<T>(nullptr, dy.data, x.data, weight.data, rstd.data,
                                          nullptr, dx.data, dweight.data, workspace.data, shape,
                                          layout),
            op + "_bwd " + name);
    }
    compare(op + "_bwd dx " + name, dx.data, dx_ref, tol, 4.0);
    compare(op + "_bwd dweight " + name, dweight.data, dw_ref, tol, rows_scale);
  }

  // add_rms_norm: h = x + residual rounded to T, then rms_norm of h.
  Buffer<T> y(n), h(n);
  Buffer<float> rstd(rows);
  std::vector<double> y_ref(n), h_ref(n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = r * cols + c;
      h_ref[i] = static_cast<float>(T(static_cast<float>(xr[i] + rr[i])));
      ss += h_ref[i] * h_ref[i];
    }
    const double s = 1.0 / std::sqrt(ss / cols + eps);
    for (int64_t c = 0; c < cols; ++c) y_ref[r * cols + c] = h_ref[r * cols + c] * s * wr[c];
  }
  check(jaxops::cuda::add_rms_norm_fwd<T>(nullptr, x.data, residual.data, weight.data, y.data,
                                          h.data, rstd.data, shape, eps),
        "add_rms_norm_fwd " + name);
  compare("add_rms_norm_fwd h " + name, h.data, h_ref, tol);
  compare("add_rms_norm_fwd y " + name, y.data, y_ref, tol);
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  for (int i = 1; i < argc; ++i) {
    long long rows = 0, cols = 0, groups = 1, parts = 0;
    if (std::sscanf(argv[i], "%lldx%lld/%lld/%lld", &rows, &cols, &groups, &parts) < 2 ||
        groups < 1 || rows % groups != 0 || parts < 0) {
      std::fprintf(stderr, "bad shape %s (ROWSxCOLS[/GROUPS[/PARTS]])\n", argv[i]);
      return 2;
    }
    if (parts == 0) parts = std::max<int64_t>(1, std::min<int64_t>(rows / groups, 256 / groups));
    run<float>(rows, cols, groups, parts, rng);
    run<__nv_bfloat16>(rows, cols, groups, parts, rng);
    run<__half>(rows, cols, groups, parts, rng);
  }
  std::printf("%s: %d failure(s)\n", argv[0], g_failures);
  return g_failures == 0 ? 0 : 1;
}
