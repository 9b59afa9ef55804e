// Validation of the cross-entropy buffers, shared by the CPU and CUDA handlers
// so the two platforms accept exactly the same calls.
#pragma once

#include <string>

#include "xla_ffi/ffi_common.h"

namespace jaxops::cross_entropy_checks {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

// logits [..., vocab] and labels [...] (int32 or int64).
inline ffi::Error check_logits_and_labels(const std::string& op, const ffi::AnyBuffer& logits,
                                          const ffi::AnyBuffer& labels, RowsCols* shape) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "logits", logits, shape));
  auto dims = logits.dimensions();
  auto label_dims = labels.dimensions();
  bool same = label_dims.size() + 1 == dims.size();
  for (size_t i = 0; same && i < label_dims.size(); ++i) same = label_dims[i] == dims[i];
  if (!same) {
    return invalid(op, "labels has shape " + dims_string(label_dims) +
                           ", expected the leading axes of logits " + dims_string(dims));
  }
  if (labels.element_type() != ffi::DataType::S32 && labels.element_type() != ffi::DataType::S64) {
    return invalid(op, "labels must have dtype int32 or int64");
  }
  return ffi::Error::Success();
}

// A float32 value per row (loss, lse, dloss), shaped like the labels.
inline ffi::Error check_row_values(const std::string& op, const char* name,
                                   const ffi::Buffer<ffi::F32>& values,
                                   const ffi::AnyBuffer& labels) {
  return same_dims(op, "labels", labels, name, values);
}

inline ffi::Error check_options(const std::string& op, float label_smoothing, float z_loss) {
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f)) {
    return invalid(op, "label_smoothing must be in [0, 1]");
  }
  if (!(z_loss >= 0.f)) return invalid(op, "z_loss must be >= 0");
  return ffi::Error::Success();
}

}  // namespace jaxops::cross_entropy_checks
