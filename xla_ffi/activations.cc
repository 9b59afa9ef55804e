// CPU FFI handlers of the activations: decode and validate, then call
// cpu/activations. Every buffer of an elementwise op has the shape and dtype of
// the first operand; the kernels see them flat.
#include <string>

#include "cpu/activations.h"
#include "cpu/float_convert.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using cpu::Activation;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

// `other` has the shape and dtype of `first`.
ffi::Error check_like(const std::string& op, const char* first_name, const ffi::AnyBuffer& first,
                      const char* name, const ffi::AnyBuffer& other) {
  JAXOPS_RETURN_IF_ERROR(same_dims(op, first_name, first, name, other));
  return same_dtype(op, first_name, first, name, other);
}

Activation gelu_kind(bool approximate) {
  return approximate ? Activation::kGeluTanh : Activation::kGeluErf;
}

ffi::Error UnaryFwd(const std::string& op, Activation activation, ffi::AnyBuffer x,
                    ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "x", x, "y", y));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::activation_fwd<T>(activation, data<const T>(x), data<T>(y), x.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error UnaryBwd(const std::string& op, Activation activation, ffi::AnyBuffer dy,
                    ffi::AnyBuffer x, ffi::AnyBuffer& dx) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "x", x, "dy", dy));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "x", x, "dx", dx));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::activation_bwd<T>(activation, data<const T>(dy), data<const T>(x), data<T>(dx),
                           x.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error GatedFwd(const std::string& op, Activation activation, ffi::AnyBuffer gate,
                    ffi::AnyBuffer up, ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "up", up));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "y", y));
  return dispatch(op, gate.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::gated_activation_fwd<T>(activation, data<const T>(gate), data<const T>(up), data<T>(y),
                                 gate.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error GatedBwd(const std::string& op, Activation activation, ffi::AnyBuffer dy,
                    ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer& dgate,
                    ffi::AnyBuffer& dup) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "dy", dy));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "up", up));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "dgate", dgate));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "dup", dup));
  return dispatch(op, gate.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::gated_activation_bwd<T>(activation, data<const T>(dy), data<const T>(gate),
                                 data<const T>(up), data<T>(dgate), data<T>(dup),
                                 gate.element_count());
    return ffi::Error::Success();
  });
}

ffi::Error GeluFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, bool approximate) {
  return UnaryFwd("jaxops_gelu_fwd", gelu_kind(approximate), x, *y);
}

ffi::Error GeluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx,
                   bool approximate) {
  return UnaryBwd("jaxops_gelu_bwd", gelu_kind(approximate), dy, x, *dx);
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
  return GatedFwd("jaxops_geglu_fwd", gelu_kind(approximate), gate, up, *y);
}

ffi::Error GegluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                    ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup,
                    bool approximate) {
  return GatedBwd("jaxops_geglu_bwd", gelu_kind(approximate), dy, gate, up, *dgate, *dup);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGeluFwd, GeluFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<bool>("approximate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGeluBwd, GeluBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<bool>("approximate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSiluFwd, SiluFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSiluBwd, SiluBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>());  // dx

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSwigluFwd, SwigluFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Ret<ffi::AnyBuffer>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSwigluBwd, SwigluBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Ret<ffi::AnyBuffer>()  // dgate
                                  .Ret<ffi::AnyBuffer>());  // dup

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGegluFwd, GegluFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<bool>("approximate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGegluBwd, GegluBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Ret<ffi::AnyBuffer>()  // dgate
                                  .Ret<ffi::AnyBuffer>()  // dup
                                  .Attr<bool>("approximate"));

JAXOPS_REGISTER_FFI_TARGET("jaxops_gelu_fwd", kGeluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_gelu_bwd", kGeluBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_silu_fwd", kSiluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_silu_bwd", kSiluBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_swiglu_fwd", kSwigluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_swiglu_bwd", kSwigluBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_geglu_fwd", kGegluFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_geglu_bwd", kGegluBwd);

}  // namespace jaxops
