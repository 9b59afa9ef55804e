#include "cpu/cross_entropy.h"

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

enum class LabelKind { kValid, kIgnored, kOutOfRange };

template <typename Label>
LabelKind classify(Label label, int64_t vocab, int64_t ignore_index) {
  const int64_t value = static_cast<int64_t>(label);
  if (value == ignore_index) return LabelKind::kIgnored;
  return value >= 0 && value < vocab ? LabelKind::kValid : LabelKind::kOutOfRange;
}

struct RowLoss {
  float loss;
  float lse;
};

RowLoss row_loss(const float* z, int64_t vocab, int64_t label, CrossEntropyOptions options) {
  // Maxima spelled as the select vmaxps implements (GCC's std::max is 3x slower
  // here); the row sum only when label smoothing needs it.
  float m = kNegInf, total = 0.f;
  if (options.label_smoothing != 0.f) {
#pragma omp simd reduction(max : m) reduction(+ : total)
    for (int64_t c = 0; c < vocab; ++c) {
      m = m > z[c] ? m : z[c];
      total += z[c];
    }
  } else {
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < vocab; ++c) m = m > z[c] ? m : z[c];
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < vocab; ++c) sum += vexp_nonpositive(z[c] - m);
  const float lse = m + std::log(sum);
  const float eps = options.label_smoothing;
  const float loss = (1.f - eps) * (lse - z[label]) +
                     eps * (lse - total / static_cast<float>(vocab)) +
                     options.z_loss * lse * lse;
  return {loss, lse};
}

// d = g * (p * (1 + 2 z lse) - eps / vocab - (1 - eps) onehot(label)); d may be z.
void row_grad(const float* z, float lse, int64_t label, float g, float* d, int64_t vocab,
              CrossEntropyOptions options) {
  const float eps = options.label_smoothing;
  const float scale = g * (1.f + 2.f * options.z_loss * lse);
  const float uniform = g * eps / static_cast<float>(vocab);
  const float target = z[label];
#pragma omp simd
  for (int64_t c = 0; c < vocab; ++c) d[c] = scale * vexp_nonpositive(z[c] - lse) - uniform;
  d[label] = scale * vexp_nonpositive(target - lse) - uniform - g * (1.f - eps);
}

// Sums of the loss's tangent over a row: sum(p * dz) and sum(dz).
struct JvpSums {
  float p_dot = 0.f;
  float total = 0.f;
};

// Adds n columns of logits z and tangents dz to the sums.
void add_jvp_sums(const float* z, const float* dz, float lse, int64_t n, JvpSums* sums) {
  float p_dot = 0.f, total = 0.f;
#pragma omp simd reduction(+ : p_dot, total)
  for (int64_t c = 0; c < n; ++c) {
    p_dot += vexp_nonpositive(z[c] - lse) * dz[c];
    total += dz[c];
  }
  sums->p_dot += p_dot;
  sums->total += total;
}

// The JVP reads each row once: converted chunk by chunk into buffers that stay
// in L1, so the loads of the next chunk overlap the arithmetic of this one
// (whole converted rows would alternate memory-bound and compute-bound phases).
constexpr int64_t kJvpChunk = 1024;

template <typename T>
void zero_row(T* row, int64_t n) {
  std::fill(row, row + n, T(0.f));
}

}  // namespace

template <typename T, typename Label>
void cross_entropy_fwd(const T* logits, const Label* labels, float* loss, float* lse,
                       CrossEntropyShape shape, CrossEntropyOptions options) {
  const int64_t vocab = shape.vocab;
#pragma omp parallel
  {
    RowBuffer<T> rows(vocab);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      const LabelKind kind = classify(labels[r], vocab, options.ignore_index);
      lse[r] = 0.f;
      if (kind != LabelKind::kValid) {
        loss[r] = kind == LabelKind::kIgnored ? 0.f : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const RowLoss out = row_loss(rows.read(logits + r * vocab, vocab), vocab,
                                   static_cast<int64_t>(labels[r]), options);
      loss[r] = out.loss;
      lse[r] = out.lse;
    }
  }
}

