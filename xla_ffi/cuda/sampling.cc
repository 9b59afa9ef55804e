// CUDA FFI handler of sampling: the CPU handler's target, binding and
// validation (xla_ffi/sampling_common.h), then a launch of cuda/sampling on
// the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/sampling.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/sampling_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace sampling_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error Sample(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> row_floats,
                  ffi::Buffer<ffi::S32> top_k, ffi::Result<ffi::Buffer<ffi::S32>> tokens) {
  const std::string op = kSample.name;
  SampleShape s;
  JAXOPS_RETURN_IF_ERROR(check_sample(logits, row_floats, top_k, *tokens, &s));
  return dispatch(op, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::sample<T>(stream, data<const T>(logits),
                                             row_floats.typed_data(), top_k.typed_data(),
                                             tokens->typed_data(), s));
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kSample, kSampleCuda, Sample, bind_sample(cuda_binding()));

}  // namespace jaxops
