// CPU FFI handlers of the norms: decode and validate, then call cpu/norms.
#include "cpu/float_convert.h"
#include "cpu/norms.h"
#include "xla_ffi/norms_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace norms_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error LayerNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> mean,
                        ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = kLayerNormFwd.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_layer_norm_fwd(x, weight, bias, *y, *mean, *rstd, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_fwd<T>(data<const T>(x), data_or_null<const T>(weight),
                           data_or_null<const T>(bias), data<T>(*y), mean->typed_data(),
                           rstd->typed_data(), s, epsilon);
    return ffi::Error::Success();
  });
}

ffi::Error LayerNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                        ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                        ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t groups) {
  const std::string op = kLayerNormBwd.name;
  NormShape s;
  WeightGradLayout layout;
  JAXOPS_RETURN_IF_ERROR(check_layer_norm_bwd(dy, x, weight, bias, mean, rstd, *dx, *dweight, *dbias,
                                              *workspace, groups, &s, &layout));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_bwd<T>(data<const T>(dy), data<const T>(x), data_or_null<const T>(weight),
                           mean.typed_data(), rstd.typed_data(), data<T>(*dx),
                           data_or_null<T>(*dweight), data_or_null<T>(*dbias),
                           workspace->typed_data(), s, layout);
    return ffi::Error::Success();
  });
}

ffi::Error RmsNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = kRmsNormFwd.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_rms_norm_fwd(x, weight, *y, *rstd, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_fwd<T>(data<const T>(x), data_or_null<const T>(weight), data<T>(*y),
                         rstd->typed_data(), s, epsilon);
    return ffi::Error::Success();
  });
}

ffi::Error RmsNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                      ffi::Buffer<ffi::F32> rstd, ffi::AnyBuffer dresidual,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                      ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t groups) {
  const std::string op = kRmsNormBwd.name;
  NormShape s;
  WeightGradLayout layout;
  JAXOPS_RETURN_IF_ERROR(check_rms_norm_bwd(dy, x, weight, rstd, dresidual, *dx, *dweight,
                                            *workspace, groups, &s, &layout));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_bwd<T>(data<const T>(dy), data<const T>(x), data_or_null<const T>(weight),
                         rstd.typed_data(), data_or_null<const T>(dresidual), data<T>(*dx),
                         data_or_null<T>(*dweight), workspace->typed_data(), s,
                         layout);
    return ffi::Error::Success();
  });
}

ffi::Error AddRmsNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                         ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = kAddRmsNormFwd.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_add_rms_norm_fwd(x, residual, weight, *y, *h, *rstd, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::add_rms_norm_fwd<T>(data<const T>(x), data<const T>(residual),
                             data_or_null<const T>(weight), data<T>(*y), data<T>(*h),
                             rstd->typed_data(), s, epsilon);
    return ffi::Error::Success();
  });
}

ffi::Error LayerNormJvp(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> mean,
                        ffi::Buffer<ffi::F32> rstd, ffi::AnyBuffer dx, ffi::AnyBuffer dweight,
                        ffi::AnyBuffer dbias, ffi::Result<ffi::AnyBuffer> dy) {
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_layer_norm_jvp(x, weight, mean, rstd, dx, dweight, dbias, *dy, &s));
  return dispatch(kLayerNormJvp.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_jvp<T>(data<const T>(x), data_or_null<const T>(weight), mean.typed_data(),
                           rstd.typed_data(), data_or_null<const T>(dx),
                           data_or_null<const T>(dweight), data_or_null<const T>(dbias),
                           data<T>(*dy), s);
    return ffi::Error::Success();
  });
}

ffi::Error RmsNormJvp(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> rstd,
                      ffi::AnyBuffer dx, ffi::AnyBuffer dweight, ffi::Result<ffi::AnyBuffer> dy) {
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_rms_norm_jvp(x, weight, rstd, dx, dweight, *dy, &s));
  return dispatch(kRmsNormJvp.name, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_jvp<T>(data<const T>(x), data_or_null<const T>(weight), rstd.typed_data(),
                         data_or_null<const T>(dx), data_or_null<const T>(dweight), data<T>(*dy),
                         s);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kLayerNormFwd, kLayerNormFwdCpu, LayerNormFwd,
                  bind_layer_norm_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLayerNormBwd, kLayerNormBwdCpu, LayerNormBwd,
                  bind_layer_norm_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kRmsNormFwd, kRmsNormFwdCpu, RmsNormFwd, bind_rms_norm_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kRmsNormBwd, kRmsNormBwdCpu, RmsNormBwd, bind_rms_norm_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kAddRmsNormFwd, kAddRmsNormFwdCpu, AddRmsNormFwd,
                  bind_add_rms_norm_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kLayerNormJvp, kLayerNormJvpCpu, LayerNormJvp,
                  bind_layer_norm_jvp(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kRmsNormJvp, kRmsNormJvpCpu, RmsNormJvp, bind_rms_norm_jvp(ffi::Ffi::Bind()));

}  // namespace jaxops
