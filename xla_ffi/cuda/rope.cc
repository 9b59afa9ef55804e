// CUDA FFI handler of rotary position embedding: the CPU handler's target,
// binding and validation (xla_ffi/rope_common.h), then a launch of cuda/rope on
// the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/rope.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/rope_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace rope_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error Rope(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions,
                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                double theta, int64_t rotary_dim, bool interleaved, bool inverse) {
  const std::string op = kRope.name;
  RopeShape d;
  JAXOPS_RETURN_IF_ERROR(check_rope(x, positions, *y, *workspace, theta, rotary_dim, &d));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::rope<T>(stream, data<const T>(x), positions.typed_data(),
                                           data<T>(*y), workspace->typed_data(), d, theta,
                                           interleaved, inverse));
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kRope, kRopeCuda, Rope, bind_rope(cuda_binding()));

}  // namespace jaxops
