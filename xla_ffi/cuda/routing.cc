// CUDA FFI handlers of the router: the CPU handlers' targets, bindings and
// validation (xla_ffi/routing_common.h), then a launch of cuda/routing on the
// stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/routing.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/routing_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace routing_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error TopkRouterFwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer expert_bias,
                         ffi::Result<ffi::AnyBuffer> weights, ffi::Result<ffi::AnyBuffer> experts,
                         int64_t k, int64_t score, bool renormalize, int64_t num_groups,
                         int64_t group_topk) {
  const std::string op = kTopkRouterFwd.name;
  RouterShape s;
  JAXOPS_RETURN_IF_ERROR(check_topk_router_fwd(logits, expert_bias, *weights, *experts, k, score,
                                               renormalize, num_groups, group_topk, &s));
  return dispatch(op, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::topk_router_fwd<T>(
                                 stream, data<const T>(logits),
                                 data_or_null<const float>(expert_bias), data<float>(*weights),
                                 data<int32_t>(*experts), s));
  });
}

ffi::Error TopkRouterJvp(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer experts,
                         ffi::AnyBuffer dlogits, ffi::Result<ffi::AnyBuffer> dweights,
                         int64_t score, bool renormalize) {
  const std::string op = kTopkRouterJvp.name;
  RouterShape s;
  JAXOPS_RETURN_IF_ERROR(
      check_topk_router_derivative(kTopkRouterJvp.name, logits, experts, dlogits,
                                   *dweights, score, renormalize, &s));
  return dispatch(op, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::topk_router_jvp<T>(stream, data<const T>(logits),
                                                      data<const int32_t>(experts),
                                                      data<const T>(dlogits),
                                                      data<float>(*dweights), s));
  });
}

ffi::Error TopkRouterBwd(cudaStream_t stream, ffi::AnyBuffer dweights, ffi::AnyBuffer logits,
                         ffi::AnyBuffer experts, ffi::Result<ffi::AnyBuffer> dlogits,
                         int64_t score, bool renormalize) {
  const std::string op = kTopkRouterBwd.name;
  RouterShape s;
  JAXOPS_RETURN_IF_ERROR(
      check_topk_router_derivative(kTopkRouterBwd.name, logits, experts, *dlogits,
                                   dweights, score, renormalize, &s));
  return dispatch(op, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::topk_router_bwd<T>(stream, data<const float>(dweights),
                                                      data<const T>(logits),
                                                      data<const int32_t>(experts),
                                                      data<T>(*dlogits), s));
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kTopkRouterFwd, kTopkRouterFwdCuda, TopkRouterFwd,
                  bind_topk_router_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kTopkRouterJvp, kTopkRouterJvpCuda, TopkRouterJvp,
                  bind_topk_router_jvp(cuda_binding()));
JAXOPS_FFI_TARGET(kTopkRouterBwd, kTopkRouterBwdCuda, TopkRouterBwd,
                  bind_topk_router_bwd(cuda_binding()));

}  // namespace jaxops
