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

// Row r's z = x + bias with -inf where the mask hides a column, over its first
// n columns, written to `out` (x's row `xr` itself when there is neither a mask
// nor a bias). bias_row holds a converted bias row (cols floats, or 1 when it
// broadcasts along the columns).
template <typename T>
const float* visible_logits(const float* xr, const BroadcastOperand<uint8_t>& where,
                            const BroadcastOperand<T>& bias, int64_t r, float* bias_row,
                            float* out, int64_t n) {
  if (where.data == nullptr && bias.data == nullptr) return xr;
  const uint8_t* wr = where.data ? where.data + where.row_offset(r) : nullptr;
  if (bias.data != nullptr) load_broadcast_row(bias, bias.row_offset(r), bias_row, n);
  if (wr != nullptr && bias.data != nullptr) {
    masked_biased_row<true, true>(xr, wr, where.col_stride, bias_row, bias.col_stride, out, n);
  } else if (wr != nullptr) {
    masked_biased_row<true, false>(xr, wr, where.col_stride, bias_row, 0, out, n);
  } else {
    masked_biased_row<false, true>(xr, nullptr, 0, bias_row, bias.col_stride, out, n);
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
// JVP (g = the input's tangent) apply, from z (the row's visible logits, -inf
// where invisible) and its statistics m, inv (params/softmax.h):
//   s = sum_c term(z_c, g_c, m, inv, p_c),  out_c = out(z_c, p_c, g_c, s, m, inv),
// where term may store the float32 probability p_c = exp(z_c - m) * inv for
// out to reuse (one exp per column in all). Softmax's Jacobian is symmetric,
// so its VJP and JVP are one map; log_softmax's are each other's transpose.
// An invisible column takes no part and gets 0: its tangent or cotangent may
// be non-finite, and in a NaN row the row sum s is NaN (0 * NaN would be NaN).
// p is selected to 0 there, not computed: z - m is NaN in a NaN row.
//
// kStageRows: copy float rows into the thread's buffers before the reduction.
// A reduction with an exp per column, run on rows that are still in memory,
// keeps too few loads in flight (log_softmax's JVP: 15-20% slower at 4096 x 4096
// float32); where the exp is in the writing pass, the copy would only cost.
// (Bit selects, as in vector_math: a float select left the products under a
// branch that kept these loops scalar off AVX-512.)
inline float probability(float z, float m, float inv) {
  return vector_math::select(z != kNegInf, vexp_nonpositive(z - m) * inv, 0.f);
}

// p * (g - sum(p * g)) over the columns where p != 0 (a NaN p counts): as the
// kernels always have, a visible column whose p underflows to 0 takes no part.
struct SoftmaxLinearMap {
  static constexpr bool kStageRows = true;
  static float term(float z, float g, float m, float inv, float& p) {
    p = probability(z, m, inv);
    return vector_math::select(p != 0.f, p * g, 0.f);
  }
  static float out(float, float p, float g, float s, float, float) {
    return vector_math::select(p != 0.f, p * (g - s), 0.f);
  }
};

// g - p * sum(g) over the visible columns.
struct LogSoftmaxVjp {
  static constexpr bool kStageRows = false;
  static float term(float z, float g, float, float, float&) {
    return vector_math::select(z != kNegInf, g, 0.f);
  }
  static float out(float z, float, float g, float s, float m, float inv) {
    return vector_math::select(z != kNegInf, g - probability(z, m, inv) * s, 0.f);
  }
};

// g - sum(p * g) over the visible columns.
struct LogSoftmaxJvp {
  static constexpr bool kStageRows = true;
  static float term(float z, float g, float m, float inv, float&) {
    return vector_math::select(z != kNegInf, probability(z, m, inv) * g, 0.f);
  }
  static float out(float z, float, float g, float s, float, float) {
    return vector_math::select(z != kNegInf, g - s, 0.f);
  }
};

// out = Map(p, g + g_broadcast) row by row, p recomputed from `input`: one pass
// for s over rows that stay in cache, one that writes.
// With a causal limit, the columns past a row's visible prefix are 0 and take
// no part (they are not read).
template <typename Map, typename T>
void softmax_linear_map(const SoftmaxInput<T>& input, const T* g,
                        const BroadcastOperand<T>& g_broadcast, T* out, SoftmaxShape shape,
                        CausalLimit causal = {}) {
  const int64_t cols = shape.cols;
  const bool has_bias = input.bias.data != nullptr;
  const bool has_logits = input.where.data != nullptr || has_bias;
  advise_huge_pages(out, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    using Reader = std::conditional_t<Map::kStageRows, StagedRow<T>, RowBuffer<T>>;
    Reader x_rows(cols);
    RowBuffer<T> out_rows(cols, out, shape.rows * cols);
    SummedRows<T, Reader> g_rows(g, g_broadcast, cols);
    std::vector<float> logits(has_logits ? cols : 0);
    std::vector<float> bias_row(has_bias && input.bias.col_stride != 0 ? cols : 1);
    std::vector<float> probabilities(cols);
    float* p = probabilities.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const int64_t n = visible_prefix(r, shape, causal);
      const float* z = visible_logits(x_rows.read(input.x + r * cols, n), input.where,
                                      input.bias, r, bias_row.data(), logits.data(), n);
      const float* gr = g_rows.read(r);
      const float m = input.stats[kStatsPerRow * r];
      const float inv = input.stats[kStatsPerRow * r + 1];
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < n; ++c) s += Map::term(z[c], gr[c], m, inv, p[c]);
      float* o = out_rows.target(out + r * cols);
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = Map::out(z[c], p[c], gr[c], s, m, inv);
      std::fill(o + n, o + cols, 0.f);
      out_rows.commit(out + r * cols, cols);
    }
  }
}

}  // namespace