template <typename T, typename Label>
void cross_entropy_bwd(const T* logits, const Label* labels, const float* lse, const float* dloss,
                       T* dlogits, CrossEntropyShape shape, CrossEntropyOptions options) {
  const int64_t vocab = shape.vocab;
  if (dlogits != logits) advise_huge_pages(dlogits, sizeof(T) * shape.rows * vocab);
#pragma omp parallel
  {
    // In place (dlogits == logits) the rows are present already.
    RowBuffer<T> in(vocab);
    RowBuffer<T> out(vocab, dlogits, dlogits != logits ? shape.rows * vocab : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      T* d = dlogits + r * vocab;
      if (classify(labels[r], vocab, options.ignore_index) != LabelKind::kValid) {
        zero_row(d, vocab);
        continue;
      }
      const float* z = in.read(logits + r * vocab, vocab);
      row_grad(z, lse[r], static_cast<int64_t>(labels[r]), dloss[r], out.target(d), vocab,
               options);
      out.commit(d, vocab);
    }
  }
}

template <typename T, typename Label>
void cross_entropy_fwd_grad(const T* logits, const Label* labels, float* loss, T* dlogits,
                            CrossEntropyShape shape, CrossEntropyOptions options) {
  const int64_t vocab = shape.vocab;
  if (dlogits != logits) advise_huge_pages(dlogits, sizeof(T) * shape.rows * vocab);
#pragma omp parallel
  {
    // In place (dlogits == logits) the rows are present already.
    RowBuffer<T> in(vocab);
    RowBuffer<T> out(vocab, dlogits, dlogits != logits ? shape.rows * vocab : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      T* d = dlogits + r * vocab;
      const LabelKind kind = classify(labels[r], vocab, options.ignore_index);
      if (kind != LabelKind::kValid) {
        loss[r] = kind == LabelKind::kIgnored ? 0.f : std::numeric_limits<float>::quiet_NaN();
        zero_row(d, vocab);
        continue;
      }
      const int64_t label = static_cast<int64_t>(labels[r]);
      const float* z = in.read(logits + r * vocab, vocab);
      const RowLoss stats = row_loss(z, vocab, label, options);
      loss[r] = stats.loss;
      row_grad(z, stats.lse, label, 1.f, out.target(d), vocab, options);
      out.commit(d, vocab);
    }
  }
}

template <typename T, typename Label>
void cross_entropy_jvp(const T* logits, const Label* labels, const float* lse, const T* dlogits,
                       float* dloss, CrossEntropyShape shape, CrossEntropyOptions options) {
  const int64_t vocab = shape.vocab;
  const float eps = options.label_smoothing;
#pragma omp parallel
  {
    RowBuffer<T> z_chunk(kJvpChunk), dz_chunk(kJvpChunk);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < shape.rows; ++r) {
      if (classify(labels[r], vocab, options.ignore_index) != LabelKind::kValid) {
        dloss[r] = 0.f;
        continue;
      }
      const T* z = logits + r * vocab;
      const T* dz = dlogits + r * vocab;
      JvpSums sums;
      for (int64_t c = 0; c < vocab; c += kJvpChunk) {
        const int64_t n = std::min(kJvpChunk, vocab - c);
        add_jvp_sums(z_chunk.read(z + c, n), dz_chunk.read(dz + c, n), lse[r], n, &sums);
      }
      const float picked = to_float(dz[static_cast<int64_t>(labels[r])]);
      dloss[r] = (1.f + 2.f * options.z_loss * lse[r]) * sums.p_dot -
                 eps * sums.total / static_cast<float>(vocab) - (1.f - eps) * picked;
    }
  }
}

#define JAXOPS_INSTANTIATE_CROSS_ENTROPY(T, Label)                                             \
  template void cross_entropy_fwd<T, Label>(const T*, const Label*, float*, float*,           \
                                            CrossEntropyShape, CrossEntropyOptions);          \
  template void cross_entropy_bwd<T, Label>(const T*, const Label*, const float*, const float*, \
                                            T*, CrossEntropyShape, CrossEntropyOptions);      \
  template void cross_entropy_fwd_grad<T, Label>(const T*, const Label*, float*, T*,          \
                                                 CrossEntropyShape, CrossEntropyOptions);     \
  template void cross_entropy_jvp<T, Label>(const T*, const Label*, const float*, const T*,   \
                                            float*, CrossEntropyShape, CrossEntropyOptions);

JAXOPS_INSTANTIATE_CROSS_ENTROPY(float, int32_t)
JAXOPS_INSTANTIATE_CROSS_ENTROPY(float, int64_t)
JAXOPS_INSTANTIATE_CROSS_ENTROPY(bfloat16, int32_t)
JAXOPS_INSTANTIATE_CROSS_ENTROPY(bfloat16, int64_t)
JAXOPS_INSTANTIATE_CROSS_ENTROPY(float16, int32_t)
JAXOPS_INSTANTIATE_CROSS_ENTROPY(float16, int64_t)

}  // namespace jaxops::cpu
