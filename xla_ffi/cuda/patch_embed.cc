// CUDA FFI handlers of the patch embedding and its gradient: the CPU handlers'
// targets, bindings and validation (xla_ffi/patch_embed_common.h), then
// launches of cuda/patch_embed on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/patch_embed.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/patch_embed_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace patch_embed_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error PatchEmbedFwd(cudaStream_t stream, ffi::AnyBuffer images, ffi::AnyBuffer kernel,
                         ffi::AnyBuffer bias, ffi::AnyBuffer pos, ffi::AnyBuffer cls,
                         ffi::Result<ffi::AnyBuffer> tokens, int64_t patch_size,
                         bool allow_tf32) {
  const std::string op = kPatchEmbedFwd.name;
  PatchEmbedShape s;
  JAXOPS_RETURN_IF_ERROR(
      check_patch_embed_fwd(images, kernel, bias, pos, cls, *tokens, patch_size, &s));
  return dispatch(op, images.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::patch_embed_fwd<T>(stream, data<const T>(images), data<const T>(kernel),
                                     data_or_null<const T>(bias), data_or_null<const T>(pos),
                                     data_or_null<const T>(cls), data<T>(*tokens), s,
                                     allow_tf32));
  });
}

ffi::Error PatchEmbedBwd(cudaStream_t stream, ffi::AnyBuffer dtokens, ffi::AnyBuffer images,
                         ffi::AnyBuffer kernel, ffi::Result<ffi::AnyBuffer> dimages,
                         ffi::Result<ffi::AnyBuffer> dkernel, ffi::Result<ffi::AnyBuffer> dbias,
                         ffi::Result<ffi::AnyBuffer> dpos, ffi::Result<ffi::AnyBuffer> dcls,
                         int64_t patch_size, int64_t wanted, bool allow_tf32) {
  const std::string op = kPatchEmbedBwd.name;
  PatchEmbedShape s;
  JAXOPS_RETURN_IF_ERROR(check_patch_embed_bwd(dtokens, images, kernel, *dimages, *dkernel,
                                               *dbias, *dpos, *dcls, patch_size, wanted, &s));
  return dispatch(op, images.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::patch_embed_bwd<T>(stream, data<const T>(dtokens), data<const T>(images),
                                     data<const T>(kernel), data_or_null<T>(*dimages),
                                     data_or_null<T>(*dkernel), data_or_null<T>(*dbias),
                                     data_or_null<T>(*dpos), data_or_null<T>(*dcls), s,
                                     allow_tf32));
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kPatchEmbedFwd, kPatchEmbedFwdCuda, PatchEmbedFwd,
                  bind_patch_embed_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kPatchEmbedBwd, kPatchEmbedBwdCuda, PatchEmbedBwd,
                  bind_patch_embed_bwd(cuda_binding()));

}  // namespace jaxops
