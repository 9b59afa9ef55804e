// CPU FFI handlers of cross-entropy: decode and validate, then call cpu/cross_entropy.
#include "cpu/cross_entropy.h"
#include "cpu/float_convert.h"
#include "xla_ffi/cross_entropy_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace cross_entropy_common;

// The CPU kernels' element types, for check_and_run.
struct DispatchCpuFloat {
  template <typename Fn>
  ffi::Error operator()(const std::string& op, ffi::DataType dtype, Fn&& fn) const {
    return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
  }
};

ffi::Error CrossEntropyFwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Result<ffi::Buffer<ffi::F32>> loss,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  return check_and_run(
      kCrossEntropyFwd.name, logits, labels, ignore_index, label_smoothing, z_loss,
      DispatchCpuFloat{},
      [&](auto* s) { return check_cross_entropy_fwd(logits, labels, *loss, *lse, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        cpu::cross_entropy_fwd(typed_logits, typed_labels, loss->typed_data(), lse->typed_data(),
                               s, options);
        return ffi::Error::Success();
      });
}

ffi::Error CrossEntropyBwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::F32> dloss, ffi::Result<ffi::AnyBuffer> dlogits,
                           int64_t ignore_index, float label_smoothing, float z_loss) {
  return check_and_run(
      kCrossEntropyBwd.name, logits, labels, ignore_index, label_smoothing, z_loss,
      DispatchCpuFloat{},
      [&](auto* s) { return check_cross_entropy_bwd(logits, labels, lse, dloss, *dlogits, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        cpu::cross_entropy_bwd(typed_logits, typed_labels, lse.typed_data(), dloss.typed_data(),
                               like(typed_logits, *dlogits), s, options);
        return ffi::Error::Success();
      });
}

ffi::Error CrossEntropyFwdGrad(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::Result<ffi::Buffer<ffi::F32>> loss,
                               ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                               float label_smoothing, float z_loss) {
  return check_and_run(
      kCrossEntropyFwdGrad.name, logits, labels, ignore_index, label_smoothing, z_loss,
      DispatchCpuFloat{},
      [&](auto* s) { return check_cross_entropy_fwd_grad(logits, labels, *loss, *dlogits, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        cpu::cross_entropy_fwd_grad(typed_logits, typed_labels, loss->typed_data(),
                                    like(typed_logits, *dlogits), s, options);
        return ffi::Error::Success();
      });
}

ffi::Error CrossEntropyJvp(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::Buffer<ffi::F32> lse,
                           ffi::AnyBuffer dlogits, ffi::Result<ffi::Buffer<ffi::F32>> dloss,
                           int64_t ignore_index, float label_smoothing, float z_loss) {
  return check_and_run(
      kCrossEntropyJvp.name, logits, labels, ignore_index, label_smoothing, z_loss,
      DispatchCpuFloat{},
      [&](auto* s) { return check_cross_entropy_jvp(logits, labels, lse, dlogits, *dloss, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        cpu::cross_entropy_jvp(typed_logits, typed_labels, lse.typed_data(),
                               like(typed_logits, dlogits), dloss->typed_data(), s, options);
        return ffi::Error::Success();
      });
}

}  // namespace

JAXOPS_FFI_TARGET(kCrossEntropyFwd, kCrossEntropyFwdCpu, CrossEntropyFwd,
                  bind_cross_entropy_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kCrossEntropyBwd, kCrossEntropyBwdCpu, CrossEntropyBwd,
                  bind_cross_entropy_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kCrossEntropyFwdGrad, kCrossEntropyFwdGradCpu, CrossEntropyFwdGrad,
                  bind_cross_entropy_fwd_grad(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kCrossEntropyJvp, kCrossEntropyJvpCpu, CrossEntropyJvp,
                  bind_cross_entropy_jvp(ffi::Ffi::Bind()));

}  // namespace jaxops
