// CPU FFI handlers of the norms: decode and validate, then call cpu/norms.
#include "cpu/float_convert.h"
#include "cpu/norms.h"
#include "xla_ffi/norms_checks.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace norms_checks;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error LayerNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> mean,
                        ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = "jaxops_layer_norm_fwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, *y, "y", &s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "bias", bias, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "mean", *mean, s.rows));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", *rstd, s.rows));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_fwd<T>(data<const T>(x), data_or_null<const T>(weight),
                           data_or_null<const T>(bias), data<T>(*y), mean->typed_data(),
                           rstd->typed_data(), {s.rows, s.cols}, epsilon);
    return ffi::Error::Success();
  });
}

ffi::Error LayerNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                        ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                        ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t groups) {
  const std::string op = "jaxops_layer_norm_bwd";
  RowsCols s;
  int64_t parts;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, *dx, "dx", &s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dy, "dy", &s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "bias", bias, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "mean", mean, s.rows));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", rstd, s.rows));
  JAXOPS_RETURN_IF_ERROR(check_groups_and_workspace(op, groups, s, *workspace, 2, &parts));
  JAXOPS_RETURN_IF_ERROR(check_weight_grad(op, "dweight", *dweight, weight, groups, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_weight_grad(op, "dbias", *dbias, bias, groups, s.cols));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_bwd<T>(data<const T>(dy), data<const T>(x), data_or_null<const T>(weight),
                           mean.typed_data(), rstd.typed_data(), data<T>(*dx),
                           data_or_null<T>(*dweight), data_or_null<T>(*dbias),
                           workspace->typed_data(), {s.rows, s.cols}, {groups, parts});
    return ffi::Error::Success();
  });
}

ffi::Error RmsNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = "jaxops_rms_norm_fwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, *y, "y", &s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", *rstd, s.rows));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_fwd<T>(data<const T>(x), data_or_null<const T>(weight), data<T>(*y),
                         rstd->typed_data(), {s.rows, s.cols}, epsilon);
    return ffi::Error::Success();
  });
}

ffi::Error RmsNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                      ffi::Buffer<ffi::F32> rstd, ffi::AnyBuffer dresidual,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                      ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t groups) {
  const std::string op = "jaxops_rms_norm_bwd";
  RowsCols s;
  int64_t parts;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, *dx, "dx", &s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dy, "dy", &s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", rstd, s.rows));
  if (dresidual.element_count() != 0) {
    JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dresidual, "dresidual", &s));
  }
  JAXOPS_RETURN_IF_ERROR(check_groups_and_workspace(op, groups, s, *workspace, 1, &parts));
  JAXOPS_RETURN_IF_ERROR(check_weight_grad(op, "dweight", *dweight, weight, groups, s.cols));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_bwd<T>(data<const T>(dy), data<const T>(x), data_or_null<const T>(weight),
                         rstd.typed_data(), data_or_null<const T>(dresidual), data<T>(*dx),
                         data_or_null<T>(*dweight), workspace->typed_data(), {s.rows, s.cols},
                         {groups, parts});
    return ffi::Error::Success();
  });
}

ffi::Error AddRmsNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                         ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = "jaxops_add_rms_norm_fwd";
  RowsCols s;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, *y, "y", &s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, residual, "residual", &s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, *h, "h", &s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s.cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", *rstd, s.rows));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::add_rms_norm_fwd<T>(data<const T>(x), data<const T>(residual),
                             data_or_null<const T>(weight), data<T>(*y), data<T>(*h),
                             rstd->typed_data(), {s.rows, s.cols}, epsilon);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerNormFwd, LayerNormFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // mean
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Attr<float>("epsilon"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerNormBwd, LayerNormBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dweight
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::Buffer<ffi::F32>>()  // workspace
                                  .Attr<int64_t>("groups"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kRmsNormFwd, RmsNormFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Attr<float>("epsilon"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kRmsNormBwd, RmsNormBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dresidual
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dweight
                                  .Ret<ffi::Buffer<ffi::F32>>()  // workspace
                                  .Attr<int64_t>("groups"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAddRmsNormFwd, AddRmsNormFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Attr<float>("epsilon"));

JAXOPS_REGISTER_FFI_TARGET("jaxops_layer_norm_fwd", kLayerNormFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_layer_norm_bwd", kLayerNormBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_rms_norm_fwd", kRmsNormFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_rms_norm_bwd", kRmsNormBwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_add_rms_norm_fwd", kAddRmsNormFwd);

}  // namespace jaxops
