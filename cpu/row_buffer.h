// Float32 views of rows stored as T (float, bfloat16, float16), for kernels that
// make several passes over a row: the row itself when T is float (no copy),
// else a copy converted once into a buffer the thread owns.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/float_convert.h"

namespace jaxops::cpu {

template <typename T>
class RowBuffer {
 public:
  explicit RowBuffer(int64_t cols) : buffer_(std::is_same_v<T, float> ? 0 : cols) {}

  // The first n elements of `row` as float32.
  const float* read(const T* row, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      return row;
    } else {
      load_row(row, buffer_.data(), n);
      return buffer_.data();
    }
  }

  // Where a result row is computed in float32 before commit() stores it as T.
  float* target(T* row) {
    if constexpr (std::is_same_v<T, float>) {
      return row;
    } else {
      return buffer_.data();
    }
  }

  void commit(T* row, int64_t n) {
    if constexpr (!std::is_same_v<T, float>) store_row(buffer_.data(), row, n);
  }

 private:
  std::vector<float> buffer_;
};

}  // namespace jaxops::cpu
