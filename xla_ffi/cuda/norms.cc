// CUDA FFI handlers of the norms: the CPU handlers' targets, bindings and
// validation (xla_ffi/norms_checks.h), then a launch of cuda/norms on the stream
// XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/norms.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/norms_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace norms_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error LayerNormFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::F32>> mean,
                        ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  const std::string op = kLayerNormFwd.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_layer_norm_fwd(x, weight, bias, *y, *mean, *rstd, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::layer_norm_fwd<T>(stream, data<const T>(x), data_or_null<const T>(weight),
                                    data_or_null<const T>(bias), data<T>(*y), mean->typed_data(),
                                    rstd->typed_data(), s, epsilon));
  });
}

ffi::Error LayerNormBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> mean,
                        ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t groups) {
  const std::string op = kLayerNormBwd.name;
  NormShape s;
  WeightGradLayout layout;
  JAXOPS_RETURN_IF_ERROR(check_layer_norm_bwd(dy, x, weight, bias, mean, rstd, *dx, *dweight, *dbias,
                                              *workspace, groups, &s, &layout));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::layer_norm_bwd<T>(stream, data<const T>(dy), data<const T>(x),
                                    data_or_null<const T>(weight), mean.typed_data(),
                                    rstd.typed_data(), data<T>(*dx), data_or_null<T>(*dweight),
                                    data_or_null<T>(*dbias), workspace->typed_data(),
                                    s, layout));
  });
}

ffi::Error RmsNormFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> rstd,
                      float epsilon) {
  const std::string op = kRmsNormFwd.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_rms_norm_fwd(x, weight, *y, *rstd, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::rms_norm_fwd<T>(stream, data<const T>(x), data_or_null<const T>(weight),
                                  data<T>(*y), rstd->typed_data(), s, epsilon));
  });
}

ffi::Error RmsNormBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                      ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> rstd, ffi::AnyBuffer dresidual,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                      ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t groups) {
  const std::string op = kRmsNormBwd.name;
  NormShape s;
  WeightGradLayout layout;
  JAXOPS_RETURN_IF_ERROR(check_rms_norm_bwd(dy, x, weight, rstd, dresidual, *dx, *dweight,
                                            *workspace, groups, &s, &layout));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::rms_norm_bwd<T>(stream, data<const T>(dy), data<const T>(x),
                                  data_or_null<const T>(weight), rstd.typed_data(),
                                  data_or_null<const T>(dresidual), data<T>(*dx),
                                  data_or_null<T>(*dweight), workspace->typed_data(),
                                  s, layout));
  });
}

ffi::Error AddRmsNormFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                         ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::Buffer<ffi::F32>> rstd,
                         float epsilon) {
  const std::string op = kAddRmsNormFwd.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_add_rms_norm_fwd(x, residual, weight, *y, *h, *rstd, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::add_rms_norm_fwd<T>(stream, data<const T>(x), data<const T>(residual),
                                      data_or_null<const T>(weight), data<T>(*y), data<T>(*h),
                                      rstd->typed_data(), s, epsilon));
  });
}

ffi::Error LayerNormJvp(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                        ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd, ffi::AnyBuffer dx,
                        ffi::AnyBuffer dweight, ffi::AnyBuffer dbias,
                        ffi::Result<ffi::AnyBuffer> dy) {
  const std::string op = kLayerNormJvp.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_layer_norm_jvp(x, weight, mean, rstd, dx, dweight, dbias, *dy, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::layer_norm_jvp<T>(stream, data<const T>(x), data_or_null<const T>(weight),
                                    mean.typed_data(), rstd.typed_data(),
                                    data_or_null<const T>(dx), data_or_null<const T>(dweight),
                                    data_or_null<const T>(dbias), data<T>(*dy),
                                    s));
  });
}

ffi::Error RmsNormJvp(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                      ffi::Buffer<ffi::F32> rstd, ffi::AnyBuffer dx, ffi::AnyBuffer dweight,
                      ffi::Result<ffi::AnyBuffer> dy) {
  const std::string op = kRmsNormJvp.name;
  NormShape s;
  JAXOPS_RETURN_IF_ERROR(check_rms_norm_jvp(x, weight, rstd, dx, dweight, *dy, &s));
  return dispatch(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::rms_norm_jvp<T>(stream, data<const T>(x), data_or_null<const T>(weight),
                                  rstd.typed_data(), data_or_null<const T>(dx),
                                  data_or_null<const T>(dweight), data<T>(*dy), s));
  });
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
JAXOPS_FFI_TARGET(kLayerNormFwd, kLayerNormFwdCuda, LayerNormFwd,
                  bind_layer_norm_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kLayerNormBwd, kLayerNormBwdCuda, LayerNormBwd,
                  bind_layer_norm_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kRmsNormFwd, kRmsNormFwdCuda, RmsNormFwd, bind_rms_norm_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kRmsNormBwd, kRmsNormBwdCuda, RmsNormBwd, bind_rms_norm_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kAddRmsNormFwd, kAddRmsNormFwdCuda, AddRmsNormFwd,
                  bind_add_rms_norm_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kLayerNormJvp, kLayerNormJvpCuda, LayerNormJvp,
                  bind_layer_norm_jvp(cuda_binding()));
JAXOPS_FFI_TARGET(kRmsNormJvp, kRmsNormJvpCuda, RmsNormJvp, bind_rms_norm_jvp(cuda_binding()));

}  // namespace jaxops
