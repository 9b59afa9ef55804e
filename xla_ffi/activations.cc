// CPU FFI handlers of the activations: validate (xla_ffi/activations_common.h),
// then call cpu/activations.
#include <string>

#include "cpu/activations.h"
#include "cpu/float_convert.h"
#include "xla_ffi/activations_common.h"

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
  return UnaryFwd(kGeluFwd.name, gelu_activation(approximate), x, *y);
}

ffi::Error GeluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx,
                   bool approximate) {
  return UnaryBwd(kGeluBwd.name, gelu_activation(approximate), dy, x, *dx);
}

ffi::Error SiluFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return UnaryFwd(kSiluFwd.name, Activation::kSilu, x, *y);
}

ffi::Error SiluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx) {
  return UnaryBwd(kSiluBwd.name, Activation::kSilu, dy, x, *dx);
}

ffi::Error SwigluFwd(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> y) {
  return GatedFwd(kSwigluFwd.name, Activation::kSilu, gate, up, *y);
}

ffi::Error SwigluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                     ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup) {
  return GatedBwd(kSwigluBwd.name, Activation::kSilu, dy, gate, up, *dgate, *dup);
}

ffi::Error GegluFwd(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> y,
                    bool approximate) {
  return GatedFwd(kGegluFwd.name, gelu_activation(approximate), gate, up, *y);
}

ffi::Error GegluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                    ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup,
                    bool approximate) {
  return GatedBwd(kGegluBwd.name, gelu_activation(approximate), dy, gate, up, *dgate, *dup);
}

}  // namespace

JAXOPS_FFI_TARGET(kGeluFwd, kGeluFwdCpu, GeluFwd, bind_unary_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kGeluBwd, kGeluBwdCpu, GeluBwd, bind_unary_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSiluFwd, kSiluFwdCpu, SiluFwd, bind_unary_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSiluBwd, kSiluBwdCpu, SiluBwd, bind_unary_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSwigluFwd, kSwigluFwdCpu, SwigluFwd, bind_gated_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSwigluBwd, kSwigluBwdCpu, SwigluBwd, bind_gated_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kGegluFwd, kGegluFwdCpu, GegluFwd, bind_gated_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kGegluBwd, kGegluBwdCpu, GegluBwd, bind_gated_bwd(ffi::Ffi::Bind()));

}  // namespace jaxops
