// CUDA FFI handlers of cross-entropy: the CPU handlers' targets, bindings and
// validation (xla_ffi/cross_entropy_common.h), then a launch of
// cuda/cross_entropy on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/cross_entropy.h"
#include "xla_ffi/cross_entropy_common.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace cross_entropy_common;
using ffi_cuda::launch_status;

// Calls fn(T{}, Label{}) for the logits' float type and the labels' int type.
template <typename Fn>
ffi::Error dispatch(const std::string& op, const ffi::AnyBuffer& logits,
                    const ffi::AnyBuffer& labels, Fn&& fn) {
  return dispatch_float<float, __nv_bfloat16, __half>(op, logits.element_type(), [&](auto tag) {
    if (labels.element_type() == ffi::DataType::S64) return fn(tag, int64_t{});
    return fn(tag, int32_t{});
  });
}

ffi::Error CrossEntropyFwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Result<ffi::Buffer<ffi::F32>> loss,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_fwd";
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(
      check_cross_entropy_fwd(logits, labels, *loss, *lse, ignore_index, label_smoothing, z_loss,
                              &s, &options));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    return launch_status(op, cuda::cross_entropy_fwd<T, Label>(
                                 stream, data<const T>(logits), data<const Label>(labels),
                                 loss->typed_data(), lse->typed_data(), s, options));
  });
}

ffi::Error CrossEntropyBwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dloss,
                           ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_bwd";
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_cross_entropy_bwd(logits, labels, lse, dloss, *dlogits,
                                                 ignore_index, label_smoothing, z_loss, &s,
                                                 &options));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    return launch_status(op, cuda::cross_entropy_bwd<T, Label>(
                                 stream, data<const T>(logits), data<const Label>(labels),
                                 lse.typed_data(), dloss.typed_data(), data<T>(*dlogits),
                                 s, options));
  });
}

ffi::Error CrossEntropyFwdGrad(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::Result<ffi::Buffer<ffi::F32>> loss,
                               ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                               float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_fwd_grad";
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_cross_entropy_fwd_grad(logits, labels, *loss, *dlogits,
                                                      ignore_index, label_smoothing, z_loss, &s,
                                                 &options));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    return launch_status(op, cuda::cross_entropy_fwd_grad<T, Label>(
                                 stream, data<const T>(logits), data<const Label>(labels),
                                 loss->typed_data(), data<T>(*dlogits), s, options));
  });
}

ffi::Error CrossEntropyJvp(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                           ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dlogits,
                           ffi::Result<ffi::Buffer<ffi::F32>> dloss, int64_t ignore_index,
                           float label_smoothing, float z_loss) {
  const std::string op = "jaxops_cross_entropy_jvp";
  CrossEntropyShape s;
  CrossEntropyOptions options;
  JAXOPS_RETURN_IF_ERROR(check_cross_entropy_jvp(logits, labels, lse, dlogits, *dloss,
                                                 ignore_index, label_smoothing, z_loss, &s,
                                                 &options));
  return dispatch(op, logits, labels, [&](auto tag, auto label_tag) {
    using T = decltype(tag);
    using Label = decltype(label_tag);
    return launch_status(op, cuda::cross_entropy_jvp<T, Label>(
                                 stream, data<const T>(logits), data<const Label>(labels),
                                 lse.typed_data(), data<const T>(dlogits), dloss->typed_data(),
                                 s, options));
  });
}

// Every CUDA handler takes the stream XLA launches on before its buffers. The
// CPU harness of the tests (tests/cuda_harness) compiles this file unchanged as
// CPU handlers, with a context of its own that provides the stream.
#ifndef JAXOPS_CUDA_STREAM_CONTEXT
#define JAXOPS_CUDA_STREAM_CONTEXT ffi::PlatformStream<cudaStream_t>
#endif
auto cuda_binding() { return ffi::Ffi::Bind().Ctx<JAXOPS_CUDA_STREAM_CONTEXT>(); }

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyFwdCuda, CrossEntropyFwd,
                              bind_cross_entropy_fwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyBwdCuda, CrossEntropyBwd,
                              bind_cross_entropy_bwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyFwdGradCuda, CrossEntropyFwdGrad,
                              bind_cross_entropy_fwd_grad(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCrossEntropyJvpCuda, CrossEntropyJvp,
                              bind_cross_entropy_jvp(cuda_binding()));

JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_fwd", kCrossEntropyFwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_bwd", kCrossEntropyBwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_fwd_grad", kCrossEntropyFwdGradCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_cross_entropy_jvp", kCrossEntropyJvpCuda);

}  // namespace jaxops
