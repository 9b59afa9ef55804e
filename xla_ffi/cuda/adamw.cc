// CUDA FFI handler of the fused AdamW step over every leaf of a model: the CPU
// handler's target, binding and validation (xla_ffi/adamw_common.h), then
// cuda/adamw's launch (one per kAdamWLeavesPerLaunch leaves) on the stream
// XLA hands over.
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "cuda/adamw.h"
#include "xla_ffi/adamw_common.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_status.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace adamw_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::launch_status;

ffi::Error AdamW(cudaStream_t stream, ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                 ffi::RemainingRets rets, bool apply_updates, bool nesterov,
                 int64_t decayed_leaves) {
  std::vector<AdamWLeaf> leaves;
  JAXOPS_RETURN_IF_ERROR(collect_leaves(scalars, args, rets, decayed_leaves, &leaves));
  return launch_status(kAdamW.name,
                       cuda::adamw(stream, leaves.data(), static_cast<int64_t>(leaves.size()),
                                   scalars.typed_data(), AdamWOptions{apply_updates, nesterov}));
}

}  // namespace

JAXOPS_FFI_TARGET(kAdamW, kAdamWCuda, AdamW, bind_adamw(cuda_binding()));

}  // namespace jaxops
