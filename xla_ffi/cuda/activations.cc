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
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace activations_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

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
  return UnaryFwd(stream, kGeluFwd.name, gelu_activation(approximate), x, *y);
}

ffi::Error GeluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> dx, bool approximate) {
  return UnaryBwd(stream, kGeluBwd.name, gelu_activation(approximate), dy, x, *dx);
}

ffi::Error SiluFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return UnaryFwd(stream, kSiluFwd.name, Activation::kSilu, x, *y);
}

ffi::Error SiluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> dx) {
  return UnaryBwd(stream, kSiluBwd.name, Activation::kSilu, dy, x, *dx);
}

ffi::Error SwigluFwd(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                     ffi::Result<ffi::AnyBuffer> y) {
  return GatedFwd(stream, kSwigluFwd.name, Activation::kSilu, gate, up, *y);
}

ffi::Error SwigluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer gate,
                     ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> dgate,
                     ffi::Result<ffi::AnyBuffer> dup) {
  return GatedBwd(stream, kSwigluBwd.name, Activation::kSilu, dy, gate, up, *dgate, *dup);
}

ffi::Error GegluFwd(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                    ffi::Result<ffi::AnyBuffer> y, bool approximate) {
  return GatedFwd(stream, kGegluFwd.name, gelu_activation(approximate), gate, up, *y);
}

ffi::Error GegluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer gate,
                    ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> dgate,
                    ffi::Result<ffi::AnyBuffer> dup, bool approximate) {
  return GatedBwd(stream, kGegluBwd.name, gelu_activation(approximate), dy, gate, up, *dgate,
                  *dup);
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
JAXOPS_FFI_TARGET(kGeluFwd, kGeluFwdCuda, GeluFwd, bind_unary_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kGeluBwd, kGeluBwdCuda, GeluBwd, bind_unary_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSiluFwd, kSiluFwdCuda, SiluFwd, bind_unary_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSiluBwd, kSiluBwdCuda, SiluBwd, bind_unary_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSwigluFwd, kSwigluFwdCuda, SwigluFwd, bind_gated_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSwigluBwd, kSwigluBwdCuda, SwigluBwd, bind_gated_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kGegluFwd, kGegluFwdCuda, GegluFwd, bind_gated_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kGegluBwd, kGegluBwdCuda, GegluBwd, bind_gated_bwd(cuda_binding()));

}  // namespace jaxops
