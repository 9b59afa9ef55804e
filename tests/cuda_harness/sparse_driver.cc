// Test-only: runs the 2:4 sparse linear CUDA kernels (cuda/sparse.cu, compiled
// by the harness) through their host-side launchers in cuda/sparse.h (the
// entry points of the CUDA FFI handlers) in float32, bfloat16 and float16, and
// checks every result against a double-precision reference built from the
// packed layout's definition (params/sparse.h). Built under AddressSanitizer
// and ThreadSanitizer by tests/test_cuda_harness_sparse_sanitizers.py (the
// bfloat16/float16 forward runs on the emulated sparse tensor cores): every
// buffer is its own exact-size allocation, the metadata included (its last
// byte half used when in / 4 is odd), so a read past any end is caught.
//
// usage: sparse_driver RxIxO ...   rows x in (a multiple of 4) x out; exit status 0
//                                  when all agree
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/sparse.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;
namespace params = jaxops::params;

// Relative to the sum of |terms| of each dot product: the rounding of the
// inputs to T dominates (they are compared against the values actually stored).
template <typename T>
constexpr double kRelativeTolerance =
    std::is_same<T, float>::value ? 1e-5 : (std::is_same<T, __half>::value ? 2e-3 : 1.6e-2);

// A random T buffer and the doubles it holds.
template <typename T>
std::vector<double> randomize(Buffer<T>& b, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<double> held(b.size);
  for (size_t i = 0; i < b.size; ++i) {
    b.data[i] = T(normal(rng));
    held[i] = static_cast<float>(b.data[i]);
  }
  return held;
}

// expected[i] +- tol * scale[i].
template <typename T>
void expect(const std::string& what, const T* actual, const std::vector<double>& expected,
            const std::vector<double>& scale) {
  const double tol = kRelativeTolerance<T>;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double got = static_cast<float>(actual[i]);
    // A NaN where the reference has one; an infinity where it has one, or a
    // NaN: a position named twice adds its two values' products one by one,
    // and inf - inf is NaN where the reference's (v1 + v2) * inf is not.
    const bool agree = std::isnan(expected[i])   ? std::isnan(got)
                       : std::isinf(expected[i]) ? got == expected[i] || std::isnan(got)
                                                 : std::fabs(got - expected[i]) <= tol * (1.0 + scale[i]);
    if (!agree) {
      std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i, got,
                   expected[i]);
      ++g_failures;
      return;
    }
  }
}

