#include "cpu/softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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

// The row of a present broadcast operand at `offset` (row_offset of a row of x)
// in float32: its first n values, or its one value when it broadcasts along the
// columns (col_stride 0).
template <typename T>
const float* load_broadcast_row(const BroadcastOperand<T>& operand, int64_t offset, float* out,
                                int64_t n) {
  const T* row = operand.data + offset;
  if (operand.col_stride != 0) {
    load_row(row, out, n);
  } else {
    out[0] = to_float(*row);
  }
  return out;
}

// A row with a NaN among its visible columns: NaN there, and -inf where the
// column is invisible (z = -inf), as the reference's log_softmax (z - lse would
// make -inf - NaN = NaN). out may be z.
void nan_row_log_probabilities(const float* z, float* out, int64_t n) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] = z[c] == kNegInf ? kNegInf : kNaN;
}

// A row converted into a float32 buffer the thread owns, float rows too: a
// RowBuffer that always copies.
template <typename T>
class StagedRow {
 public:
  explicit StagedRow(int64_t cols) : buffer_(cols) {}
  const float* read(const T* row, int64_t n) {
    load_row(row, buffer_.data(), n);
    return buffer_.data();
  }

 private:
  std::vector<float> buffer_;
};

// Rows of dense + broadcast in float32, either term absent (0): the input of
// the linear maps below, a cotangent (dense only) or a tangent dx + dbias.
// Reader reads the dense rows (RowBuffer or StagedRow).
template <typename T, typename Reader>
class SummedRows {
 public:
  SummedRows(const T* dense, const BroadcastOperand<T>& broadcast, int64_t cols)
      : dense_(dense),
        broadcast_(broadcast),
        cols_(cols),
        dense_rows_(dense != nullptr ? cols : 0),
        zeros_(dense != nullptr ? 0 : cols, 0.f),
        broadcast_row_(broadcast.data == nullptr ? 0 : (broadcast.col_stride != 0 ? cols : 1)),
        sum_(broadcast.data == nullptr ? 0 : cols) {}

  const float* read(int64_t r) {
    const float* dense =
        dense_ != nullptr ? dense_rows_.read(dense_ + r * cols_, cols_) : zeros_.data();
    if (broadcast_.data == nullptr) return dense;
    // Consecutive rows that share a broadcast row (all of them for a [1, C]
    // dbias) convert it once.
    const int64_t offset = broadcast_.row_offset(r);
    if (offset != loaded_offset_) {
      load_broadcast_row(broadcast_, offset, broadcast_row_.data(), cols_);
      loaded_offset_ = offset;
    }
    masked_biased_row<false, true>(dense, nullptr, 0, broadcast_row_.data(),
                                   broadcast_.col_stride, sum_.data(), cols_);
    return sum_.data();
  }

 private:
  const T* dense_;
  const BroadcastOperand<T>& broadcast_;
  int64_t cols_;
  Reader dense_rows_;
  std::vector<float> zeros_, broadcast_row_, sum_;
  int64_t loaded_offset_ = -1;  // of the row in broadcast_row_
};

// The linear maps of a row that the backward (g = the cotangent dy) and the
// JVP (g = the input's tangent) apply: out_c = out(y_c, g_c, s) with
// s = sum_c term(y_c, g_c). Softmax's Jacobian is symmetric, so its VJP and JVP
// are one map; log_softmax's are each other's transpose.
//
// kStageRows: copy float rows into the thread's buffers before the reduction.
// A reduction with an exp per column, run on rows that are still in memory,
// keeps too few loads in flight (log_softmax's JVP: 15-20% slower at 4096 x 4096
// float32); where the exp is in the writing pass, the copy would only cost.
// Columns with y = 0 are masked ones (by a mask, or causally hidden), whose
// tangent or cotangent may be non-finite, and whose row sum s is NaN in a
// NaN row: they take no part and get 0, as the references' masked columns
// do (0 * NaN would be NaN). The backward and the JVP are the same map.
struct SoftmaxLinearMap {
  static constexpr bool kStageRows = false;
  // (Bit selects, as in vector_math: a float select left the products under
  // a branch that kept these loops scalar off AVX-512.)
  static float term(float y, float g) { return vector_math::select(y != 0.f, y * g, 0.f); }
  static float out(float y, float g, float s) {
    return vector_math::select(y != 0.f, y * (g - s), 0.f);
  }
};

struct LogSoftmaxVjp {
  static constexpr bool kStageRows = false;
  // (A NaN y counts.)
  static float term(float y, float g) { return vector_math::select(y != kNegInf, g, 0.f); }
  static float out(float y, float g, float s) {
    return vector_math::select(y != kNegInf, g - vexp_nonpositive(y) * s, 0.f);
  }
};

