// Helpers shared by the FFI handlers: argument validation that returns an
// ffi::Error (a handler never aborts on a bad buffer), and dispatch from the
// buffer dtype to a kernel instantiation.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxops::ffi_common {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& op, const std::string& message) {
  return ffi::Error::InvalidArgument(op + ": " + message);
}

inline std::string dims_string(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

inline int64_t product(ffi::Span<const int64_t> dims, size_t begin, size_t end) {
  int64_t out = 1;
  for (size_t i = begin; i < end; ++i) out *= dims[i];
  return out;
}

// Rows (product of the leading axes) and columns (the last axis) of a buffer
// that is normalised or reduced over its last axis, written into the fields of
// the family's shape struct (params/).
template <typename Buffer>
inline ffi::Error rows_cols(const std::string& op, const char* name, const Buffer& buffer,
                            int64_t* rows, int64_t* cols) {
  auto dims = buffer.dimensions();
  if (dims.size() < 1) return invalid(op, std::string(name) + " must have rank >= 1");
  *cols = dims.back();
  *rows = product(dims, 0, dims.size() - 1);
  if (*cols <= 0) return invalid(op, std::string(name) + " must have a non-empty last axis");
  return ffi::Error::Success();
}

template <typename A, typename B>
inline ffi::Error same_dims(const std::string& op, const char* a_name, const A& a,
                            const char* b_name, const B& b) {
  auto da = a.dimensions(), db = b.dimensions();
  bool same = da.size() == db.size();
  for (size_t i = 0; same && i < da.size(); ++i) same = da[i] == db[i];
  if (!same) {
    return invalid(op, std::string(b_name) + " has shape " + dims_string(db) + ", expected " +
                           a_name + "'s shape " + dims_string(da));
  }
  return ffi::Error::Success();
}

template <typename Buffer, typename Dims>
inline ffi::Error dims_are(const std::string& op, const char* name, const Buffer& buffer,
                           const Dims& expected) {
  auto dims = buffer.dimensions();
  bool same = dims.size() == expected.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expected[i];
  if (!same) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) + ", expected " +
                           dims_string(ffi::Span<const int64_t>(expected.data(), expected.size())));
  }
  return ffi::Error::Success();
}

template <typename Buffer>
inline ffi::Error element_count_is(const std::string& op, const char* name, const Buffer& buffer,
                                   int64_t expected) {
  if (static_cast<int64_t>(buffer.element_count()) != expected) {
    return invalid(op, std::string(name) + " has " + std::to_string(buffer.element_count()) +
                           " elements, expected " + std::to_string(expected));
  }
  return ffi::Error::Success();
}

template <typename A, typename B>
inline ffi::Error same_dtype(const std::string& op, const char* a_name, const A& a,
                             const char* b_name, const B& b) {
  if (a.element_type() != b.element_type()) {
    return invalid(op, std::string(b_name) + " must have the dtype of " + a_name);
  }
  return ffi::Error::Success();
}

// An optional operand (a tangent) is absent when it is the zero-size placeholder [0].
template <typename Buffer>
inline bool is_placeholder(const Buffer& buffer) {
  auto dims = buffer.dimensions();
  return dims.size() == 1 && dims[0] == 0;
}

// An optional operand that, when present, has the shape and dtype of `like`.
template <typename A, typename B>
inline ffi::Error check_optional_like(const std::string& op, const char* like_name, const A& like,
                                      const char* name, const B& operand) {
  if (is_placeholder(operand)) return ffi::Error::Success();
  if (same_dims(op, like_name, like, name, operand).failure()) {
    return invalid(op, std::string(name) + " has shape " + dims_string(operand.dimensions()) +
                           ", expected " + like_name + "'s shape " +
                           dims_string(like.dimensions()) + " or [0] (absent)");
  }
  return same_dtype(op, like_name, like, name, operand);
}

// Calls fn(T{}) with T the kernel element type of `dtype` (float, bfloat16,
// float16); any other dtype is an error.
template <typename Float32, typename BFloat16, typename Float16, typename Fn>
inline ffi::Error dispatch_float(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(Float32{});
    case ffi::DataType::BF16:
      return fn(BFloat16{});
    case ffi::DataType::F16:
      return fn(Float16{});
    default:
      return invalid(op, "unsupported dtype (expected float32, bfloat16 or float16)");
  }
}

template <typename T, typename Buffer>
inline T* data_or_null(Buffer& buffer) {
  return buffer.element_count() == 0 ? nullptr : reinterpret_cast<T*>(buffer.untyped_data());
}

template <typename T, typename Buffer>
inline T* data(Buffer& buffer) {
  return reinterpret_cast<T*>(buffer.untyped_data());
}

#define JAXOPS_RETURN_IF_ERROR(expr)             \
  do {                                           \
    ::xla::ffi::Error jaxops_error_ = (expr);    \
    if (jaxops_error_.failure()) return jaxops_error_; \
  } while (0)

}  // namespace jaxops::ffi_common
