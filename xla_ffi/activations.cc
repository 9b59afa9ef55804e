// CPU FFI handlers of the activations: validate (xla_ffi/activations_common.h),
// then call cpu/activations.
#include <string>

#include "cpu/activations.h"
#include "cpu/float_convert.h"
#include "xla_ffi/activations_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace activations_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error UnaryFwd(const std::string& op, Activation activation, const ffi::AnyBuffer& x,
                    ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_unary_fwd(op, x, y));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::activation_fwd<T>(activation, data<const T>(x), data<T>(y), x.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error UnaryBwd(const std::string& op, Activation activation, const ffi::AnyBuffer& dy,
                    const ffi::AnyBuffer& x, ffi::AnyBuffer& dx) {
  JAXOPS_RETURN_IF_ERROR(check_unary_bwd(op, dy, x, dx));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::activation_bwd<T>(activation, data<const T>(dy), data<const T>(x), data<T>(dx),
                           x.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error GatedFwd(const std::string& op, Activation activation, const ffi::AnyBuffer& gate,
                    const ffi::AnyBuffer& up, ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_gated_fwd(op, gate, up, y));
  return dispatch(op, gate.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::gated_activation_fwd<T>(activation, data<const T>(gate), data<const T>(up), data<T>(y),
                                 gate.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error GatedBwd(const std::string& op, Activation activation, const ffi::AnyBuffer& dy,
                    const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up, ffi::AnyBuffer& dgate,
                    ffi::AnyBuffer& dup) {
  JAXOPS_RETURN_IF_ERROR(check_gated_bwd(op, dy, gate, up, dgate, dup));
  return dispatch(op, gate.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::gated_activation_bwd<T>(activation, data<const T>(dy), data<const T>(gate),
                                 data<const T>(up), data<T>(dgate), data<T>(dup),
                                 gate.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error GeluFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, bool approximate) {
  return UnaryFwd("jaxops_gelu_fwd", gelu_activation(approximate), x, *y);
}

ffi::Error GeluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx,
                   bool approximate) {
  return UnaryBwd("jaxops_gelu_bwd", gelu_activation(approximate), dy, x, *dx);
}

ffi::Error SiluFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return UnaryFwd("jaxops_silu_fwd", Activation::kSilu, x, *y);
}

ffi::Error SiluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx) {
  return UnaryBwd("jaxops_silu_bwd", Activation::kSilu, dy, x, *dx);
}

ffi::Error SwigluFwd(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> y) {
  return GatedFwd("jaxops_swiglu_fwd", Activation::kSilu, gate, up, *y);
}

ffi::Error SwigluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                     ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup) {
  return GatedBwd("jaxops_swiglu_bwd", Activation::kSilu, dy, gate, up, *dgate, *dup);
}

ffi::Error GegluFwd(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> y,
                    bool approximate) {
  return GatedFwd("jaxops_geglu_fwd", gelu_activation(approximate), gate, up, *y);
}

ffi::Error GegluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                    ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup,
                    bool approximate) {
  return GatedBwd("jaxops_geglu_bwd", gelu_activation(approximate), dy, gate, up, *dgate, *dup);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGeluFwd, GeluFwd, bind_gelu_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGeluBwd, GeluBwd, bind_gelu_bwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSiluFwd, SiluFwd, bind_unary_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSiluBwd, SiluBwd, bind_unary_bwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSwigluFwd, SwigluFwd, bind_gated_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSwigluBwd, SwigluBwd, bind_gated_bwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGegluFwd, GegluFwd, bind_geglu_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGegluBwd, GegluBwd, bind_geglu_bwd(ffi::Ffi::Bind()));

JAXOPS_REGISTER_FFI_TARGET("jaxops_gelu_fwd", kGeluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_gelu_bwd", kGeluBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_silu_fwd", kSiluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_silu_bwd", kSiluBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_swiglu_fwd", kSwigluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_swiglu_bwd", kSwigluBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_geglu_fwd", kGegluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_geglu_bwd", kGegluBwd);

}  // namespace jaxops
