// CPU FFI handler of the fused AdamW step on one parameter leaf: decode and
// validate, then call cpu/adamw. grads, params and out share a shape and dtype;
// m, v and their outputs are float32 of that shape; scalars = {lr, 1 - b1^t,
// 1 - b2^t}.
#include <string>

#include "cpu/adamw.h"
#include "cpu/float_convert.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;

template <typename A, typename B>
ffi::Error check_like(const std::string& op, const char* a_name, const A& a, const char* b_name,
                      const B& b, bool same_type) {
  JAXOPS_RETURN_IF_ERROR(same_dims(op, a_name, a, b_name, b));
  return same_type ? same_dtype(op, a_name, a, b_name, b) : ffi::Error::Success();
}

ffi::Error AdamW(ffi::AnyBuffer grads, ffi::AnyBuffer params, ffi::Buffer<ffi::F32> m,
                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> scalars,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> m_out,
                 ffi::Result<ffi::Buffer<ffi::F32>> v_out, float b1, float one_minus_b1,
                 float b2, float one_minus_b2, float eps, float weight_decay,
                 bool apply_updates) {
  const std::string op = "jaxops_adamw";
  JAXOPS_RETURN_IF_ERROR(check_like(op, "params", params, "grads", grads, true));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "params", params, "out", *out, true));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "params", params, "m", m, false));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "params", params, "v", v, false));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "params", params, "m_out", *m_out, false));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "params", params, "v_out", *v_out, false));
  JAXOPS_RETURN_IF_ERROR(element_count_is(op, "scalars", scalars, 3));
  const cpu::AdamWHyperparameters hyper{b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay};
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(
      op, params.element_type(), [&](auto tag) {
        using T = decltype(tag);
        cpu::adamw<T>(data<const T>(grads), data<const T>(params), m.typed_data(),
                      v.typed_data(), scalars.typed_data(), data<T>(*out), m_out->typed_data(),
                      v_out->typed_data(), params.element_count(), hyper, apply_updates);
        return ffi::Error::Success();
      });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // grads
                                  .Arg<ffi::AnyBuffer>()          // params
                                  .Arg<ffi::Buffer<ffi::F32>>()   // m
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scalars
                                  .Ret<ffi::AnyBuffer>()          // out: updates or new params
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m_out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // v_out
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Attr<bool>("apply_updates"));

JAXOPS_REGISTER_FFI_TARGET("jaxops_adamw", kAdamW);

}  // namespace jaxops
