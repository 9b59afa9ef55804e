#include "cpu/softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"
#include "cpu/vector_math.h"

namespace jaxops::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float row_max(const float* v, int64_t n) {
  float out = kNegInf;
  // Spelled as the select vmaxps implements: GCC turns std::max into a slower
  // compare-and-blend chain (measured 3x slower).
#pragma omp simd reduction(max : out)
  for (int64_t i = 0; i < n; ++i) out = out > v[i] ? out : v[i];
  return out;
}

int64_t visible_prefix(int64_t row, SoftmaxShape shape, CausalLimit causal) {
  if (causal.queries == 0) return shape.cols;
  const int64_t query = row % causal.queries;
  return std::clamp<int64_t>(query + causal.query_offset + 1, 0, shape.cols);
}

// z[c] = where[c] ? x[c] + bias[c] : -inf for c < n, with the mask and bias
// given by their per-row pointers and column strides (0: one value for the
// row). Specialised on presence so each loop is branch-free.
template <bool kWhere, bool kBias>
void masked_biased_row(const float* x, const uint8_t* where, int64_t where_stride,
                       const float* bias, int64_t bias_stride, float* z, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    float v = x[c];
    if constexpr (kBias) v += bias[c * bias_stride];
    if constexpr (kWhere) v = where[c * where_stride] ? v : kNegInf;
    z[c] = v;
  }
}

}  // namespace

template <typename T>
void softmax_fwd(const T* x, const BroadcastOperand<uint8_t>& where,
                 const BroadcastOperand<T>& bias, T* y, SoftmaxShape shape, SoftmaxOutput output,
                 CausalLimit causal) {
  const int64_t cols = shape.cols;
  const bool log_output = output == SoftmaxOutput::kLogProbabilities;
  const float invisible = log_output ? kNegInf : 0.f;
  advise_huge_pages(y, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> x_rows(cols), y_rows(cols);
    std::vector<float> bias_row(bias.data != nullptr && bias.col_stride != 0 ? cols : 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const int64_t n = visible_prefix(r, shape, causal);
      const float* xr = x_rows.read(x + r * cols, n);
      float* out = y_rows.target(y + r * cols);
      const float* z = xr;
      if (where.data != nullptr || bias.data != nullptr) {
        const uint8_t* wr = where.data ? where.data + where.row_offset(r) : nullptr;
        const float* br = bias_row.data();
        if (bias.data != nullptr) {
          const T* b = bias.data + bias.row_offset(r);
          if (bias.col_stride != 0) {
            load_row(b, bias_row.data(), n);
          } else {
            bias_row[0] = to_float(*b);
          }
        }
        if (wr != nullptr && bias.data != nullptr) {
          masked_biased_row<true, true>(xr, wr, where.col_stride, br, bias.col_stride, out, n);
        } else if (wr != nullptr) {
          masked_biased_row<true, false>(xr, wr, where.col_stride, br, 0, out, n);
        } else {
          masked_biased_row<false, true>(xr, nullptr, 0, br, bias.col_stride, out, n);
        }
        z = out;
      }
      const float m = n > 0 ? row_max(z, n) : kNegInf;
      if (m == kNegInf) {
        // max() skips NaN; a NaN beside only invisible columns still poisons the row.
        const bool has_nan = std::any_of(z, z + n, [](float v) { return v != v; });
        std::fill(out, out + cols, has_nan ? std::numeric_limits<float>::quiet_NaN() : invisible);
      } else if (log_output) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) sum += vexp_nonpositive(z[c] - m);
        const float lse = m + std::log(sum);
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) out[c] = z[c] - lse;
      } else {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) {
          out[c] = vexp_nonpositive(z[c] - m);
          sum += out[c];
        }
        const float inv_sum = 1.f / sum;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) out[c] *= inv_sum;
      }
      if (m != kNegInf) std::fill(out + n, out + cols, invisible);
      y_rows.commit(y + r * cols, cols);
    }
  }
}


template <typename T>
void softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape) {
  const int64_t cols = shape.cols;
  advise_huge_pages(dx, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> dy_rows(cols), y_rows(cols), dx_rows(cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* g = dy_rows.read(dy + r * cols, cols);
      const float* p = y_rows.read(y + r * cols, cols);
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < cols; ++c) dot += p[c] * g[c];
      float* out = dx_rows.target(dx + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] = p[c] * (g[c] - dot);
      dx_rows.commit(dx + r * cols, cols);
    }
  }
}

template <typename T>
void log_softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape) {
  const int64_t cols = shape.cols;
  advise_huge_pages(dx, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> dy_rows(cols), y_rows(cols), dx_rows(cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* g = dy_rows.read(dy + r * cols, cols);
      const float* logp = y_rows.read(y + r * cols, cols);
      float visible_sum = 0.f;
#pragma omp simd reduction(+ : visible_sum)
      for (int64_t c = 0; c < cols; ++c) visible_sum += logp[c] > kNegInf ? g[c] : 0.f;
      float* out = dx_rows.target(dx + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        out[c] = logp[c] > kNegInf ? g[c] - vexp_nonpositive(logp[c]) * visible_sum : 0.f;
      }
      dx_rows.commit(dx + r * cols, cols);
    }
  }
}

#define JAXOPS_INSTANTIATE_SOFTMAX(T)                                                         \
  template void softmax_fwd<T>(const T*, const BroadcastOperand<uint8_t>&,                    \
                               const BroadcastOperand<T>&, T*, SoftmaxShape, SoftmaxOutput,   \
                               CausalLimit);                                                  \
  template void softmax_bwd<T>(const T*, const T*, T*, SoftmaxShape);                         \
  template void log_softmax_bwd<T>(const T*, const T*, T*, SoftmaxShape);

JAXOPS_INSTANTIATE_SOFTMAX(float)
JAXOPS_INSTANTIATE_SOFTMAX(bfloat16)
JAXOPS_INSTANTIATE_SOFTMAX(float16)

}  // namespace jaxops::cpu
