// CPU FFI handlers of the softmax family: decode and validate, then call cpu/softmax.
#include "cpu/float_convert.h"
#include "cpu/softmax.h"
#include "xla_ffi/registry.h"
#include "xla_ffi/softmax_checks.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace softmax_checks;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

template <typename T>
cpu::BroadcastOperand<T> broadcast_view(const ffi::AnyBuffer& operand, const ffi::AnyBuffer& x) {
  const T* values = operand.element_count() == 0
                        ? nullptr
                        : reinterpret_cast<const T*>(operand.untyped_data());
  return cpu::broadcast_operand(values, x.dimensions().begin(), operand.dimensions().begin(),
                                static_cast<int>(x.dimensions().size()));
}

ffi::Error masked_softmax_fwd(const std::string& op, cpu::SoftmaxOutput output, ffi::AnyBuffer x,
                              ffi::AnyBuffer where, ffi::AnyBuffer bias, ffi::AnyBuffer* y) {
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_rows(op, x, *y, "y", &s));
  JAXOPS_RETURN_IF_ERROR(check_broadcast_operand(op, "where", where, x, ffi::DataType::PRED, "bool"));
  JAXOPS_RETURN_IF_ERROR(check_broadcast_operand(op, "bias", bias, x, x.element_type(), "x's dtype"));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::softmax_fwd<T>(data<const T>(x), broadcast_view<uint8_t>(where, x),
                        broadcast_view<T>(bias, x), data<T>(*y), {s.rows, s.cols}, output, {});
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxFwd(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> y) {
  return masked_softmax_fwd("jaxops_softmax_fwd", cpu::SoftmaxOutput::kProbabilities, x, where,
                            bias, &*y);
}

ffi::Error LogSoftmaxFwd(ffi::AnyBuffer x, ffi::AnyBuffer where, ffi::AnyBuffer bias,
                         ffi::Result<ffi::AnyBuffer> y) {
  return masked_softmax_fwd("jaxops_log_softmax_fwd", cpu::SoftmaxOutput::kLogProbabilities, x,
                            where, bias, &*y);
}

ffi::Error CausalSoftmaxFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                            int64_t query_offset) {
  const std::string op = "jaxops_causal_softmax_fwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_rows(op, x, *y, "y", &s));
  JAXOPS_RETURN_IF_ERROR(check_causal(op, x));
  const int64_t queries = x.dimensions()[x.dimensions().size() - 2];
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::softmax_fwd<T>(data<const T>(x), {}, {}, data<T>(*y), {s.rows, s.cols},
                        cpu::SoftmaxOutput::kProbabilities, {queries, query_offset});
    return ffi::Error::Success();
  });
}

template <bool kLog>
ffi::Error SoftmaxBwd(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx) {
  const std::string op = kLog ? "jaxops_log_softmax_bwd" : "jaxops_softmax_bwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "y", y, &s));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "y", y, "dy", dy));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "y", y, "dy", dy));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "y", y, "dx", *dx));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "y", y, "dx", *dx));
  return dispatch(op, y.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kLog) {
      cpu::log_softmax_bwd<T>(data<const T>(dy), data<const T>(y), data<T>(*dx), {s.rows, s.cols});
    } else {
      cpu::softmax_bwd<T>(data<const T>(dy), data<const T>(y), data<T>(*dx), {s.rows, s.cols});
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSoftmaxFwd, SoftmaxFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // where (bool; [0]: absent)
                                  .Arg<ffi::AnyBuffer>()  // bias ([0]: absent)
                                  .Ret<ffi::AnyBuffer>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLogSoftmaxFwd, LogSoftmaxFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // where (bool; [0]: absent)
                                  .Arg<ffi::AnyBuffer>()  // bias ([0]: absent)
                                  .Ret<ffi::AnyBuffer>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCausalSoftmaxFwd, CausalSoftmaxFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("query_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSoftmaxBwd, SoftmaxBwd<false>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>());  // dx

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLogSoftmaxBwd, SoftmaxBwd<true>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // y (log-probabilities)
                                  .Ret<ffi::AnyBuffer>());  // dx

JAXOPS_REGISTER_FFI_TARGET("jaxops_softmax_fwd", kSoftmaxFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_log_softmax_fwd", kLogSoftmaxFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_causal_softmax_fwd", kCausalSoftmaxFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_softmax_bwd", kSoftmaxBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_log_softmax_bwd", kLogSoftmaxBwd);

}  // namespace jaxops
