// Test-only helpers shared by the sanitizer drivers (norms_driver.cc,
// softmax_cross_entropy_driver.cc, attention_driver.cc, catalogue_driver.cc):
// the failure count, launch-status checks, dtype names, exact-size buffers and
// the comparison with a double reference, and the drivers' main loop.
// Each driver includes this once, into its own translation unit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace {

int g_failures = 0;

void check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "FAIL %s: %s: %s\n", what.c_str(), cudaGetErrorName(status),
                 cudaGetErrorString(status));
    ++g_failures;
  }
}

template <typename T>
const char* type_name() {
  if (std::is_same<T, float>::value) return "float32";
  if (std::is_same<T, __half>::value) return "float16";
  return "bfloat16";
}

// The attention drivers' tolerance for results stored in T, relative to
// 1 + |expected| (float32 products and softmax, rounded once to T).
template <typename T>
double attention_tolerance() {
  if (std::is_same<T, float>::value) return 1e-4;
  if (std::is_same<T, __half>::value) return 1e-2;
  return 6e-2;
}

// One buffer per allocation, exactly sized (AddressSanitizer redzones around it).
template <typename T>
struct Buffer {
  explicit Buffer(size_t n) : data(new T[n == 0 ? 1 : n]), size(n) {}
  ~Buffer() { delete[] data; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data;
  size_t size;
};

// Kernel results against a double reference: an infinite expectation must be
// met exactly, anything else within tol * (1 + |expected|). Reports and counts
// the first mismatch.
template <typename V>
void compare_with_reference(const std::string& what, const V* actual,
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

// One query row's attention from its logits (-inf where a key is not
// attended), in double: out[h] = sum_j softmax(logit)_j * value(j, h) over the
// attended keys (the others are never read), and the natural-log logsumexp,
// returned; a row that attends no key keeps its zeros and gives -inf. Turns
// `logit` into the probabilities.
template <typename Value>
double attend_row(std::vector<double>& logit, int64_t head_dim, Value value, double* out) {
  double mx = -INFINITY;
  for (double x : logit) mx = std::max(mx, x);
  if (mx == -INFINITY) return -INFINITY;
  double sum = 0.0;
  for (double& x : logit) sum += (x = x == -INFINITY ? 0.0 : std::exp(x - mx));
  for (int64_t h = 0; h < head_dim; ++h) {
    double o = 0.0;
    for (size_t j = 0; j < logit.size(); ++j) {
      if (logit[j] != 0.0) o += logit[j] * value(static_cast<int64_t>(j), h);
    }
    out[h] = o / sum;
  }
  return mx + std::log(sum);
}

// A driver's main: parses each command-line argument into a Shape and runs
// it (with its index) from one seeded generator. Exit status 2 for an
// argument `parse` rejects, 3 when a result disagreed, else 0.
template <typename Shape, typename Parse, typename Run>
int run_shapes(int argc, char** argv, Parse parse, Run run) {
  std::mt19937 rng(1234);
  for (int i = 1; i < argc; ++i) {
    Shape s;
    if (!parse(argv[i], &s)) {
      std::fprintf(stderr, "bad shape %s\n", argv[i]);
      return 2;
    }
    run(s, rng, i - 1);
  }
  if (g_failures != 0) return 3;
  std::printf("all agree\n");
  return 0;
}

}  // namespace
