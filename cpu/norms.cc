#include "cpu/norms.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"
#include "cpu/simd.h"

namespace jaxops::cpu {
namespace {

using simd::kLanes;
using simd::VecF;
using simd::vload;
using simd::vsum;

// weight/bias converted once, or a constant when absent, so the row loops have
// no branch on presence.
template <typename T>
std::vector<float> column_vector_or(const T* values, int64_t cols, float absent) {
  std::vector<float> out(cols, absent);
  if (values != nullptr) load_row(values, out.data(), cols);
  return out;
}

// Row sums of K terms of each column c < n, with kChains independent
// accumulators per term. term(at) returns the K terms, where at(row) reads
// row's element(s) at the columns in hand: a VecF of kLanes columns, or one
// float in the tail (so one generic lambda serves both). GCC's `omp simd
// reduction` keeps one vector accumulator, so each add waits on the last (4
// cycles: one vector in 4, an eighth of what two FMA pipes retire), and that
// made the reductions the slowest pass over a row held in cache: at 4096
// columns, 2048 cycles a row with 8 lanes.
template <int K, typename Term>
std::array<float, K> row_sums(int64_t n, Term&& term) {
  constexpr int kChains = 4;
  VecF acc[kChains][K];
  for (auto& chain : acc) {
    for (auto& a : chain) a = VecF{};
  }
  int64_t i = 0;
  for (; i + kChains * kLanes <= n; i += kChains * kLanes) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      const int64_t at_c = i + c * kLanes;
      const auto t = term([at_c](const float* row) { return vload(row + at_c); });
      for (int k = 0; k < K; ++k) acc[c][k] += t[k];
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const auto t = term([i](const float* row) { return vload(row + i); });
    for (int k = 0; k < K; ++k) acc[0][k] += t[k];
  }
  std::array<float, K> sums;
  for (int k = 0; k < K; ++k) sums[k] = vsum((acc[0][k] + acc[1][k]) + (acc[2][k] + acc[3][k]));
  for (; i < n; ++i) {
    const auto t = term([i](const float* row) { return row[i]; });
    for (int k = 0; k < K; ++k) sums[k] += t[k];
  }
  return sums;
}

float row_sum(const float* v, int64_t n) {
  return row_sums<1>(n, [v](auto at) { return std::array{at(v)}; })[0];
}

float row_centered_square_sum(const float* v, float center, int64_t n) {
  return row_sums<1>(n, [v, center](auto at) {
    const auto d = at(v) - center;
    return std::array{d * d};
  })[0];
}

// Sums of d and d^2 over d = v - center: the second pass of the corrected
// two-pass mean and variance (Chan, Golub, LeVeque). A first-pass mean is off
// by an ulp or so depending on the summation order, i.e. on the vector width
// of the build (a row 3.0035 +- 0.0035 gave a mean one ulp higher with 4 lanes
// than with 16: 6e-5 in the normalised output); mean + sum(d) / n is as exact
// as the deviations, whatever the width.
struct CenteredSums {
  float linear;
  float square;
};

CenteredSums row_centered_sums(const float* v, float center, int64_t n) {
  const auto sums = row_sums<2>(n, [v, center](auto at) {
    const auto d = at(v) - center;
    return std::array{d, d * d};
  });
  return {sums[0], sums[1]};
}

struct PartRange {
  int64_t group;
  int64_t row_begin;
  int64_t row_end;
};

PartRange part_rows(int64_t task, NormShape shape, WeightGradLayout layout) {
  const int64_t rows_per_group = shape.rows / layout.groups;
  const int64_t group = task / layout.parts;
  const int64_t part = task % layout.parts;
  const int64_t first = group * rows_per_group;
  return {group, first + part * rows_per_group / layout.parts,
          first + (part + 1) * rows_per_group / layout.parts};
}

// Sums the parts of each group in part order (deterministic) into outputs[s]
// of shape [groups, cols]; outputs[s] may be nullptr.
template <typename T>
void reduce_parts(const float* workspace, int sums, T* const* outputs, NormShape shape,
                  WeightGradLayout layout) {
  const int64_t cols = shape.cols;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t group = 0; group < layout.groups; ++group) {
    for (int s = 0; s < sums; ++s) {
      T* out = outputs[s];
      if (out == nullptr) continue;
      std::vector<float> total(cols, 0.f);
      for (int64_t part = 0; part < layout.parts; ++part) {
        const float* partial = workspace + ((group * layout.parts + part) * sums + s) * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) total[c] += partial[c];
      }
      store_row(total.data(), out + group * cols, cols);
    }
  }
}

}  // namespace

