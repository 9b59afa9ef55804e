// CPU FFI handlers of the 2:4 sparse linear layer: validate
// (xla_ffi/sparse_common.h), then call cpu/sparse.
#include <string>

#include "cpu/float_convert.h"
#include "cpu/sparse.h"
#include "xla_ffi/sparse_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace sparse_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error SparseLinearFwd(ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> metadata,
                           ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                           bool /*allow_tf32: the kernels compute in full float32*/) {
  SparseLinearShape s;
  JAXOPS_RETURN_IF_ERROR(check_sparse_linear_fwd(x, values, metadata, bias, *y, &s));
  return dispatch(kSparseLinearFwd.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::sparse_linear_fwd<T>(data<const T>(x), data<const T>(values), metadata.typed_data(),
                              data_or_null<const T>(bias), data<T>(*y), s);
    return ffi::Error::Success();
  });
}

ffi::Error SparseLinearDx(ffi::AnyBuffer dy, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> metadata,
                          ffi::Result<ffi::AnyBuffer> dx,
                          bool /*allow_tf32: the kernels compute in full float32*/) {
  SparseLinearShape s;
  JAXOPS_RETURN_IF_ERROR(check_sparse_linear_dx(dy, values, metadata, *dx, &s));
  return dispatch(kSparseLinearDx.name, dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::sparse_linear_dx<T>(data<const T>(dy), data<const T>(values), metadata.typed_data(),
                             data<T>(*dx), s);
    return ffi::Error::Success();
  });
}

ffi::Error SparseLinearDvalues(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> metadata,
                               ffi::Result<ffi::AnyBuffer> dvalues,
                               bool /*allow_tf32: the kernels compute in full float32*/) {
  SparseLinearShape s;
  JAXOPS_RETURN_IF_ERROR(check_sparse_linear_dvalues(dy, x, metadata, *dvalues, &s));
  return dispatch(kSparseLinearDvalues.name, dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::sparse_linear_dvalues<T>(data<const T>(dy), data<const T>(x), metadata.typed_data(),
                                  data<T>(*dvalues), s);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kSparseLinearFwd, kSparseLinearFwdCpu, SparseLinearFwd,
                  bind_sparse_linear_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSparseLinearDx, kSparseLinearDxCpu, SparseLinearDx,
                  bind_sparse_linear_dx(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kSparseLinearDvalues, kSparseLinearDvaluesCpu, SparseLinearDvalues,
                  bind_sparse_linear_dvalues(ffi::Ffi::Bind()));

}  // namespace jaxops
