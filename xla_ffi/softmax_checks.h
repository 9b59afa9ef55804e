// Validation of the softmax family's buffers, shared by the CPU and CUDA
// handlers so the two platforms accept exactly the same calls.
#pragma once

#include <string>

#include "xla_ffi/ffi_common.h"

namespace jaxops::softmax_checks {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

// x and an output (or a second input) shaped like it.
inline ffi::Error check_rows(const std::string& op, const ffi::AnyBuffer& x,
                             const ffi::AnyBuffer& other, const char* other_name,
                             RowsCols* shape) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "x", x, shape));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "x", x, other_name, other));
  return same_dtype(op, "x", x, other_name, other);
}

// An optional operand broadcast against x: absent when it has no elements,
// else of x's rank with each axis 1 or x's size, and of dtype `dtype`.
inline ffi::Error check_broadcast_operand(const std::string& op, const char* name,
                                          const ffi::AnyBuffer& operand, const ffi::AnyBuffer& x,
                                          ffi::DataType dtype, const char* dtype_name) {
  if (operand.element_count() == 0) return ffi::Error::Success();
  auto dims = operand.dimensions();
  auto x_dims = x.dimensions();
  bool ok = dims.size() == x_dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i] == 1 || dims[i] == x_dims[i];
  if (!ok) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) +
                           ", expected x's rank with each axis 1 or x's size " +
                           dims_string(x_dims));
  }
  if (operand.element_type() != dtype) {
    return invalid(op, std::string(name) + " must have dtype " + dtype_name);
  }
  return ffi::Error::Success();
}

inline ffi::Error check_causal(const std::string& op, const ffi::AnyBuffer& x) {
  if (x.dimensions().size() < 2) return invalid(op, "x must have rank >= 2 (queries, keys)");
  return ffi::Error::Success();
}

}  // namespace jaxops::softmax_checks
