// CPU FFI handler of the fused AdamW step on one parameter leaf: validate
// (xla_ffi/adamw_common.h), then call cpu/adamw.
#include <string>

#include "cpu/adamw.h"
#include "cpu/float_convert.h"
#include "xla_ffi/adamw_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace adamw_common;

ffi::Error AdamW(ffi::AnyBuffer grads, ffi::AnyBuffer params, ffi::Buffer<ffi::F32> m,
                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> scalars,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> m_out,
                 ffi::Result<ffi::Buffer<ffi::F32>> v_out, float b1, float one_minus_b1,
                 float b2, float one_minus_b2, float eps, float weight_decay,
                 bool apply_updates) {
  const std::string op = kAdamW.name;
  AdamWHyperparameters hyper;
  JAXOPS_RETURN_IF_ERROR(check_adamw(grads, params, m, v, scalars, *out, *m_out, *v_out, b1,
                                     one_minus_b1, b2, one_minus_b2, eps, weight_decay, &hyper));
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

JAXOPS_FFI_TARGET(kAdamW, kAdamWCpu, AdamW, bind_adamw(ffi::Ffi::Bind()));

}  // namespace jaxops