template <typename T>
void run_sparse(const params::SparseLinearShape& s, std::mt19937& rng) {
  const int64_t half = params::sparse_values_cols(s.in), mcols = params::sparse_metadata_cols(s.in);
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(s.rows) + "x" +
                           std::to_string(s.in) + "x" + std::to_string(s.out);
  Buffer<T> x(s.rows * s.in), values(s.out * half), bias(s.out), dy(s.rows * s.out);
  Buffer<uint8_t> metadata(s.out * mcols);
  Buffer<T> y(s.rows * s.out), y_no_bias(s.rows * s.out), dx(s.rows * s.in), dvalues(s.out * half);
  const std::vector<double> xh = randomize(x, rng), vh = randomize(values, rng),
                            bh = randomize(bias, rng), dyh = randomize(dy, rng);
  // Mostly two distinct positions per group, in index order, as compress makes
  // them; one group in 4 any two positions (descending, or one position twice:
  // the values add), which the bfloat16/float16 tensor-core path must reorder
  // and merge for the hardware.
  std::uniform_int_distribution<int> pick(0, 5), position(0, 3), arbitrary(0, 3);
  const int pairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
  for (int64_t o = 0; o < s.out; ++o) {
    for (int64_t j = 0; j < mcols; ++j) metadata.data[o * mcols + j] = 0;
    for (int64_t g = 0; g < s.in / 4; ++g) {
      int any_pair[2] = {position(rng), position(rng)};
      const int* pair = arbitrary(rng) == 0 ? any_pair : pairs[pick(rng)];
      for (int slot = 0; slot < 2; ++slot) {
        const int64_t k = 2 * g + slot;
        metadata.data[o * mcols + k / 4] |= static_cast<uint8_t>(pair[slot] << (2 * (k % 4)));
      }
    }
  }
  auto column = [&](int64_t o, int64_t k) {
    return params::sparse_column(metadata.data + o * mcols, k);
  };

  check(cuda::sparse_linear_fwd<T>(nullptr, x.data, values.data, metadata.data, bias.data, y.data,
                                   s),
        "fwd " + name);
  check(cuda::sparse_linear_fwd<T>(nullptr, x.data, values.data, metadata.data, nullptr,
                                   y_no_bias.data, s),
        "fwd without bias " + name);
  check(cuda::sparse_linear_dx<T>(nullptr, dy.data, values.data, metadata.data, dx.data, s),
        "dx " + name);
  check(cuda::sparse_linear_dvalues<T>(nullptr, dy.data, x.data, metadata.data, dvalues.data, s),
        "dvalues " + name);

  std::vector<double> y_ref(s.rows * s.out), y_scale(s.rows * s.out), dx_ref(s.rows * s.in, 0.0),
      dx_scale(s.rows * s.in, 0.0), dv_ref(s.out * half, 0.0), dv_scale(s.out * half, 0.0);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t o = 0; o < s.out; ++o) {
      double sum = 0.0, scale = 0.0;
      for (int64_t k = 0; k < half; ++k) {
        const double term = vh[o * half + k] * xh[r * s.in + column(o, k)];
        sum += term;
        scale += std::fabs(term);
        const double dx_term = dyh[r * s.out + o] * vh[o * half + k];
        dx_ref[r * s.in + column(o, k)] += dx_term;
        dx_scale[r * s.in + column(o, k)] += std::fabs(dx_term);
        const double dv_term = dyh[r * s.out + o] * xh[r * s.in + column(o, k)];
        dv_ref[o * half + k] += dv_term;
        dv_scale[o * half + k] += std::fabs(dv_term);
      }
      y_ref[r * s.out + o] = sum;
      y_scale[r * s.out + o] = scale;
    }
  }
  expect("fwd without bias " + name, y_no_bias.data, y_ref, y_scale);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t o = 0; o < s.out; ++o) y_ref[r * s.out + o] += bh[o];
  }
  expect("fwd " + name, y.data, y_ref, y_scale);
  expect("dx " + name, dx.data, dx_ref, dx_scale);
  expect("dvalues " + name, dvalues.data, dv_ref, dv_scale);

  // x with a NaN, +inf or -inf in every third row (none in the others), and
  // dy likewise: the dense product's 0 * NaN = 0 * inf = NaN at the columns
  // an output prunes (the forward's NaN pass, the pruned terms of dx).
  if (s.rows == 0) return;
  const double specials[3] = {NAN, INFINITY, -INFINITY};
  for (int64_t r = 0; r < s.rows; r += 3) {
    const double special = specials[(r / 3) % 3];
    x.data[r * s.in + (r * 7) % s.in] = T(static_cast<float>(special));
    dy.data[r * s.out + (r * 5) % s.out] = T(static_cast<float>(special));
  }
  check(cuda::sparse_linear_fwd<T>(nullptr, x.data, values.data, metadata.data, nullptr,
                                   y_no_bias.data, s),
        "fwd non-finite " + name);
  check(cuda::sparse_linear_dx<T>(nullptr, dy.data, values.data, metadata.data, dx.data, s),
        "dx non-finite " + name);
  // The dense products of the decompressed weight.
  std::vector<double> w(s.out * s.in, 0.0);
  for (int64_t o = 0; o < s.out; ++o) {
    for (int64_t k = 0; k < half; ++k) w[o * s.in + column(o, k)] += vh[o * half + k];
  }
  std::fill(dx_ref.begin(), dx_ref.end(), 0.0);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t o = 0; o < s.out; ++o) {
      double sum = 0.0;
      for (int64_t c = 0; c < s.in; ++c) {
        sum += w[o * s.in + c] * static_cast<float>(x.data[r * s.in + c]);
        dx_ref[r * s.in + c] += static_cast<float>(dy.data[r * s.out + o]) * w[o * s.in + c];
      }
      y_ref[r * s.out + o] = sum;
    }
  }
  expect("fwd non-finite " + name, y_no_bias.data, y_ref, y_scale);
  expect("dx non-finite " + name, dx.data, dx_ref, dx_scale);
}

bool run_case(const char* text, std::mt19937& rng) {
  long long rows = 0, in = 0, out = 0;
  if (std::sscanf(text, "%lldx%lldx%lld", &rows, &in, &out) != 3 || rows < 0 || in < 4 ||
      in % 4 != 0 || out < 1) {
    return false;
  }
  const params::SparseLinearShape s{rows, in, out};
  run_sparse<float>(s, rng);
  run_sparse<__nv_bfloat16>(s, rng);
  run_sparse<__half>(s, rng);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  for (int i = 1; i < argc; ++i) {
    if (!run_case(argv[i], rng)) {
      std::fprintf(stderr, "bad case %s (RxIxO, I a multiple of 4)\n", argv[i]);
      return 2;
    }
  }
  std::printf("%s: %d failure(s)\n", argv[0], g_failures);
  return g_failures == 0 ? 0 : 1;
}
