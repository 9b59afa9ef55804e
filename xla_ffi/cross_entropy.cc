// CPU FFI handlers of cross-entropy: decode and validate, then call cpu/cross_entropy.
#include "cpu/cross_entropy.h"
#include "cpu/float_convert.h"
#include "xla_ffi/cross_entropy_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace cross_entropy_common;

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

ffi::Error CrossEntropyFwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Result<ffi::Buffer<ffi::F32>> loss,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(
      check_cross_entropy_fwd(logits, labels, *loss, *lse, ignore_index, label_smoothing, z_loss,
                              &s, &options));
  return dispatch("jaxops_cross_entropy_fwd", logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_fwd<T, Label>(data<const T>(logits), data<const Label>(labels),
                                     loss->typed_data(), lse->typed_data(), s, options);
    return ffi::Error::Success();
  });
}

ffi::Error CrossEntropyBwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::F32> dloss, ffi::Result<ffi::AnyBuffer> dlogits,
                           int64_t ignore_index, float label_smoothing, float z_loss) {
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_cross_entropy_bwd(logits, labels, lse, dloss, *dlogits,
                                                 ignore_index, label_smoothing, z_loss, &s,
                                                 &options));
  return dispatch("jaxops_cross_entropy_bwd", logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_bwd<T, Label>(data<const T>(logits), data<const Label>(labels),
                                     lse.typed_data(), dloss.typed_data(), data<T>(*dlogits),
                                     s, options);
    return ffi::Error::Success();
  });
}

ffi::Error CrossEntropyFwdGrad(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::Result<ffi::Buffer<ffi::F32>> loss,
                               ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                               float label_smoothing, float z_loss) {
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_cross_entropy_fwd_grad(logits, labels, *loss, *dlogits,
                                                      ignore_index, label_smoothing, z_loss, &s,
                                                 &options));
  return dispatch("jaxops_cross_entropy_fwd_grad", logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_fwd_grad<T, Label>(data<const T>(logits), data<const Label>(labels),
                                          loss->typed_data(), data<T>(*dlogits), s, options);
    return ffi::Error::Success();
  });
}

ffi::Error CrossEntropyJvp(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::Buffer<ffi::F32> lse,
                           ffi::AnyBuffer dlogits, ffi::Result<ffi::Buffer<ffi::F32>> dloss,
                           int64_t ignore_index, float label_smoothing, float z_loss) {
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_cross_entropy_jvp(logits, labels, lse, dlogits, *dloss,
                                                 ignore_index, label_smoothing, z_loss, &s,
                                                 &options));
  return dispatch("jaxops_cross_entropy_jvp", logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    cpu::cross_entropy_jvp<T, Label>(data<const T>(logits), data<const Label>(labels),
                                     lse.typed_data(), data<const T>(dlogits),
                                     dloss->typed_data(), s, options);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyFwd, CrossEntropyFwd,
                              bind_cross_entropy_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyBwd, CrossEntropyBwd,
                              bind_cross_entropy_bwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyFwdGrad, CrossEntropyFwdGrad,
                              bind_cross_entropy_fwd_grad(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyJvp, CrossEntropyJvp,
                              bind_cross_entropy_jvp(ffi::Ffi::Bind()));

JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_fwd", kCrossEntropyFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_bwd", kCrossEntropyBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_fwd_grad", kCrossEntropyFwdGrad);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_jvp", kCrossEntropyJvp);

}  // namespace jaxops
