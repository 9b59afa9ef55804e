// CPU FFI handlers of the softmax family: decode and validate, then call cpu/softmax.
#include "cpu/float_convert.h"
#include "cpu/softmax.h"
#include "xla_ffi/softmax_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace softmax_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error masked_softmax_fwd(const std::string& op, cpu::SoftmaxOutput output,
                              const ffi::AnyBuffer& x, const ffi::AnyBuffer& where,
                              const ffi::AnyBuffer& bias, ffi::AnyBuffer& y) {
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_masked_softmax_fwd(op, x, where, bias, y, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    BroadcastOperand<uint8_t> where_view;
    BroadcastOperand<T> bias_view;
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "where", where, x, &where_view));
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "bias", bias, x, &bias_view));
    cpu::softmax_fwd<T>(data<const T>(x), where_view, bias_view, data<T>(y), s, output, {});
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxFwd(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> y) {
  return masked_softmax_fwd(kSoftmaxFwd.name, cpu::SoftmaxOutput::kProbabilities, x, where,
                            bias, *y);
}

ffi::Error LogSoftmaxFwd(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                         ffi::Result<ffi::AnyBuffer> y) {
  return masked_softmax_fwd(kLogSoftmaxFwd.name, cpu::SoftmaxOutput::kLogProbabilities, x,
                            where, bias, *y);
}

ffi::Error CausalSoftmaxFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                            int64_t query_offset) {
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(check_causal_softmax_fwd(x, *y, query_offset, &s, &causal));
  return dispatch(kCausalSoftmaxFwd.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::softmax_fwd<T>(data<const T>(x), {}, {}, data<T>(*y), s,
                        cpu::SoftmaxOutput::kProbabilities, causal);
    return ffi::Error::Success();
  });
}

// A validated backward call; `causal` is softmax's limit (none unless causal_softmax's).
template <bool kLog>
ffi::Error softmax_bwd(const std::string& op, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& y,
                       ffi::AnyBuffer& dx, SoftmaxShape s, CausalLimit causal) {
  return dispatch(op, y.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kLog) {
      cpu::log_softmax_bwd<T>(data<const T>(dy), data<const T>(y), data<T>(dx), s);
    } else {
      cpu::softmax_bwd<T>(data<const T>(dy), data<const T>(y), data<T>(dx), s, causal);
    }
    return ffi::Error::Success();
  });
}

template <bool kLog>
ffi::Error SoftmaxBwd(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx) {
  const std::string op = kLog ? kLogSoftmaxBwd.name : kSoftmaxBwd.name;
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_softmax_bwd(op, dy, y, *dx, &s));
  return softmax_bwd<kLog>(op, dy, y, *dx, s, {});
}

ffi::Error CausalSoftmaxBwd(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx,
                            int64_t query_offset) {
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(check_causal_softmax_bwd(dy, y, *dx, query_offset, &s, &causal));
  return softmax_bwd<false>(kCausalSoftmaxBwd.name, dy, y, *dx, s, causal);
}

template <bool kLog>
ffi::Error SoftmaxJvp(ffi::AnyBuffer y, ffi::AnyBuffer dx, ffi::AnyBuffer dbias,
                      ffi::Result<ffi::AnyBuffer> dy) {
  const std::string op = kLog ? kLogSoftmaxJvp.name : kSoftmaxJvp.name;
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_softmax_jvp(op, y, dx, dbias, *dy, &s));
  return dispatch(op, y.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto jvp = kLog ? cpu::log_softmax_jvp<T> : cpu::softmax_jvp<T>;
    BroadcastOperand<T> dbias_view;
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "dbias", dbias, y, &dbias_view));
    jvp(data<const T>(y), data_or_null<const T>(dx), dbias_view, data<T>(*dy), s);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kSoftmaxFwd, kSoftmaxFwdCpu, SoftmaxFwd,
                  bind_masked_softmax_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLogSoftmaxFwd, kLogSoftmaxFwdCpu, LogSoftmaxFwd,
                  bind_masked_softmax_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kCausalSoftmaxFwd, kCausalSoftmaxFwdCpu, CausalSoftmaxFwd,
                  bind_causal_softmax_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSoftmaxBwd, kSoftmaxBwdCpu, SoftmaxBwd<false>,
                  bind_softmax_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kCausalSoftmaxBwd, kCausalSoftmaxBwdCpu, CausalSoftmaxBwd,
                  bind_softmax_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLogSoftmaxBwd, kLogSoftmaxBwdCpu, SoftmaxBwd<true>,
                  bind_softmax_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSoftmaxJvp, kSoftmaxJvpCpu, SoftmaxJvp<false>,
                  bind_softmax_jvp(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLogSoftmaxJvp, kLogSoftmaxJvpCpu, SoftmaxJvp<true>,
                  bind_softmax_jvp(ffi::Ffi::Bind()));

}  // namespace jaxops
