// CUDA FFI handlers of the softmax family: the CPU handlers' targets, bindings
// and validation (xla_ffi/softmax_common.h), then a launch of cuda/softmax on
// the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/softmax.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/softmax_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace softmax_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error masked_softmax_fwd(const std::string& op, cuda::SoftmaxOutput output,
                              cudaStream_t stream, const ffi::AnyBuffer& x,
                              const ffi::AnyBuffer& where, const ffi::AnyBuffer& bias,
                              ffi::AnyBuffer& y, ffi::AnyBuffer& stats) {
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_masked_softmax_fwd(op, x, where, bias, y, stats, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    BroadcastOperand<uint8_t> where_view;
    BroadcastOperand<T> bias_view;
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "where", where, x, &where_view));
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "bias", bias, x, &bias_view));
    return launch_status(op, cuda::softmax_fwd<T>(stream, data<const T>(x), where_view, bias_view,
                                                  data<T>(y), data<float>(stats), s, output, {}));
  });
}

ffi::Error SoftmaxFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer where,
                      ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> stats) {
  return masked_softmax_fwd(kSoftmaxFwd.name, cuda::SoftmaxOutput::kProbabilities, stream, x,
                            where, bias, *y, *stats);
}

ffi::Error LogSoftmaxFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer where,
                         ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> stats) {
  return masked_softmax_fwd(kLogSoftmaxFwd.name, cuda::SoftmaxOutput::kLogProbabilities,
                            stream, x, where, bias, *y, *stats);
}

ffi::Error CausalSoftmaxFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> stats, int64_t query_offset) {
  const std::string op = kCausalSoftmaxFwd.name;
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(check_causal_softmax_fwd(x, *y, *stats, query_offset, &s, &causal));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::softmax_fwd<T>(stream, data<const T>(x), {}, {}, data<T>(*y),
                                 data<float>(*stats), s, cuda::SoftmaxOutput::kProbabilities,
                                 causal));
  });
}

template <bool kLog>
ffi::Error SoftmaxBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                      ffi::AnyBuffer where, ffi::AnyBuffer bias, ffi::AnyBuffer stats,
                      ffi::Result<ffi::AnyBuffer> dx) {
  const std::string op = kLog ? kLogSoftmaxBwd.name : kSoftmaxBwd.name;
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_softmax_bwd(op, dy, x, where, bias, stats, *dx, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    SoftmaxInput<T> input;
    JAXOPS_RETURN_IF_ERROR(softmax_input(op, x, where, bias, stats, &input));
    if constexpr (kLog) {
      return launch_status(
          op, cuda::log_softmax_bwd<T>(stream, data<const T>(dy), input, data<T>(*dx), s));
    } else {
      return launch_status(
          op, cuda::softmax_bwd<T>(stream, data<const T>(dy), input, data<T>(*dx), s, {}));
    }
  });
}

ffi::Error CausalSoftmaxBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::AnyBuffer stats, ffi::Result<ffi::AnyBuffer> dx,
                            int64_t query_offset) {
  const std::string op = kCausalSoftmaxBwd.name;
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(
      check_causal_softmax_bwd(dy, x, stats, *dx, query_offset, &s, &causal));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const SoftmaxInput<T> input{data<const T>(x), {}, {}, data<const float>(stats)};
    return launch_status(
        op, cuda::softmax_bwd<T>(stream, data<const T>(dy), input, data<T>(*dx), s, causal));
  });
}

template <bool kLog>
ffi::Error SoftmaxJvp(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer where,
                      ffi::AnyBuffer bias, ffi::AnyBuffer stats, ffi::AnyBuffer dx,
                      ffi::AnyBuffer dbias, ffi::Result<ffi::AnyBuffer> dy) {
  const std::string op = kLog ? kLogSoftmaxJvp.name : kSoftmaxJvp.name;
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_softmax_jvp(op, x, where, bias, stats, dx, dbias, *dy, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    SoftmaxInput<T> input;
    JAXOPS_RETURN_IF_ERROR(softmax_input(op, x, where, bias, stats, &input));
    BroadcastOperand<T> dbias_view;
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "dbias", dbias, x, &dbias_view));
    if constexpr (kLog) {
      return launch_status(op, cuda::log_softmax_jvp<T>(stream, input, data_or_null<const T>(dx),
                                                        dbias_view, data<T>(*dy), s));
    } else {
      return launch_status(op, cuda::softmax_jvp<T>(stream, input, data_or_null<const T>(dx),
                                                    dbias_view, data<T>(*dy), s, {}));
    }
  });
}

ffi::Error CausalSoftmaxJvp(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer stats,
                            ffi::AnyBuffer dx, ffi::Result<ffi::AnyBuffer> dy,
                            int64_t query_offset) {
  const std::string op = kCausalSoftmaxJvp.name;
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(check_causal_softmax_jvp(x, stats, dx, *dy, query_offset, &s, &causal));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const SoftmaxInput<T> input{data<const T>(x), {}, {}, data<const float>(stats)};
    return launch_status(op, cuda::softmax_jvp<T>(stream, input, data_or_null<const T>(dx), {},
                                                  data<T>(*dy), s, causal));
  });
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
JAXOPS_FFI_TARGET(kSoftmaxFwd, kSoftmaxFwdCuda, SoftmaxFwd,
                  bind_masked_softmax_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kLogSoftmaxFwd, kLogSoftmaxFwdCuda, LogSoftmaxFwd,
                  bind_masked_softmax_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kCausalSoftmaxFwd, kCausalSoftmaxFwdCuda, CausalSoftmaxFwd,
                  bind_causal_softmax_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSoftmaxBwd, kSoftmaxBwdCuda, SoftmaxBwd<false>,
                  bind_softmax_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kCausalSoftmaxBwd, kCausalSoftmaxBwdCuda, CausalSoftmaxBwd,
                  bind_causal_softmax_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kLogSoftmaxBwd, kLogSoftmaxBwdCuda, SoftmaxBwd<true>,
                  bind_softmax_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSoftmaxJvp, kSoftmaxJvpCuda, SoftmaxJvp<false>,
                  bind_softmax_jvp(cuda_binding()));
JAXOPS_FFI_TARGET(kLogSoftmaxJvp, kLogSoftmaxJvpCuda, SoftmaxJvp<true>,
                  bind_softmax_jvp(cuda_binding()));
JAXOPS_FFI_TARGET(kCausalSoftmaxJvp, kCausalSoftmaxJvpCuda, CausalSoftmaxJvp,
                  bind_causal_softmax_jvp(cuda_binding()));

}  // namespace jaxops
