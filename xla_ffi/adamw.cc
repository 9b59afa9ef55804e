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

ffi::Error AdamW(ffi::AnyBuffer grads, ffi::AnyBuffer params, ffi::AnyBuffer m,
                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> scalars,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> m_out,
                 ffi::Result<ffi::Buffer<ffi::F32>> v_out, bool apply_updates, bool nesterov,
                 bool decay) {
  const std::string op = kAdamW.name;
  JAXOPS_RETURN_IF_ERROR(check_adamw(grads, params, m, v, scalars, *out, *m_out, *v_out));
  return dispatch_adamw<float, cpu::bfloat16, cpu::float16>(
      op, params.element_type(), m.element_type(), [&](auto t_tag, auto m_tag) {
        using T = decltype(t_tag);
        using M = decltype(m_tag);
        cpu::adamw<T, M>(data<const T>(grads), data<const T>(params), data<const M>(m),
                         v.typed_data(), scalars.typed_data(), data<T>(*out), data<M>(*m_out),
                         v_out->typed_data(), params.element_count(),
                         AdamWOptions{apply_updates, nesterov, decay});
        return ffi::Error::Success();
      });
}

}  // namespace

JAXOPS_FFI_TARGET(kAdamW, kAdamWCpu, AdamW, bind_adamw(ffi::Ffi::Bind()));

}  // namespace jaxops
