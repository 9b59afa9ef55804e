// What the CPU and CUDA handlers of the fused AdamW step share: the validation
// of every buffer and the FFI binding (`prefix`: nothing for the CPU, the
// stream for CUDA). grads, params and out share a shape and dtype; m and m_out
// (float32, bfloat16 or float16) and v, v_out (float32) that shape; scalars holds every
// hyper-parameter (layout: params/adamw.h), an operand so that traced ones do
// not recompile.
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
using ::jaxops::params::AdamWOptions;

// -- the targets' contract ------------------------------------------------------------

inline constexpr auto kAdamW = contract::target(
    "jaxops_adamw",
    contract::Attribute<bool>{"apply_updates"},  // out: the new params, else the update
    contract::Attribute<bool>{"nesterov"},       // NAdamW's first moment estimate
    contract::Attribute<bool>{"decay"});         // add weight_decay * params

inline std::vector<contract::TargetDescription> contracts() { return {describe(kAdamW)}; }

// The buffers.
inline ffi::Error check_adamw(const ffi::AnyBuffer& grads, const ffi::AnyBuffer& params,
                              const ffi::AnyBuffer& m, const ffi::Buffer<ffi::F32>& v,
                              const ffi::Buffer<ffi::F32>& scalars, const ffi::AnyBuffer& out,
                              const ffi::AnyBuffer& m_out, const ffi::Buffer<ffi::F32>& v_out) {
  const std::string op = kAdamW.name;
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "grads", grads));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "params", params, "grads", grads));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "out", out));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "params", params, "out", out));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "m", m));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "v", v));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "m_out", m_out));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "m", m, "m_out", m_out));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "params", params, "v_out", v_out));
  if (m.element_type() != ffi::DataType::F32 && m.element_type() != ffi::DataType::BF16 &&
      m.element_type() != ffi::DataType::F16) {
    return invalid(op, "m must be float32, bfloat16 or float16");
  }
  return element_count_is(op, "scalars", scalars, params::kAdamWScalarCount);
}

// Calls fn(T{}, M{}) with the parameter type and the first moment's (each
// Float32, BFloat16 or Float16 for float32, bfloat16, float16).
template <typename Float32, typename BFloat16, typename Float16, typename Fn>
ffi::Error dispatch_adamw(const std::string& op, ffi::DataType params, ffi::DataType m, Fn&& fn) {
  return dispatch_float<Float32, BFloat16, Float16>(op, params, [&](auto t) {
    if (m == ffi::DataType::BF16) return fn(t, BFloat16{});
    if (m == ffi::DataType::F16) return fn(t, Float16{});
    return fn(t, Float32{});
  });
}

template <typename Binding>
auto bind_adamw(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // grads
      .template Arg<ffi::AnyBuffer>()                      // params
      .template Arg<ffi::AnyBuffer>()                      // m (float32, bfloat16 or float16)
      .template Arg<ffi::Buffer<ffi::F32>>()               // v
      .template Arg<ffi::Buffer<ffi::F32>>()               // scalars (params/adamw.h)
      .template Ret<ffi::AnyBuffer>()                      // out: the update or the new params
      .template Ret<ffi::AnyBuffer>()                      // m_out
      .template Ret<ffi::Buffer<ffi::F32>>();              // v_out
}

}  // namespace jaxops::adamw_common
