// CUDA FFI handler of the fused AdamW step on one parameter leaf: the CPU
// handler's target, binding and validation (xla_ffi/adamw_common.h), then a
// launch of cuda/adamw on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/adamw.h"
#include "xla_ffi/adamw_common.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace adamw_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error AdamW(cudaStream_t stream, ffi::AnyBuffer grads, ffi::AnyBuffer params,
                 ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> scalars,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> m_out,
                 ffi::Result<ffi::Buffer<ffi::F32>> v_out, float b1, float one_minus_b1,
                 float b2, float one_minus_b2, float eps, float weight_decay,
                 bool apply_updates) {
  const std::string op = kAdamW.name;
  AdamWHyperparameters hyper;
  JAXOPS_RETURN_IF_ERROR(check_adamw(grads, params, m, v, scalars, *out, *m_out, *v_out, b1,
                                     one_minus_b1, b2, one_minus_b2, eps, weight_decay, &hyper));
  return dispatch(
      op, params.element_type(), [&](auto tag) {
        using T = decltype(tag);
        return launch_status(
            op, cuda::adamw<T>(stream, data<const T>(grads), data<const T>(params),
                               m.typed_data(), v.typed_data(), scalars.typed_data(),
                               data<T>(*out), m_out->typed_data(), v_out->typed_data(),
                               params.element_count(), hyper, apply_updates));
      });
}

}  // namespace

JAXOPS_FFI_TARGET(kAdamW, kAdamWCuda, AdamW, bind_adamw(cuda_binding()));

}  // namespace jaxops
