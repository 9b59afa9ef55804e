// CUDA FFI handlers of the 2:4 sparse linear layer: the CPU handlers' targets,
// bindings and validation (xla_ffi/sparse_common.h), then launches of
// cuda/sparse on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/sparse.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/sparse_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace sparse_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error SparseLinearFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                           ffi::Buffer<ffi::U8> metadata, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y,
                           bool /*allow_tf32: float32 stays on the CUDA cores, in full float32*/) {
  const std::string op = kSparseLinearFwd.name;
  SparseLinearShape s;
  JAXOPS_RETURN_IF_ERROR(check_sparse_linear_fwd(x, values, metadata, bias, *y, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::sparse_linear_fwd<T>(
                                 stream, data<const T>(x), data<const T>(values),
                                 metadata.typed_data(), data_or_null<const T>(bias), data<T>(*y), s));
  });
}

ffi::Error SparseLinearDx(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer values,
                          ffi::Buffer<ffi::U8> metadata, ffi::Result<ffi::AnyBuffer> dx,
                          bool /*allow_tf32: the kernel computes in full float32*/) {
  const std::string op = kSparseLinearDx.name;
  SparseLinearShape s;
  JAXOPS_RETURN_IF_ERROR(check_sparse_linear_dx(dy, values, metadata, *dx, &s));
  return dispatch(op, dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::sparse_linear_dx<T>(stream, data<const T>(dy),
                                                       data<const T>(values),
                                                       metadata.typed_data(), data<T>(*dx), s));
  });
}

ffi::Error SparseLinearDvalues(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::U8> metadata, ffi::Result<ffi::AnyBuffer> dvalues,
                               bool /*allow_tf32: the kernel computes in full float32*/) {
  const std::string op = kSparseLinearDvalues.name;
  SparseLinearShape s;
  JAXOPS_RETURN_IF_ERROR(check_sparse_linear_dvalues(dy, x, metadata, *dvalues, &s));
  return dispatch(op, dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::sparse_linear_dvalues<T>(stream, data<const T>(dy),
                                                            data<const T>(x), metadata.typed_data(),
                                                            data<T>(*dvalues), s));
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kSparseLinearFwd, kSparseLinearFwdCuda, SparseLinearFwd,
                  bind_sparse_linear_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kSparseLinearDx, kSparseLinearDxCuda, SparseLinearDx,
                  bind_sparse_linear_dx(cuda_binding()));
JAXOPS_FFI_TARGET(kSparseLinearDvalues, kSparseLinearDvaluesCuda, SparseLinearDvalues,
                  bind_sparse_linear_dvalues(cuda_binding()));

}  // namespace jaxops
