// What the CPU and CUDA handlers of cross-entropy share, so the two platforms
// bind the same signatures and accept exactly the same calls: the FFI bindings
// (each takes the platform's binding prefix: nothing for the CPU, the stream for
// CUDA) and the validation of every buffer.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "params/cross_entropy.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::cross_entropy_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::CrossEntropyOptions;
using ::jaxops::params::CrossEntropyShape;

// -- the targets' contract ------------------------------------------------------------

// The options every cross-entropy target binds, in this order.
inline constexpr contract::Attribute<int64_t> kIgnoreIndex{"ignore_index"};
inline constexpr contract::Attribute<float> kLabelSmoothing{"label_smoothing"};
inline constexpr contract::Attribute<float> kZLoss{"z_loss"};

inline constexpr auto kCrossEntropyFwd = contract::target(
    "jaxops_cross_entropy_fwd", kIgnoreIndex, kLabelSmoothing, kZLoss);
inline constexpr auto kCrossEntropyBwd = contract::target(
    "jaxops_cross_entropy_bwd", kIgnoreIndex, kLabelSmoothing, kZLoss);
inline constexpr auto kCrossEntropyFwdGrad = contract::target(
    "jaxops_cross_entropy_fwd_grad", kIgnoreIndex, kLabelSmoothing, kZLoss);
inline constexpr auto kCrossEntropyJvp = contract::target(
    "jaxops_cross_entropy_jvp", kIgnoreIndex, kLabelSmoothing, kZLoss);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kCrossEntropyFwd), describe(kCrossEntropyBwd),
          describe(kCrossEntropyFwdGrad), describe(kCrossEntropyJvp)};
}

// logits [..., vocab] and labels [...] (int32 or int64).
inline ffi::Error check_logits_and_labels(const std::string& op, const ffi::AnyBuffer& logits,
                                          const ffi::AnyBuffer& labels, CrossEntropyShape* shape) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "logits", logits, &shape->rows, &shape->vocab));
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

inline ffi::Error check_dlogits(const std::string& op, const ffi::AnyBuffer& logits,
                                const ffi::AnyBuffer& dlogits) {
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "logits", logits, "dlogits", dlogits));
  return same_dtype(op, "logits", logits, "dlogits", dlogits);
}

// The attributes, checked into the kernels' options.
inline ffi::Error check_options(const std::string& op, int64_t ignore_index,
                                float label_smoothing, float z_loss,
                                CrossEntropyOptions* options) {
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f)) {
    return invalid(op, "label_smoothing must be in [0, 1]");
  }
  if (!(z_loss >= 0.f)) return invalid(op, "z_loss must be >= 0");
  *options = {ignore_index, label_smoothing, z_loss};
  return ffi::Error::Success();
}

// -- whole-call validation: one check of the buffers per handler, then the options -------

inline ffi::Error check_cross_entropy_fwd(const ffi::AnyBuffer& logits,
                                          const ffi::AnyBuffer& labels,
                                          const ffi::Buffer<ffi::F32>& loss,
                                          const ffi::Buffer<ffi::F32>& lse, CrossEntropyShape* s) {
  const std::string op = kCrossEntropyFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "loss", loss, labels));
  return check_row_values(op, "lse", lse, labels);
}

inline ffi::Error check_cross_entropy_bwd(const ffi::AnyBuffer& logits,
                                          const ffi::AnyBuffer& labels,
                                          const ffi::Buffer<ffi::F32>& lse,
                                          const ffi::Buffer<ffi::F32>& dloss,
                                          const ffi::AnyBuffer& dlogits, CrossEntropyShape* s) {
  const std::string op = kCrossEntropyBwd.name;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "lse", lse, labels));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "dloss", dloss, labels));
  return check_dlogits(op, logits, dlogits);
}

inline ffi::Error check_cross_entropy_fwd_grad(const ffi::AnyBuffer& logits,
                                               const ffi::AnyBuffer& labels,
                                               const ffi::Buffer<ffi::F32>& loss,
                                               const ffi::AnyBuffer& dlogits,
                                               CrossEntropyShape* s) {
  const std::string op = kCrossEntropyFwdGrad.name;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "loss", loss, labels));
  return check_dlogits(op, logits, dlogits);
}

inline ffi::Error check_cross_entropy_jvp(const ffi::AnyBuffer& logits,
                                          const ffi::AnyBuffer& labels,
                                          const ffi::Buffer<ffi::F32>& lse,
                                          const ffi::AnyBuffer& dlogits,
                                          const ffi::Buffer<ffi::F32>& dloss,
                                          CrossEntropyShape* s) {
  const std::string op = kCrossEntropyJvp.name;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "lse", lse, labels));
  JAXOPS_RETURN_IF_ERROR(check_dlogits(op, logits, dlogits));
  return check_row_values(op, "dloss", dloss, labels);
}

// What every handler does around its kernel: check its buffers with
// `check_buffers(&shape)` (one of the above), then the attributes, then call
// `run(logits, labels, shape, options)` with the two buffers' data typed as
// the logits' float type (which `dispatch_float(op, dtype, fn)`, the
// platform's, picks) and the labels' int type.
template <typename DispatchFloat, typename CheckBuffers, typename Run>
ffi::Error check_and_run(const std::string& op, const ffi::AnyBuffer& logits,
                         const ffi::AnyBuffer& labels, int64_t ignore_index,
                         float label_smoothing, float z_loss, DispatchFloat&& dispatch_float,
                         CheckBuffers&& check_buffers, Run&& run) {
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_buffers(&s));
  JAXOPS_RETURN_IF_ERROR(check_options(op, ignore_index, label_smoothing, z_loss, &options));
  return dispatch_float(op, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if (labels.element_type() == ffi::DataType::S64) {
      return run(data<const T>(logits), data<const int64_t>(labels), s, options);
    }
    return run(data<const T>(logits), data<const int32_t>(labels), s, options);
  });
}

// A buffer's data in the element type of `typed_logits` (dlogits).
template <typename T, typename Buffer>
T* like(const T* /*typed_logits*/, Buffer& buffer) {
  return data<T>(buffer);
}

// -- bindings: `prefix` is ffi::Ffi::Bind(), with the stream context on CUDA ----------

template <typename Binding>
auto bind_cross_entropy_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits
                          .template Arg<ffi::AnyBuffer>()               // labels
                          .template Ret<ffi::Buffer<ffi::F32>>()        // loss
      .template Ret<ffi::Buffer<ffi::F32>>();              // lse
}

template <typename Binding>
auto bind_cross_entropy_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits
                          .template Arg<ffi::AnyBuffer>()               // labels
                          .template Arg<ffi::Buffer<ffi::F32>>()        // lse
                          .template Arg<ffi::Buffer<ffi::F32>>()        // dloss
      .template Ret<ffi::AnyBuffer>();                     // dlogits
}

template <typename Binding>
auto bind_cross_entropy_fwd_grad(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits
                          .template Arg<ffi::AnyBuffer>()               // labels
                          .template Ret<ffi::Buffer<ffi::F32>>()        // loss
      .template Ret<ffi::AnyBuffer>();                     // dlogits
}

// The tangent primitive: dlogits is the logits' tangent, dloss the loss's.
template <typename Binding>
auto bind_cross_entropy_jvp(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits
                          .template Arg<ffi::AnyBuffer>()               // labels
                          .template Arg<ffi::Buffer<ffi::F32>>()        // lse
                          .template Arg<ffi::AnyBuffer>()               // dlogits
      .template Ret<ffi::Buffer<ffi::F32>>();              // dloss
}

}  // namespace jaxops::cross_entropy_common
