// What the CPU and CUDA handlers of the fused AdamW step share: the validation
// of every buffer and the FFI binding (`prefix`: nothing for the CPU, the
// stream for CUDA). grads, params and out share a shape and dtype; m, v and
// their outputs are float32 of that shape; scalars = {lr, 1 - b1^t, 1 - b2^t}.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "params/adamw.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::adamw_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::AdamWHyperparameters;

// -- the targets' contract ------------------------------------------------------------

inline constexpr auto kAdamW = contract::target(
    "jaxops_adamw", contract::Attribute<float>{"b1"}, contract::Attribute<float>{"one_minus_b1"},
    contract::Attribute<float>{"b2"}, contract::Attribute<float>{"one_minus_b2"},
    contract::Attribute<float>{"eps"}, contract::Attribute<float>{"weight_decay"},
    contract::Attribute<bool>{"apply_updates"});  // out: the new params, else the update

inline std::vector<contract::TargetDescription> contracts() { return {describe(kAdamW)}; }

// The buffers, and the attributes gathered into the kernel's hyperparameters.
inline ffi::Error check_adamw(const ffi::AnyBuffer& grads, const ffi::AnyBuffer& params,
                              const ffi::Buffer<ffi::F32>& m, const ffi::Buffer<ffi::F32>& v,
                              const ffi::Buffer<ffi::F32>& scalars, const ffi::AnyBuffer& out,
                              const ffi::Buffer<ffi::F32>& m_out,
                              const ffi::Buffer<ffi::F32>& v_out, float b1, float one_minus_b1,
                              float b2, float one_minus_b2, float eps, float weight_decay,
                              AdamWHyperparameters* hyper) {
  const std::string op = kAdamW.name;
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "grads", grads));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "params", params, "grads", grads));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "out", out));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "params", params, "out", out));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "m", m));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "v", v));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "m_out", m_out));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "v_out", v_out));
  JAXOPS_RETURN_IF_ERROR(element_count_is(op, "scalars", scalars, 3));
  *hyper = {b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay};
  return ffi::Error::Success();
}

template <typename Binding>
auto bind_adamw(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // grads
      .template Arg<ffi::AnyBuffer>()                      // params
      .template Arg<ffi::Buffer<ffi::F32>>()               // m
      .template Arg<ffi::Buffer<ffi::F32>>()               // v
      .template Arg<ffi::Buffer<ffi::F32>>()               // scalars {lr, 1 - b1^t, 1 - b2^t}
      .template Ret<ffi::AnyBuffer>()                      // out: the update or the new params
      .template Ret<ffi::Buffer<ffi::F32>>()               // m_out
      .template Ret<ffi::Buffer<ffi::F32>>();              // v_out
}

}  // namespace jaxops::adamw_common
