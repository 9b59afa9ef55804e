// Float32 views of rows (or blocks) stored as T (float, bfloat16, float16),
// for kernels that compute in float32: the data itself when T is float (no
// copy), else a copy converted once (cpu/float_convert.h) into a buffer the
// thread owns. A result is computed in float32 where result_target() points
// and stored as T by commit_result().
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"

namespace jaxops::cpu {

// The first n elements of `src` as float32: src itself when T is float, else
// converted into `buffer` (n floats).
template <typename T>
inline const float* read_as_float(const T* src, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, buffer, n);
    return buffer;
  }
}

// Where a float32 result destined for `dst` is computed: dst itself when T is
// float, else `buffer`, which commit_result() then stores as T.
template <typename T>
inline float* result_target(T* dst, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return buffer;
  }
}

template <typename T>
inline void commit_result(const float* buffer, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) store_row(buffer, dst, n);
}

// A buffer of one row for read_as_float (as a reader) or result_target and
// commit_result (as a writer); a kernel keeps one per row it holds at once.
// A writer given its output [output, output + elements) populates that
// output ahead of its rows (cpu/fresh_memory.h, WriteAhead): a fresh output
// then faults in a chunk per system call, not a page per trap.
template <typename T>
class RowBuffer {
 public:
  explicit RowBuffer(int64_t cols) : cols_(cols), buffer_(std::is_same_v<T, float> ? 0 : cols) {}
  RowBuffer(int64_t cols, const T* output, int64_t elements) : RowBuffer(cols) {
    write_ahead_ = WriteAhead(output, sizeof(T) * static_cast<size_t>(elements));
  }

  // The first n elements of `row` as float32.
  const float* read(const T* row, int64_t n) { return read_as_float(row, n, buffer_.data()); }

  // Where a result row (of at most cols elements) is computed in float32
  // before commit() stores it as T.
  float* target(T* row) {
    write_ahead_.before_write(row, sizeof(T) * static_cast<size_t>(cols_));
    return result_target(row, buffer_.data());
  }

  void commit(T* row, int64_t n) { commit_result(buffer_.data(), row, n); }

 private:
  int64_t cols_;
  std::vector<float> buffer_;
  WriteAhead write_ahead_;
};

}  // namespace jaxops::cpu
