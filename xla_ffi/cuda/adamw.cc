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
#include "xla_ffi/cuda/cuda_status.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace adamw_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::launch_status;

ffi::Error AdamW(cudaStream_t stream, ffi::AnyBuffer grads, ffi::AnyBuffer params,
                 ffi::AnyBuffer m, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> scalars,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> m_out,
                 ffi::Result<ffi::Buffer<ffi::F32>> v_out, bool apply_updates, bool nesterov,
                 bool decay) {
  const std::string op = kAdamW.name;
  JAXOPS_RETURN_IF_ERROR(check_adamw(grads, params, m, v, scalars, *out, *m_out, *v_out));
  return dispatch_adamw<float, __nv_bfloat16, __half>(
      op, params.element_type(), m.element_type(), [&](auto t_tag, auto m_tag) {
        using T = decltype(t_tag);
        using M = decltype(m_tag);
        return launch_status(
            op, cuda::adamw<T, M>(stream, data<const T>(grads), data<const T>(params),
                                  data<const M>(m), v.typed_data(), scalars.typed_data(),
                                  data<T>(*out), data<M>(*m_out), v_out->typed_data(),
                                  params.element_count(),
                                  AdamWOptions{apply_updates, nesterov, decay}));
      });
}

}  // namespace

JAXOPS_FFI_TARGET(kAdamW, kAdamWCuda, AdamW, bind_adamw(cuda_binding()));

}  // namespace jaxops
