// Test-only: runs the CUDA patch-embedding kernels (cuda/patch_embed.cu,
// compiled by the harness) on the shapes given on the command line, in float32
// (full float32: allow_tf32 false; the TF32 products are checked through the op
// by tests/test_matmul_precision_kernels.py), bfloat16 and float16, against a
// double-precision reference: the forward with
// every optional operand and with none, and the backward with every gradient
// wanted. Built under AddressSanitizer and ThreadSanitizer by
// tests/test_cuda_harness_patch_embed_sanitizers.py; each buffer is its own
// exact-size allocation, so a read past an image, a kernel or a token row is caught.
//
// usage: patch_embed_driver BxHxWxCxPxD ...     exit status 0 when all agree
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/patch_embed.h"
#include "driver_common.h"

namespace {

using jaxops::params::PatchEmbedShape;

template <typename T>
double tolerance() {
  if (std::is_same<T, float>::value) return 1e-4;
  if (std::is_same<T, __half>::value) return 4e-3;
  return 3e-2;
}

template <typename T>
void fill(Buffer<T>& b, std::vector<double>& rounded, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  rounded.resize(b.size);
  for (size_t i = 0; i < b.size; ++i) {
    b.data[i] = T(normal(rng));
    rounded[i] = static_cast<float>(b.data[i]);
  }
}

// `scale`: the typical magnitude of a sum of that many unit products.
template <typename T>
void compare(const std::string& what, const T* actual, const std::vector<double>& expected,
             double scale) {
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<float>(actual[i]);
    if (!(std::fabs(a - expected[i]) <= tolerance<T>() * (scale + std::fabs(expected[i])))) {
      std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i, a,
                   expected[i]);
      ++g_failures;
      return;
    }
  }
}

template <typename T>
void run_case(PatchEmbedShape s, std::mt19937& rng) {
  const std::string name = std::string(type_name<T>()) + " " + std::to_string(s.batch) + "x" +
                           std::to_string(s.height) + "x" + std::to_string(s.width) + "x" +
                           std::to_string(s.channels) + "x" + std::to_string(s.patch) + "x" +
                           std::to_string(s.dim);
  const int64_t len = s.patch_len(), n = s.patches(), rows = s.batch * n, d = s.dim;
  Buffer<T> images(s.batch * s.height * s.width * s.channels), kernel(len * d), bias(d),
      pos((n + 1) * d), cls(d);
  std::vector<double> ir, kr, br, pr, cr;
  fill(images, ir, rng);
  fill(kernel, kr, rng);
  fill(bias, br, rng);
  fill(pos, pr, rng);
  fill(cls, cr, rng);
  const double scale = std::sqrt(static_cast<double>(len));
  // The patch products in double, [rows, d].
  std::vector<double> product(rows * d, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < len; ++k) {
      const int64_t run = s.patch * s.channels;
      const double x = ir[s.patch_row_offset(r / n, r % n, k / run) + k % run];
      for (int64_t c = 0; c < d; ++c) product[r * d + c] += x * kr[k * d + c];
    }
  }
  for (bool all : {true, false}) {
    PatchEmbedShape f = s;
    f.has_bias = f.has_pos = f.has_cls = all;
    const int64_t tokens = f.tokens(), first = all ? 1 : 0;
    Buffer<T> out(s.batch * tokens * d);
    std::vector<double> expected(s.batch * tokens * d);
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t c = 0; c < d; ++c) {
          double v = t < first ? cr[c] : product[(b * n + t - first) * d + c] + (all ? br[c] : 0.0);
          expected[(b * tokens + t) * d + c] = v + (all ? pr[t * d + c] : 0.0);
        }
      }
    }
    check(jaxops::cuda::patch_embed_fwd<T>(nullptr, images.data, kernel.data,
                                           all ? bias.data : nullptr, all ? pos.data : nullptr,
                                           all ? cls.data : nullptr, out.data, f,
                                           /*allow_tf32=*/false),
          "patch_embed_fwd " + name);
    compare("patch_embed_fwd " + name + (all ? " all operands" : " no operands"), out.data,
            expected, scale);
  }
  // Backward with a class token and every gradient.
  PatchEmbedShape g = s;
  g.has_bias = g.has_pos = g.has_cls = true;
  const int64_t tokens = g.tokens();
  Buffer<T> dtokens(s.batch * tokens * d), dimages(images.size), dkernel(kernel.size), dbias(d),
      dpos(tokens * d), dcls(d);
  std::vector<double> dr;
  fill(dtokens, dr, rng);
  std::vector<double> di(images.size, 0.0), dk(kernel.size, 0.0), db(d, 0.0), dp(tokens * d, 0.0),
      dc(d, 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < d; ++c) {
        const double v = dr[(b * tokens + t) * d + c];
        dp[t * d + c] += v;
        if (t == 0) dc[c] += v;
        if (t > 0) db[c] += v;
      }
    }
  }
  const int64_t run = s.patch * s.channels;
  for (int64_t r = 0; r < rows; ++r) {
    const double* dy = dr.data() + ((r / n) * tokens + 1 + r % n) * d;
    for (int64_t k = 0; k < len; ++k) {
      const int64_t at = s.patch_row_offset(r / n, r % n, k / run) + k % run;
      for (int64_t c = 0; c < d; ++c) {
        di[at] += dy[c] * kr[k * d + c];
        dk[k * d + c] += ir[at] * dy[c];
      }
    }
  }
  check(jaxops::cuda::patch_embed_bwd<T>(nullptr, dtokens.data, images.data, kernel.data,
                                         dimages.data, dkernel.data, dbias.data, dpos.data,
                                         dcls.data, g, /*allow_tf32=*/false),
        "patch_embed_bwd " + name);
  const double sums = std::sqrt(static_cast<double>(rows + 1));
  compare("patch_embed_bwd dimages " + name, dimages.data, di, std::sqrt(static_cast<double>(d)));
  compare("patch_embed_bwd dkernel " + name, dkernel.data, dk, sums);
  compare("patch_embed_bwd dbias " + name, dbias.data, db, sums);
  compare("patch_embed_bwd dpos " + name, dpos.data, dp, sums);
  compare("patch_embed_bwd dcls " + name, dcls.data, dc, sums);
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(7);
  for (int i = 1; i < argc; ++i) {
    PatchEmbedShape s{};
    long long v[6];
    if (std::sscanf(argv[i], "%lldx%lldx%lldx%lldx%lldx%lld", &v[0], &v[1], &v[2], &v[3], &v[4],
                    &v[5]) != 6) {
      std::fprintf(stderr, "bad shape %s (expected BxHxWxCxPxD)\n", argv[i]);
      return 2;
    }
    s = PatchEmbedShape{v[0], v[1], v[2], v[3], v[4], v[5], false, false, false};
    run_case<float>(s, rng);
    run_case<__nv_bfloat16>(s, rng);
    run_case<__half>(s, rng);
  }
  return g_failures == 0 ? 0 : 3;
}