size_t norm_bwd_workspace_floats(NormShape shape, WeightGradLayout layout, int sums) {
  return static_cast<size_t>(layout.groups * layout.parts) * sums * shape.cols;
}

template <typename T>
void layer_norm_fwd(const T* x, const T* weight, const T* bias, T* y, float* mean, float* rstd,
                    NormShape shape, float epsilon) {
  const int64_t cols = shape.cols;
  const std::vector<float> w = column_vector_or(weight, cols, 1.f);
  const std::vector<float> b = column_vector_or(bias, cols, 0.f);
  const float inv_cols = 1.f / static_cast<float>(cols);
  advise_huge_pages(y, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> reader(cols);
    RowBuffer<T> writer(cols, y, shape.rows * cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* xr = reader.read(x + r * cols, cols);
      // Two passes over a row that sits in cache: the centred variance does not
      // lose precision the way E[x^2] - E[x]^2 does for rows with a large mean.
      const float first_mu = row_sum(xr, cols) * inv_cols;
      const CenteredSums sums = row_centered_sums(xr, first_mu, cols);
      const float correction = sums.linear * inv_cols;
      const float mu = first_mu + correction;
      // A row whose squares overflow (one 1e30) has an infinite variance, as in
      // the reference, and rstd 0; the correction's square may overflow too,
      // and inf - inf must not make it NaN.
      const float var = std::isinf(sums.square)
                            ? sums.square
                            : std::max(sums.square * inv_cols - correction * correction, 0.f);
      const float rs = 1.f / std::sqrt(var + epsilon);
      float* yr = writer.target(y + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) yr[c] = (xr[c] - mu) * rs * w[c] + b[c];
      writer.commit(y + r * cols, cols);
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

template <typename T>
void layer_norm_bwd(const T* dy, const T* x, const T* weight, const float* mean, const float* rstd,
                    T* dx, T* dweight, T* dbias, float* workspace, NormShape shape,
                    WeightGradLayout layout) {
  const int64_t cols = shape.cols;
  const std::vector<float> w = column_vector_or(weight, cols, 1.f);
  const float inv_cols = 1.f / static_cast<float>(cols);
  const bool want_sums = dweight != nullptr || dbias != nullptr;
  const int64_t tasks = layout.groups * layout.parts;
  advise_huge_pages(dx, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> x_reader(cols), dy_reader(cols);
    RowBuffer<T> writer(cols, dx, shape.rows * cols);
    std::vector<float> xhat(cols), g(cols);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const PartRange range = part_rows(task, shape, layout);
      float* dw_sum = workspace + task * 2 * cols;
      float* db_sum = dw_sum + cols;
      if (want_sums) {
        std::fill(dw_sum, dw_sum + 2 * cols, 0.f);
      }
      for (int64_t r = range.row_begin; r < range.row_end; ++r) {
        const float* xr = x_reader.read(x + r * cols, cols);
        const float* dyr = dy_reader.read(dy + r * cols, cols);
        const float mu = mean[r], rs = rstd[r];
        // g and xhat are stored once, rounded, and every pass reads them:
        // recomputed, g could be contracted into the FMA g - mean(g), whose
        // exact cancellation (one column: dx = 0) would then leave g's
        // rounding error times rstd.
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) {
          xhat[c] = (xr[c] - mu) * rs;
          g[c] = dyr[c] * w[c];
        }
        const float *gc = g.data(), *xhatc = xhat.data();
        const auto [g_sum, g_xhat_sum] = row_sums<2>(cols, [gc, xhatc](auto at) {
          return std::array{at(gc), at(gc) * at(xhatc)};
        });
        const float g_mean = g_sum * inv_cols, g_xhat_mean = g_xhat_sum * inv_cols;
        float* dxr = writer.target(dx + r * cols);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) dxr[c] = (g[c] - g_mean - xhat[c] * g_xhat_mean) * rs;
        writer.commit(dx + r * cols, cols);
        if (want_sums) {
#pragma omp simd
          for (int64_t c = 0; c < cols; ++c) {
            dw_sum[c] += dyr[c] * xhat[c];
            db_sum[c] += dyr[c];
          }
        }
      }
    }
  }
  if (want_sums) {
    T* outputs[2] = {dweight, dbias};
    reduce_parts(workspace, 2, outputs, shape, layout);
  }
}

