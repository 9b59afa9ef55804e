// CPU FFI handlers of the patch embedding and its gradient: validate
// (xla_ffi/patch_embed_common.h), then call cpu/patch_embed.
#include <string>

#include "cpu/float_convert.h"
#include "cpu/patch_embed.h"
#include "xla_ffi/patch_embed_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace patch_embed_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error PatchEmbedFwd(ffi::AnyBuffer images, ffi::AnyBuffer kernel, ffi::AnyBuffer bias,
                         ffi::AnyBuffer pos, ffi::AnyBuffer cls,
                         ffi::Result<ffi::AnyBuffer> tokens, int64_t patch_size,
                         bool /*allow_tf32: the CPU kernel computes in full float32*/) {
  const std::string op = kPatchEmbedFwd.name;
  PatchEmbedShape s;
  JAXOPS_RETURN_IF_ERROR(
      check_patch_embed_fwd(images, kernel, bias, pos, cls, *tokens, patch_size, &s));
  return dispatch(op, images.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::patch_embed_fwd<T>(data<const T>(images), data<const T>(kernel),
                            data_or_null<const T>(bias), data_or_null<const T>(pos),
                            data_or_null<const T>(cls), data<T>(*tokens), s);
    return ffi::Error::Success();
  });
}

ffi::Error PatchEmbedBwd(ffi::AnyBuffer dtokens, ffi::AnyBuffer images, ffi::AnyBuffer kernel,
                         ffi::Result<ffi::AnyBuffer> dimages, ffi::Result<ffi::AnyBuffer> dkernel,
                         ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dpos,
                         ffi::Result<ffi::AnyBuffer> dcls, int64_t patch_size, int64_t wanted,
                         bool /*allow_tf32: the CPU kernel computes in full float32*/) {
  const std::string op = kPatchEmbedBwd.name;
  PatchEmbedShape s;
  JAXOPS_RETURN_IF_ERROR(check_patch_embed_bwd(dtokens, images, kernel, *dimages, *dkernel,
                                               *dbias, *dpos, *dcls, patch_size, wanted, &s));
  return dispatch(op, images.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::patch_embed_bwd<T>(data<const T>(dtokens), data<const T>(images), data<const T>(kernel),
                            data_or_null<T>(*dimages), data_or_null<T>(*dkernel),
                            data_or_null<T>(*dbias), data_or_null<T>(*dpos),
                            data_or_null<T>(*dcls), s);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kPatchEmbedFwd, kPatchEmbedFwdCpu, PatchEmbedFwd,
                  bind_patch_embed_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kPatchEmbedBwd, kPatchEmbedBwdCpu, PatchEmbedBwd,
                  bind_patch_embed_bwd(ffi::Ffi::Bind()));

}  // namespace jaxops