template <typename T>
void softmax_fwd(const T* x, const BroadcastOperand<uint8_t>& where,
                 const BroadcastOperand<T>& bias, T* y, float* stats, SoftmaxShape shape,
                 SoftmaxOutput output, CausalLimit causal) {
  const int64_t cols = shape.cols;
  const bool log_output = output == SoftmaxOutput::kLogProbabilities;
  const float invisible = log_output ? kNegInf : 0.f;
  advise_huge_pages(y, sizeof(T) * shape.rows * cols);
#pragma omp parallel
  {
    RowBuffer<T> x_rows(cols);
    RowBuffer<T> y_rows(cols, y, shape.rows * cols);
    std::vector<float> bias_row(bias.data != nullptr && bias.col_stride != 0 ? cols : 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const int64_t n = visible_prefix(r, shape, causal);
      const float* xr = x_rows.read(x + r * cols, n);
      float* out = y_rows.target(y + r * cols);
      // z is computed into the output row, which the passes below overwrite.
      const float* z = visible_logits(xr, where, bias, r, bias_row.data(), out, n);
      const float m = n > 0 ? row_max(z, n) : kNegInf;
      float inv_sum = 1.f;
      float* row_stats = stats + kStatsPerRow * r;
      row_stats[0] = m;
      if (m == kNegInf) {
        // max() skips NaN; a NaN beside only invisible columns still poisons the row.
        const bool has_nan = std::any_of(z, z + n, [](float v) { return v != v; });
        row_stats[1] = has_nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        if (has_nan && log_output) {
          nan_row_log_probabilities(z, out, n);
        } else {
          std::fill(out, out + cols, has_nan ? std::numeric_limits<float>::quiet_NaN() : invisible);
        }
      } else if (log_output) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) sum += vexp_nonpositive(z[c] - m);
        row_stats[1] = 1.f / sum;
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
        row_stats[1] = inv_sum;
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
void softmax_bwd(const T* dy, const SoftmaxInput<T>& input, T* dx, SoftmaxShape shape,
                 CausalLimit causal) {
  softmax_linear_map<SoftmaxLinearMap>(input, dy, BroadcastOperand<T>{}, dx, shape, causal);
}

template <typename T>
void log_softmax_bwd(const T* dy, const SoftmaxInput<T>& input, T* dx, SoftmaxShape shape) {
  softmax_linear_map<LogSoftmaxVjp>(input, dy, BroadcastOperand<T>{}, dx, shape);
}

template <typename T>
void softmax_jvp(const SoftmaxInput<T>& input, const T* dx, const BroadcastOperand<T>& dbias,
                 T* dy, SoftmaxShape shape, CausalLimit causal) {
  softmax_linear_map<SoftmaxLinearMap>(input, dx, dbias, dy, shape, causal);
}

template <typename T>
void log_softmax_jvp(const SoftmaxInput<T>& input, const T* dx, const BroadcastOperand<T>& dbias,
                     T* dy, SoftmaxShape shape) {
  softmax_linear_map<LogSoftmaxJvp>(input, dx, dbias, dy, shape);
}

#define JAXOPS_INSTANTIATE_SOFTMAX(T)                                                         \
  template void softmax_fwd<T>(const T*, const BroadcastOperand<uint8_t>&,                    \
                               const BroadcastOperand<T>&, T*, float*, SoftmaxShape,          \
                               SoftmaxOutput, CausalLimit);                                   \
  template void softmax_bwd<T>(const T*, const SoftmaxInput<T>&, T*, SoftmaxShape,            \
                               CausalLimit);                                                  \
  template void log_softmax_bwd<T>(const T*, const SoftmaxInput<T>&, T*, SoftmaxShape);       \
  template void softmax_jvp<T>(const SoftmaxInput<T>&, const T*, const BroadcastOperand<T>&,  \
                               T*, SoftmaxShape, CausalLimit);                                \
  template void log_softmax_jvp<T>(const SoftmaxInput<T>&, const T*,                          \
                                   const BroadcastOperand<T>&, T*, SoftmaxShape);

JAXOPS_INSTANTIATE_SOFTMAX(float)
JAXOPS_INSTANTIATE_SOFTMAX(bfloat16)
JAXOPS_INSTANTIATE_SOFTMAX(float16)

}  // namespace jaxops::cpu
