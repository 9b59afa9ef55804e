// Validation of the norms' buffers, shared by the CPU and CUDA handlers so the
// two platforms accept exactly the same calls.
#pragma once

#include <string>

#include "xla_ffi/ffi_common.h"

namespace jaxops::norms_checks {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

// x and an output shaped like it, and an optional per-column parameter
// (weight or bias: absent when it has no elements).
inline ffi::Error check_row_major_io(const std::string& op, const ffi::AnyBuffer& x,
                                     const ffi::AnyBuffer& y, const char* y_name, RowsCols* shape) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "x", x, shape));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "x", x, y_name, y));
  return same_dtype(op, "x", x, y_name, y);
}

inline ffi::Error check_column_param(const std::string& op, const char* name,
                                     const ffi::AnyBuffer& param, const ffi::AnyBuffer& x,
                                     int64_t cols) {
  if (param.dimensions().size() != 1 ||
      (param.element_count() != 0 && static_cast<int64_t>(param.element_count()) != cols)) {
    return invalid(op, std::string(name) + " has shape " + dims_string(param.dimensions()) +
                           ", expected [" + std::to_string(cols) + "] or [0] (absent)");
  }
  return same_dtype(op, "x", x, name, param);
}

inline ffi::Error check_row_stat(const std::string& op, const char* name,
                                 const ffi::Buffer<ffi::F32>& stat, int64_t rows) {
  return element_count_is(op, name, stat, rows);
}

// A weight gradient [groups, cols] (or [groups, 0] when the parameter is absent)
// and the workspace [groups * parts, sums, cols]; returns parts through *parts.
inline ffi::Error check_weight_grad(const std::string& op, const char* name,
                                    const ffi::AnyBuffer& grad, const ffi::AnyBuffer& param,
                                    int64_t groups, int64_t cols) {
  auto dims = grad.dimensions();
  const int64_t expected_cols = param.element_count() == 0 ? 0 : cols;
  if (dims.size() != 2 || dims[0] != groups || dims[1] != expected_cols) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) + ", expected [" +
                           std::to_string(groups) + ", " + std::to_string(expected_cols) + "]");
  }
  return same_dtype(op, "x", param, name, grad);
}

inline ffi::Error check_groups_and_workspace(const std::string& op, int64_t groups, RowsCols shape,
                                             const ffi::Buffer<ffi::F32>& workspace, int sums,
                                             int64_t* parts) {
  if (groups < 1 || shape.rows % groups != 0) {
    return invalid(op, "groups=" + std::to_string(groups) + " must be >= 1 and divide the " +
                           std::to_string(shape.rows) + " rows");
  }
  auto dims = workspace.dimensions();
  if (dims.size() != 3 || dims[0] < groups || dims[0] % groups != 0 || dims[1] != sums ||
      dims[2] != shape.cols) {
    return invalid(op, "workspace has shape " + dims_string(dims) + ", expected [groups * parts, " +
                           std::to_string(sums) + ", " + std::to_string(shape.cols) + "]");
  }
  *parts = dims[0] / groups;
  return ffi::Error::Success();
}

}  // namespace jaxops::norms_checks
