// CPU FFI handlers of the router: validate (xla_ffi/routing_common.h), then
// call cpu/routing.
#include "cpu/float_convert.h"
#include "cpu/routing.h"
#include "xla_ffi/routing_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace routing_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error TopkRouterFwd(ffi::AnyBuffer logits, ffi::AnyBuffer expert_bias,
                         ffi::Result<ffi::AnyBuffer> weights, ffi::Result<ffi::AnyBuffer> experts,
                         int64_t k, int64_t score, bool renormalize, int64_t num_groups,
                         int64_t group_topk) {
  RouterShape s;
  JAXOPS_RETURN_IF_ERROR(check_topk_router_fwd(logits, expert_bias, *weights, *experts, k, score,
                                               renormalize, num_groups, group_topk, &s));
  return dispatch(kTopkRouterFwd.name, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::topk_router_fwd<T>(data<const T>(logits), data_or_null<const float>(expert_bias),
                            data<float>(*weights), data<int32_t>(*experts), s);
    return ffi::Error::Success();
  });
}

ffi::Error TopkRouterJvp(ffi::AnyBuffer logits, ffi::AnyBuffer experts, ffi::AnyBuffer dlogits,
                         ffi::Result<ffi::AnyBuffer> dweights, int64_t score, bool renormalize) {
  RouterShape s;
  JAXOPS_RETURN_IF_ERROR(
      check_topk_router_derivative(kTopkRouterJvp.name, logits, experts, dlogits,
                                   *dweights, score, renormalize, &s));
  return dispatch(kTopkRouterJvp.name, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::topk_router_jvp<T>(data<const T>(logits), data<const int32_t>(experts),
                            data<const T>(dlogits), data<float>(*dweights), s);
    return ffi::Error::Success();
  });
}

ffi::Error TopkRouterBwd(ffi::AnyBuffer dweights, ffi::AnyBuffer logits, ffi::AnyBuffer experts,
                         ffi::Result<ffi::AnyBuffer> dlogits, int64_t score, bool renormalize) {
  RouterShape s;
  JAXOPS_RETURN_IF_ERROR(
      check_topk_router_derivative(kTopkRouterBwd.name, logits, experts, *dlogits,
                                   dweights, score, renormalize, &s));
  return dispatch(kTopkRouterBwd.name, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::topk_router_bwd<T>(data<const float>(dweights), data<const T>(logits),
                            data<const int32_t>(experts), data<T>(*dlogits), s);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kTopkRouterFwd, kTopkRouterFwdCpu, TopkRouterFwd,
                  bind_topk_router_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kTopkRouterJvp, kTopkRouterJvpCpu, TopkRouterJvp,
                  bind_topk_router_jvp(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kTopkRouterBwd, kTopkRouterBwdCpu, TopkRouterBwd,
                  bind_topk_router_bwd(ffi::Ffi::Bind()));

}  // namespace jaxops
