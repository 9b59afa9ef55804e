#include "cpu/embedding.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"

namespace jaxops::cpu {
namespace {

// Below this many elements a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;

inline int64_t clamp_id(int32_t id, int64_t vocab) {
  return std::min<int64_t>(std::max<int64_t>(id, 0), vocab - 1);
}

}  // namespace

template <typename T>
void embedding_fwd(const T* table, const int32_t* ids, T* out, EmbeddingShape shape) {
  const int64_t dim = shape.dim;
  advise_huge_pages(out, sizeof(T) * shape.tokens * dim);
#pragma omp parallel if (shape.tokens * dim >= kMinParallel)
  {
    WriteAhead write_ahead(out, sizeof(T) * shape.tokens * dim);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < shape.tokens; ++t) {
      write_ahead.before_write(out + t * dim, sizeof(T) * dim);
      std::memcpy(out + t * dim, table + clamp_id(ids[t], shape.vocab) * dim, sizeof(T) * dim);
    }
  }
}

template <typename T>
void embedding_bwd(const T* dout, const int32_t* ids, T* dtable, int32_t* workspace,
                   EmbeddingShape shape) {
  const int64_t vocab = shape.vocab, dim = shape.dim, tokens = shape.tokens;
  // Counting sort of the tokens by row: row_end[v] ends row v's run of `order`
  // (row v's tokens are order[row_end[v - 1] .. row_end[v]), in token order).
  // Serial: O(tokens + vocab), small next to the O(vocab * dim) output.
  int32_t* row_end = workspace;
  int32_t* order = workspace + vocab + 1;
  std::fill(row_end, row_end + vocab + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) ++row_end[clamp_id(ids[t], vocab) + 1];
  for (int64_t v = 0; v < vocab; ++v) row_end[v + 1] += row_end[v];
  // row_end[v] is now the start of row v; placing each token advances it to the end.
  for (int64_t t = 0; t < tokens; ++t) {
    order[row_end[clamp_id(ids[t], vocab)]++] = static_cast<int32_t>(t);
  }

  advise_huge_pages(dtable, sizeof(T) * vocab * dim);
#pragma omp parallel if (vocab * dim >= kMinParallel)
  {
    std::vector<float> sum(std::is_same_v<T, float> ? 0 : dim), row(std::is_same_v<T, float> ? 0 : dim);
#pragma omp for schedule(static)
    for (int64_t v = 0; v < vocab; ++v) {
      const int64_t begin = v == 0 ? 0 : row_end[v - 1], end = row_end[v];
      T* out = dtable + v * dim;
      if (begin == end) {
        // All-zero bits are +0 in float, bfloat16 and float16.
        std::memset(static_cast<void*>(out), 0, sizeof(T) * dim);
        continue;
      }
      float* acc = result_target(out, sum.data());
      std::fill(acc, acc + dim, 0.0f);
      for (int64_t k = begin; k < end; ++k) {
        const float* values =
            read_as_float(dout + static_cast<int64_t>(order[k]) * dim, dim, row.data());
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) acc[c] += values[c];
      }
      commit_result(acc, out, dim);
    }
  }
}

#define JAXOPS_INSTANTIATE_EMBEDDING(T)                                             \
  template void embedding_fwd<T>(const T*, const int32_t*, T*, EmbeddingShape);     \
  template void embedding_bwd<T>(const T*, const int32_t*, T*, int32_t*, EmbeddingShape);

JAXOPS_INSTANTIATE_EMBEDDING(float)
JAXOPS_INSTANTIATE_EMBEDDING(bfloat16)
JAXOPS_INSTANTIATE_EMBEDDING(float16)

}  // namespace jaxops::cpu
