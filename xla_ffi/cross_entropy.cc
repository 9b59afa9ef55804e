// CPU FFI handlers of cross-entropy: decode and validate, then call cpu/cross_entropy.
#include "cpu/cross_entropy.h"
#include "cpu/float_convert.h"
#include "xla_ffi/cross_entropy_checks.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace cross_entropy_checks;

// Calls fn(T{}, Label{}) for the logits' float type and the labels' int type.
template <typename Fn>
ffi::Error dispatch(const std::string& op, const ffi::AnyBuffer& logits,
                    const ffi::AnyBuffer& labels, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(
      op, logits.element_type(), [&](auto tag) {
        if (labels.element_type() == ffi::DataType::S64) return fn(tag, int64_t{});
        return fn(tag, int32_t{});
      });
}

cpu::CrossEntropyOptions options(int64_t ignore_index, float label_smoothing, float z_loss) {
  return {ignore_index, label_smoothing, z_loss};
}

ffi::Error CrossEntropyFwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Result<ffi::Buffer<ffi::F32>> loss,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_fwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, &s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "loss", *loss, labels));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "lse", *lse, labels));
  JAXOPS_RETURN_IF_ERROR(check_options(op, label_smoothing, z_loss));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_fwd<T, Label>(data<const T>(logits), data<const Label>(labels),
                                     loss->typed_data(), lse->typed_data(), {s.rows, s.cols},
                                     options(ignore_index, label_smoothing, z_loss));
    return ffi::Error::Success();
  });
}

ffi::Error CrossEntropyBwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::F32> dloss, ffi::Result<ffi::AnyBuffer> dlogits,
                           int64_t ignore_index, float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_bwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, &s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "lse", lse, labels));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "dloss", dloss, labels));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "logits", logits, "dlogits", *dlogits));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "logits", logits, "dlogits", *dlogits));
  JAXOPS_RETURN_IF_ERROR(check_options(op, label_smoothing, z_loss));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_bwd<T, Label>(data<const T>(logits), data<const Label>(labels),
                                     lse.typed_data(), dloss.typed_data(), data<T>(*dlogits),
                                     {s.rows, s.cols},
                                     options(ignore_index, label_smoothing, z_loss));
    return ffi::Error::Success();
  });
}

ffi::Error CrossEntropyFwdGrad(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::Result<ffi::Buffer<ffi::F32>> loss,
                               ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                               float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_fwd_grad";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_logits_and_labels(op, logits, labels, &s));
  JAXOPS_RETURN_IF_ERROR(check_row_values(op, "loss", *loss, labels));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "logits", logits, "dlogits", *dlogits));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "logits", logits, "dlogits", *dlogits));
  JAXOPS_RETURN_IF_ERROR(check_options(op, label_smoothing, z_loss));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_fwd_grad<T, Label>(data<const T>(logits), data<const Label>(labels),
                                          loss->typed_data(), data<T>(*dlogits), {s.rows, s.cols},
                                          options(ignore_index, label_smoothing, z_loss));
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyFwd, CrossEntropyFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels
                                  .Ret<ffi::Buffer<ffi::F32>>()  // loss
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<float>("label_smoothing")
                                  .Attr<float>("z_loss"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyBwd, CrossEntropyBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dloss
                                  .Ret<ffi::AnyBuffer>()  // dlogits
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<float>("label_smoothing")
                                  .Attr<float>("z_loss"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyFwdGrad, CrossEntropyFwdGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels
                                  .Ret<ffi::Buffer<ffi::F32>>()  // loss
                                  .Ret<ffi::AnyBuffer>()  // dlogits
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<float>("label_smoothing")
                                  .Attr<float>("z_loss"));

JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_fwd", kCrossEntropyFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_bwd", kCrossEntropyBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_fwd_grad", kCrossEntropyFwdGrad);

}  // namespace jaxops
