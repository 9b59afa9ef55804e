// CUDA FFI handlers of cross-entropy: the CPU handlers' targets, bindings and
// validation (xla_ffi/cross_entropy_common.h), then a launch of
// cuda/cross_entropy on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/cross_entropy.h"
#include "xla_ffi/cross_entropy_common.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace cross_entropy_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::Dispatch;
using ffi_cuda::launch_status;

ffi::Error CrossEntropyFwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Result<ffi::Buffer<ffi::F32>> loss,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = kCrossEntropyFwd.name;
  return check_and_run(
      op, logits, labels, ignore_index, label_smoothing, z_loss, Dispatch{},
      [&](auto* s) { return check_cross_entropy_fwd(logits, labels, *loss, *lse, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        return launch_status(op, cuda::cross_entropy_fwd(stream, typed_logits, typed_labels,
                                                         loss->typed_data(), lse->typed_data(),
                                                         s, options));
      });
}

ffi::Error CrossEntropyBwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dloss,
                           ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = kCrossEntropyBwd.name;
  return check_and_run(
      op, logits, labels, ignore_index, label_smoothing, z_loss, Dispatch{},
      [&](auto* s) { return check_cross_entropy_bwd(logits, labels, lse, dloss, *dlogits, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        return launch_status(
            op, cuda::cross_entropy_bwd(stream, typed_logits, typed_labels, lse.typed_data(),
                                        dloss.typed_data(), like(typed_logits, *dlogits), s,
                                        options));
      });
}

ffi::Error CrossEntropyFwdGrad(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::Result<ffi::Buffer<ffi::F32>> loss,
                               ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                               float label_smoothing, float z_loss) {
  const std::string op = kCrossEntropyFwdGrad.name;
  return check_and_run(
      op, logits, labels, ignore_index, label_smoothing, z_loss, Dispatch{},
      [&](auto* s) { return check_cross_entropy_fwd_grad(logits, labels, *loss, *dlogits, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        return launch_status(
            op, cuda::cross_entropy_fwd_grad(stream, typed_logits, typed_labels,
                                             loss->typed_data(), like(typed_logits, *dlogits), s,
                                             options));
      });
}

ffi::Error CrossEntropyJvp(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dlogits,
                           ffi::Result<ffi::Buffer<ffi::F32>> dloss, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = kCrossEntropyJvp.name;
  return check_and_run(
      op, logits, labels, ignore_index, label_smoothing, z_loss, Dispatch{},
      [&](auto* s) { return check_cross_entropy_jvp(logits, labels, lse, dlogits, *dloss, s); },
      [&](auto* typed_logits, auto* typed_labels, const auto& s, const auto& options) {
        return launch_status(
            op, cuda::cross_entropy_jvp(stream, typed_logits, typed_labels, lse.typed_data(),
                                        like(typed_logits, dlogits), dloss->typed_data(), s,
                                        options));
      });
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
JAXOPS_FFI_TARGET(kCrossEntropyFwd, kCrossEntropyFwdCuda, CrossEntropyFwd,
                  bind_cross_entropy_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kCrossEntropyBwd, kCrossEntropyBwdCuda, CrossEntropyBwd,
                  bind_cross_entropy_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kCrossEntropyFwdGrad, kCrossEntropyFwdGradCuda, CrossEntropyFwdGrad,
                  bind_cross_entropy_fwd_grad(cuda_binding()));
JAXOPS_FFI_TARGET(kCrossEntropyJvp, kCrossEntropyJvpCuda, CrossEntropyJvp,
                  bind_cross_entropy_jvp(cuda_binding()));

}  // namespace jaxops
