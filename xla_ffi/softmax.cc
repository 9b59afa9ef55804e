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
                              const ffi::AnyBuffer& bias, ffi::AnyBuffer& y,
                              ffi::AnyBuffer& stats) {
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_masked_softmax_fwd(op, x, where, bias, y, stats, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    BroadcastOperand<uint8_t> where_view;
    BroadcastOperand<T> bias_view;
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "where", where, x, &where_view));
    JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "bias", bias, x, &bias_view));
    cpu::softmax_fwd<T>(data<const T>(x), where_view, bias_view, data<T>(y), data<float>(stats),
                        s, output, {});
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxFwd(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> stats) {
  return masked_softmax_fwd(kSoftmaxFwd.name, cpu::SoftmaxOutput::kProbabilities, x, where,
                            bias, *y, *stats);
}

ffi::Error LogSoftmaxFwd(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> stats) {
  return masked_softmax_fwd(kLogSoftmaxFwd.name, cpu::SoftmaxOutput::kLogProbabilities, x,
                            where, bias, *y, *stats);
}

ffi::Error CausalSoftmaxFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> stats, int64_t query_offset) {
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(check_causal_softmax_fwd(x, *y, *stats, query_offset, &s, &causal));
  return dispatch(kCausalSoftmaxFwd.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::softmax_fwd<T>(data<const T>(x), {}, {}, data<T>(*y), data<float>(*stats), s,
                        cpu::SoftmaxOutput::kProbabilities, causal);
    return ffi::Error::Success();
  });
}

template <bool kLog>
ffi::Error SoftmaxBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer where,
                      ffi::AnyBuffer bias, ffi::AnyBuffer stats, ffi::Result<ffi::AnyBuffer> dx) {
  const std::string op = kLog ? kLogSoftmaxBwd.name : kSoftmaxBwd.name;
  SoftmaxShape s;
  JAXOPS_RETURN_IF_ERROR(check_softmax_bwd(op, dy, x, where, bias, stats, *dx, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    SoftmaxInput<T> input;
    JAXOPS_RETURN_IF_ERROR(softmax_input(op, x, where, bias, stats, &input));
    if constexpr (kLog) {
      cpu::log_softmax_bwd<T>(data<const T>(dy), input, data<T>(*dx), s);
    } else {
      cpu::softmax_bwd<T>(data<const T>(dy), input, data<T>(*dx), s, {});
    }
    return ffi::Error::Success();
  });
}

ffi::Error CausalSoftmaxBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer stats,
                            ffi::Result<ffi::AnyBuffer> dx, int64_t query_offset) {
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(
      check_causal_softmax_bwd(dy, x, stats, *dx, query_offset, &s, &causal));
  return dispatch(kCausalSoftmaxBwd.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const SoftmaxInput<T> input{data<const T>(x), {}, {}, data<const float>(stats)};
    cpu::softmax_bwd<T>(data<const T>(dy), input, data<T>(*dx), s, causal);
    return ffi::Error::Success();
  });
}

template <bool kLog>
ffi::Error SoftmaxJvp(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                      ffi::AnyBuffer stats, ffi::AnyBuffer dx, ffi::AnyBuffer dbias,
                      ffi::Result<ffi::AnyBuffer> dy) {
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
      cpu::log_softmax_jvp<T>(input, data_or_null<const T>(dx), dbias_view, data<T>(*dy), s);
    } else {
      cpu::softmax_jvp<T>(input, data_or_null<const T>(dx), dbias_view, data<T>(*dy), s, {});
    }
    return ffi::Error::Success();
  });
}

ffi::Error CausalSoftmaxJvp(ffi::AnyBuffer x, ffi::AnyBuffer stats, ffi::AnyBuffer dx,
                            ffi::Result<ffi::AnyBuffer> dy, int64_t query_offset) {
  SoftmaxShape s;
  CausalLimit causal;
  JAXOPS_RETURN_IF_ERROR(
      check_causal_softmax_jvp(x, stats, dx, *dy, query_offset, &s, &causal));
  return dispatch(kCausalSoftmaxJvp.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const SoftmaxInput<T> input{data<const T>(x), {}, {}, data<const float>(stats)};
    cpu::softmax_jvp<T>(input, data_or_null<const T>(dx), {}, data<T>(*dy), s, causal);
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
                  bind_causal_softmax_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLogSoftmaxBwd, kLogSoftmaxBwdCpu, SoftmaxBwd<true>,
                  bind_softmax_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSoftmaxJvp, kSoftmaxJvpCpu, SoftmaxJvp<false>,
                  bind_softmax_jvp(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLogSoftmaxJvp, kLogSoftmaxJvpCpu, SoftmaxJvp<true>,
                  bind_softmax_jvp(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kCausalSoftmaxJvp, kCausalSoftmaxJvpCpu, CausalSoftmaxJvp,
                  bind_causal_softmax_jvp(ffi::Ffi::Bind()));

}  // namespace jaxops
