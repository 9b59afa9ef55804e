// CUDA FFI handlers of the activations: the CPU handlers' targets, bindings and
// validation (xla_ffi/activations_common.h), then a launch of cuda/activations
// on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/activations.h"
#include "xla_ffi/activations_common.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace activations_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::launch_status;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, __nv_bfloat16, __half>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error UnaryFwd(cudaStream_t stream, const std::string& op, Activation activation,
                    const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_unary_fwd(op, x, y));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::activation_fwd<T>(stream, activation, data<const T>(x),
                                                     data<T>(y), x.element_count()));
  });
}

ffi::Error UnaryBwd(cudaStream_t stream, const std::string& op, Activation activation,
                    const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, ffi::AnyBuffer& dx) {
  JAXOPS_RETURN_IF_ERROR(check_unary_bwd(op, dy, x, dx));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::activation_bwd<T>(stream, activation, data<const T>(dy),
                                                     data<const T>(x), data<T>(dx),
                                                     x.element_count()));
  });
}

ffi::Error GatedFwd(cudaStream_t stream, const std::string& op, Activation activation,
                    const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up, ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_gated_fwd(op, gate, up, y));
  return dispatch(op, gate.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::gated_activation_fwd<T>(stream, activation,
                                                           data<const T>(gate), data<const T>(up),
                                                           data<T>(y), gate.element_count()));
  });
}

ffi::Error GatedBwd(cudaStream_t stream, const std::string& op, Activation activation,
                    const ffi::AnyBuffer& dy, const ffi::AnyBuffer& gate,
                    const ffi::AnyBuffer& up, ffi::AnyBuffer& dgate, ffi::AnyBuffer& dup) {
  JAXOPS_RETURN_IF_ERROR(check_gated_bwd(op, dy, gate, up, dgate, dup));
  return dispatch(op, gate.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::gated_activation_bwd<T>(stream, activation, data<const T>(dy),
                                          data<const T>(gate), data<const T>(up),
                                          data<T>(dgate), data<T>(dup), gate.element_count()));
  });
}

ffi::Error GeluFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                   bool approximate) {
  return UnaryFwd(stream, "jaxops_gelu_fwd", gelu_activation(approximate), x, *y);
}

ffi::Error GeluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> dx, bool approximate) {
  return UnaryBwd(stream, "jaxops_gelu_bwd", gelu_activation(approximate), dy, x, *dx);
}

ffi::Error SiluFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return UnaryFwd(stream, "jaxops_silu_fwd", Activation::kSilu, x, *y);
}

ffi::Error SiluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> dx) {
  return UnaryBwd(stream, "jaxops_silu_bwd", Activation::kSilu, dy, x, *dx);
}

ffi::Error SwigluFwd(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                     ffi::Result<ffi::AnyBuffer> y) {
  return GatedFwd(stream, "jaxops_swiglu_fwd", Activation::kSilu, gate, up, *y);
}

ffi::Error SwigluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer gate,
                     ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> dgate,
                     ffi::Result<ffi::AnyBuffer> dup) {
  return GatedBwd(stream, "jaxops_swiglu_bwd", Activation::kSilu, dy, gate, up, *dgate, *dup);
}

ffi::Error GegluFwd(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                    ffi::Result<ffi::AnyBuffer> y, bool approximate) {
  return GatedFwd(stream, "jaxops_geglu_fwd", gelu_activation(approximate), gate, up, *y);
}

ffi::Error GegluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer gate,
                    ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> dgate,
                    ffi::Result<ffi::AnyBuffer> dup, bool approximate) {
  return GatedBwd(stream, "jaxops_geglu_bwd", gelu_activation(approximate), dy, gate, up, *dgate,
                  *dup);
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGeluFwdCuda, GeluFwd, bind_gelu_fwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGeluBwdCuda, GeluBwd, bind_gelu_bwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSiluFwdCuda, SiluFwd, bind_unary_fwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSiluBwdCuda, SiluBwd, bind_unary_bwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSwigluFwdCuda, SwigluFwd, bind_gated_fwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSwigluBwdCuda, SwigluBwd, bind_gated_bwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGegluFwdCuda, GegluFwd, bind_geglu_fwd(cuda_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGegluBwdCuda, GegluBwd, bind_geglu_bwd(cuda_binding()));

JAXOPS_REGISTER_FFI_TARGET("jaxops_gelu_fwd", kGeluFwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_gelu_bwd", kGeluBwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_silu_fwd", kSiluFwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_silu_bwd", kSiluBwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_swiglu_fwd", kSwigluFwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_swiglu_bwd", kSwigluBwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_geglu_fwd", kGegluFwdCuda);
JAXOPS_REGISTER_FFI_TARGET("jaxops_geglu_bwd", kGegluBwdCuda);

}  // namespace jaxops