template <typename T>
void rms_norm_fwd(const T* x, const T* weight, T* y, float* rstd, NormShape shape, float epsilon) {
  const int64_t cols = shape.cols;
  const std::vector<float> w = column_vector_or(weight, cols, 1.f);
  const float inv_cols = 1.f / static_cast<float>(cols);
  advise_huge_pages(y, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> reader(cols);
    RowBuffer<T> writer(cols, y, shape.rows * cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* xr = reader.read(x + r * cols, cols);
      const float rs = 1.f / std::sqrt(row_centered_square_sum(xr, 0.f, cols) * inv_cols + epsilon);
      float* yr = writer.target(y + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rs * w[c];
      writer.commit(y + r * cols, cols);
      rstd[r] = rs;
    }
  }
}

template <typename T>
void rms_norm_bwd(const T* dy, const T* x, const T* weight, const float* rstd, const T* dresidual,
                  T* dx, T* dweight, float* workspace, NormShape shape, WeightGradLayout layout) {
  const int64_t cols = shape.cols;
  const std::vector<float> w = column_vector_or(weight, cols, 1.f);
  const float inv_cols = 1.f / static_cast<float>(cols);
  const int64_t tasks = layout.groups * layout.parts;
  advise_huge_pages(dx, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> x_reader(cols), dy_reader(cols), dres_reader(cols);
    RowBuffer<T> writer(cols, dx, shape.rows * cols);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const PartRange range = part_rows(task, shape, layout);
      float* dw_sum = workspace + task * cols;
      if (dweight != nullptr) std::fill(dw_sum, dw_sum + cols, 0.f);
      for (int64_t r = range.row_begin; r < range.row_end; ++r) {
        const float* xr = x_reader.read(x + r * cols, cols);
        const float* dyr = dy_reader.read(dy + r * cols, cols);
        const float rs = rstd[r];
        // g = dy * w, recomputed in the second pass rather than stored.
        const float* wc = w.data();
        const float g_x_sum = row_sums<1>(cols, [xr, dyr, wc](auto at) {
          return std::array{at(dyr) * at(wc) * at(xr)};
        })[0];
        // dx = (g - xhat * mean(g * xhat)) * rstd with xhat = x * rstd.
        const float coef = g_x_sum * inv_cols * rs * rs;
        float* dxr = writer.target(dx + r * cols);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) dxr[c] = (dyr[c] * wc[c] - xr[c] * coef) * rs;
        if (dresidual != nullptr) {
          const float* dres = dres_reader.read(dresidual + r * cols, cols);
#pragma omp simd
          for (int64_t c = 0; c < cols; ++c) dxr[c] += dres[c];
        }
        writer.commit(dx + r * cols, cols);
        if (dweight != nullptr) {
#pragma omp simd
          for (int64_t c = 0; c < cols; ++c) dw_sum[c] += dyr[c] * xr[c] * rs;
        }
      }
    }
  }
  if (dweight != nullptr) {
    T* outputs[1] = {dweight};
    reduce_parts(workspace, 1, outputs, shape, layout);
  }
}

template <typename T>
void add_rms_norm_fwd(const T* x, const T* residual, const T* weight, T* y, T* h, float* rstd,
                      NormShape shape, float epsilon) {
  const int64_t cols = shape.cols;
  const std::vector<float> w = column_vector_or(weight, cols, 1.f);
  const float inv_cols = 1.f / static_cast<float>(cols);
  advise_huge_pages(y, sizeof(T) * shape.rows * cols);
  if (h != residual) advise_huge_pages(h, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> x_reader(cols), res_reader(cols), h_reader(cols);
    // A donated residual (h == residual) is present already.
    RowBuffer<T> h_writer(cols, h, h != residual ? shape.rows * cols : 0);
    RowBuffer<T> y_writer(cols, y, shape.rows * cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* xr = x_reader.read(x + r * cols, cols);
      const float* resr = res_reader.read(residual + r * cols, cols);
      float* hr = h_writer.target(h + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) hr[c] = xr[c] + resr[c];
      h_writer.commit(h + r * cols, cols);
      // Normalise the h that is returned (rounded to T), not the unrounded sum,
      // so y == rms_norm(h) exactly as a two-op composition would compute it.
      const float* hs = h_reader.read(h + r * cols, cols);
      const float rs = 1.f / std::sqrt(row_centered_square_sum(hs, 0.f, cols) * inv_cols + epsilon);
      float* yr = y_writer.target(y + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) yr[c] = hs[c] * rs * w[c];
      y_writer.commit(y + r * cols, cols);
      rstd[r] = rs;
    }
  }
}