struct LogSoftmaxJvp {
  static constexpr bool kStageRows = true;
  static float term(float y, float g) {
    return vector_math::select(y != kNegInf, vexp_nonpositive(y) * g, 0.f);
  }
  static float out(float y, float g, float s) {
    return vector_math::select(y != kNegInf, g - s, 0.f);
  }
};

// out = Map(y, g + g_broadcast) row by row: one pass for s over rows that stay
// in cache, one that writes.
// With a causal limit, the columns past a row's visible prefix are 0 and take
// no part: in a NaN row y is NaN there too, so the guard on y cannot hide them.
template <typename Map, typename T>
void softmax_linear_map(const T* y, const T* g, const BroadcastOperand<T>& g_broadcast, T* out,
                        SoftmaxShape shape, CausalLimit causal = {}) {
  const int64_t cols = shape.cols;
  advise_huge_pages(out, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    using Reader = std::conditional_t<Map::kStageRows, StagedRow<T>, RowBuffer<T>>;
    Reader y_rows(cols);
    RowBuffer<T> out_rows(cols);
    SummedRows<T, Reader> g_rows(g, g_broadcast, cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const float* yr = y_rows.read(y + r * cols, cols);
      const float* gr = g_rows.read(r);
      const int64_t n = visible_prefix(r, shape, causal);
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < n; ++c) s += Map::term(yr[c], gr[c]);
      float* o = out_rows.target(out + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = Map::out(yr[c], gr[c], s);
      std::fill(o + n, o + cols, 0.f);
      out_rows.commit(out + r * cols, cols);
    }
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
        if (bias.data != nullptr) load_broadcast_row(bias, bias.row_offset(r), bias_row.data(), n);
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
      float inv_sum = 1.f;
      if (m == kNegInf) {
        // max() skips NaN; a NaN beside only invisible columns still poisons the row.
        const bool has_nan = std::any_of(z, z + n, [](float v) { return v != v; });
        if (has_nan && log_output) {
          nan_row_log_probabilities(z, out, n);
        } else {
          std::fill(out, out + cols, has_nan ? std::numeric_limits<float>::quiet_NaN() : invisible);
        }
      } else if (log_output) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) sum += vexp_nonpositive(z[c] - m);
        const float lse = m + std::log(sum);
        if (lse != lse) {
          nan_row_log_probabilities(z, out, n);
        } else {
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) out[c] = z[c] - lse;
        }
      } else {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) {
          out[c] = vexp_nonpositive(z[c] - m);
          sum += out[c];
        }
        inv_sum = 1.f / sum;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) out[c] *= inv_sum;
      }
      // 0 * inv_sum: a NaN row is NaN in its causally invisible columns too.
      if (m != kNegInf) std::fill(out + n, out + cols, log_output ? invisible : 0.f * inv_sum);
      y_rows.commit(y + r * cols, cols);
    }
  }
}


template <typename T>
void softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape, CausalLimit causal) {
  softmax_linear_map<SoftmaxLinearMap>(y, dy, BroadcastOperand<T>{}, dx, shape, causal);
}

template <typename T>
void log_softmax_bwd(const T* dy, const T* y, T* dx, SoftmaxShape shape) {
  softmax_linear_map<LogSoftmaxVjp>(y, dy, BroadcastOperand<T>{}, dx, shape);
}

template <typename T>
void softmax_jvp(const T* y, const T* dx, const BroadcastOperand<T>& dbias, T* dy,
                 SoftmaxShape shape) {
  softmax_linear_map<SoftmaxLinearMap>(y, dx, dbias, dy, shape);
}

template <typename T>
void log_softmax_jvp(const T* y, const T* dx, const BroadcastOperand<T>& dbias, T* dy,
                     SoftmaxShape shape) {
  softmax_linear_map<LogSoftmaxJvp>(y, dx, dbias, dy, shape);
}

#define JAXOPS_INSTANTIATE_SOFTMAX(T)                                                         \
  template void softmax_fwd<T>(const T*, const BroadcastOperand<uint8_t>&,                    \
                               const BroadcastOperand<T>&, T*, SoftmaxShape, SoftmaxOutput,   \
                               CausalLimit);                                                  \
  template void softmax_bwd<T>(const T*, const T*, T*, SoftmaxShape, CausalLimit);            \
  template void log_softmax_bwd<T>(const T*, const T*, T*, SoftmaxShape);                     \
  template void softmax_jvp<T>(const T*, const T*, const BroadcastOperand<T>&, T*,            \
                               SoftmaxShape);                                                 \
  template void log_softmax_jvp<T>(const T*, const T*, const BroadcastOperand<T>&, T*,        \
                                   SoftmaxShape);

JAXOPS_INSTANTIATE_SOFTMAX(float)
JAXOPS_INSTANTIATE_SOFTMAX(bfloat16)
JAXOPS_INSTANTIATE_SOFTMAX(float16)

}  // namespace jaxops::cpu
