#include "cpu/rope.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"
#include "cpu/vector_math.h"

namespace jaxops::cpu {
namespace {

// Below this many elements a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;

// cos and (signed) sin of every position row and frequency: row r holds
// cos[half] then sin[half].
void build_table(const int32_t* positions, float* table, RopeShape shape, double theta,
                 bool inverse) {
  const int64_t half = shape.rotary_dim / 2;
  const int64_t rows = shape.position_rows * shape.seq;
  // float32(theta^(-2i / rotary_dim)) evaluated in double, as the reference does.
  std::vector<float> frequency(half);
  for (int64_t i = 0; i < half; ++i) {
    frequency[i] = static_cast<float>(
        std::pow(theta, -(2.0 * static_cast<double>(i)) / static_cast<double>(shape.rotary_dim)));
  }
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) if (rows * half >= kMinParallel / 8)
  for (int64_t r = 0; r < rows; ++r) {
    const float position = static_cast<float>(positions[r]);
    float* cos_row = table + r * 2 * half;
    float* sin_row = cos_row + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      float s, c;
      vector_math::sincos(position * frequency[i], &s, &c);
      cos_row[i] = c;
      sin_row[i] = sign * s;
    }
  }
}

}  // namespace

template <typename T>
void rope(const T* x, const int32_t* positions, T* y, float* workspace, RopeShape shape,
          double theta, bool interleaved, bool inverse) {
  const int64_t half = shape.rotary_dim / 2;
  const int64_t head_dim = shape.head_dim;
  const int64_t tokens = shape.batch * shape.seq;
  build_table(positions, workspace, shape, theta, inverse);
  advise_huge_pages(y, sizeof(T) * tokens * shape.heads * head_dim);
#pragma omp parallel if (tokens * shape.heads * head_dim >= kMinParallel)
  {
    RowBuffer<T> reader(head_dim);
    RowBuffer<T> writer(head_dim, y, tokens * shape.heads * head_dim);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t b = t / shape.seq, s = t % shape.seq;
      const int64_t row = (shape.position_rows == 1 ? 0 : b) * shape.seq + s;
      const float* cos_row = workspace + row * 2 * half;
      const float* sin_row = cos_row + half;
      for (int64_t n = 0; n < shape.heads; ++n) {
        const int64_t offset = (t * shape.heads + n) * head_dim;
        const float* xr = reader.read(x + offset, head_dim);
        float* yr = writer.target(y + offset);
        if (interleaved) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xr[2 * i], x2 = xr[2 * i + 1];
            yr[2 * i] = x1 * cos_row[i] - x2 * sin_row[i];
            yr[2 * i + 1] = x2 * cos_row[i] + x1 * sin_row[i];
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xr[i], x2 = xr[i + half];
            yr[i] = x1 * cos_row[i] - x2 * sin_row[i];
            yr[i + half] = x2 * cos_row[i] + x1 * sin_row[i];
          }
        }
        if (shape.rotary_dim < head_dim) {
          std::memcpy(yr + shape.rotary_dim, xr + shape.rotary_dim,
                      sizeof(float) * (head_dim - shape.rotary_dim));
        }
        writer.commit(y + offset, head_dim);
      }
    }
  }
}

#define JAXOPS_INSTANTIATE_ROPE(T)                                                           \
  template void rope<T>(const T*, const int32_t*, T*, float*, RopeShape, double, bool, bool);

JAXOPS_INSTANTIATE_ROPE(float)
JAXOPS_INSTANTIATE_ROPE(bfloat16)
JAXOPS_INSTANTIATE_ROPE(float16)

}  // namespace jaxops::cpu