namespace {

// The JVP of layer_norm (kCentered) and of rms_norm (mean absent): the row sums
// of dx and xhat * dx in one pass over x and dx, then dy from the rows, which
// are still in cache. An absent dx reads as a row of zeros. Without parameter
// tangents (kParamTangents false) the write pass reads no dweight/dbias
// columns: with three column vectors beside two rows it runs from L2, ~20%
// slower.
template <typename T, bool kCentered, bool kParamTangents>
void norm_jvp_rows(const T* x, const T* weight, const float* mean, const float* rstd,
                   const T* dx, const T* dweight, const T* dbias, T* dy, NormShape shape) {
  const int64_t cols = shape.cols;
  const std::vector<float> w = column_vector_or(weight, cols, 1.f);
  const std::vector<float> dw = column_vector_or(dweight, kParamTangents ? cols : 0, 0.f);
  const std::vector<float> db = column_vector_or(dbias, kParamTangents ? cols : 0, 0.f);
  const std::vector<float> zero_row(dx == nullptr ? cols : 0, 0.f);
  const float inv_cols = 1.f / static_cast<float>(cols);
  advise_huge_pages(dy, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> x_reader(cols), dx_reader(cols);
    RowBuffer<T> writer(cols, dy, shape.rows * cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* xr = x_reader.read(x + r * cols, cols);
      const float* dxr = dx != nullptr ? dx_reader.read(dx + r * cols, cols) : zero_row.data();
      const float mu = kCentered ? mean[r] : 0.f, rs = rstd[r];
      const auto [dx_sum, xhat_dx_sum] = row_sums<2>(cols, [xr, dxr, mu, rs](auto at) {
        const auto d = at(dxr);
        return std::array{d, (at(xr) - mu) * rs * d};
      });
      const float dx_mean = kCentered ? dx_sum * inv_cols : 0.f;
      const float xhat_dx_mean = xhat_dx_sum * inv_cols;
      float* dyr = writer.target(dy + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = (xr[c] - mu) * rs;
        float out = (dxr[c] - dx_mean - xhat * xhat_dx_mean) * rs * w[c];
        if constexpr (kParamTangents) out += xhat * dw[c] + db[c];
        dyr[c] = out;
      }
      writer.commit(dy + r * cols, cols);
    }
  }
}

template <typename T, bool kCentered>
void norm_jvp(const T* x, const T* weight, const float* mean, const float* rstd, const T* dx,
              const T* dweight, const T* dbias, T* dy, NormShape shape) {
  if (dweight != nullptr || dbias != nullptr) {
    norm_jvp_rows<T, kCentered, true>(x, weight, mean, rstd, dx, dweight, dbias, dy, shape);
  } else {
    norm_jvp_rows<T, kCentered, false>(x, weight, mean, rstd, dx, nullptr, nullptr, dy, shape);
  }
}

}  // namespace

template <typename T>
void layer_norm_jvp(const T* x, const T* weight, const float* mean, const float* rstd, const T* dx,
                    const T* dweight, const T* dbias, T* dy, NormShape shape) {
  norm_jvp<T, true>(x, weight, mean, rstd, dx, dweight, dbias, dy, shape);
}

template <typename T>
void rms_norm_jvp(const T* x, const T* weight, const float* rstd, const T* dx, const T* dweight,
                  T* dy, NormShape shape) {
  norm_jvp<T, false>(x, weight, nullptr, rstd, dx, dweight, nullptr, dy, shape);
}

#define JAXOPS_INSTANTIATE_NORMS(T)                                                            \
  template void layer_norm_fwd<T>(const T*, const T*, const T*, T*, float*, float*, NormShape, \
                                  float);                                                      \
  template void layer_norm_bwd<T>(const T*, const T*, const T*, const float*, const float*,    \
                                  T*, T*, T*, float*, NormShape, WeightGradLayout);            \
  template void rms_norm_fwd<T>(const T*, const T*, T*, float*, NormShape, float);             \
  template void rms_norm_bwd<T>(const T*, const T*, const T*, const float*, const T*, T*, T*,  \
                                float*, NormShape, WeightGradLayout);                          \
  template void add_rms_norm_fwd<T>(const T*, const T*, const T*, T*, T*, float*, NormShape,   \
                                    float);                                                    \
  template void layer_norm_jvp<T>(const T*, const T*, const float*, const float*, const T*,    \
                                  const T*, const T*, T*, NormShape);                          \
  template void rms_norm_jvp<T>(const T*, const T*, const float*, const T*, const T*, T*,      \
                                NormShape);

JAXOPS_INSTANTIATE_NORMS(float)
JAXOPS_INSTANTIATE_NORMS(bfloat16)
JAXOPS_INSTANTIATE_NORMS(float16)

}  // namespace jaxops::cpu
