// What the CPU and CUDA handlers of the patch embedding share: the targets'
// contract, the validation of every buffer against the images' and kernel's
// shapes, and the FFI bindings (`prefix`: nothing for the CPU, the stream for
// CUDA). Absent operands (bias, pos_embed, cls_token) and unwanted gradients
// are zero-size [0] buffers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "params/patch_embed.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/matmul_precision.h"

namespace jaxops::patch_embed_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

using ::jaxops::params::PatchEmbedShape;
using namespace ::jaxops::params;

// -- the targets' contract ------------------------------------------------------------

inline constexpr contract::Attribute<int64_t> kPatchSize{"patch_size"};
inline constexpr contract::Attribute<int64_t> kWanted{"wanted"};  // PatchEmbedGrad bits

inline constexpr auto kPatchEmbedFwd = contract::target("jaxops_patch_embed_fwd", kPatchSize,
                                                       matmul_precision::kAllowTf32);
inline constexpr auto kPatchEmbedBwd = contract::target("jaxops_patch_embed_bwd", kPatchSize,
                                                       kWanted, matmul_precision::kAllowTf32);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kPatchEmbedFwd), describe(kPatchEmbedBwd)};
}

// -- checks ---------------------------------------------------------------------------

// images [B, H, W, C] and kernel [p, p, C, D] with H, W multiples of p.
inline ffi::Error check_images_and_kernel(const std::string& op, const ffi::AnyBuffer& images,
                                          const ffi::AnyBuffer& kernel, int64_t patch_size,
                                          PatchEmbedShape* s) {
  auto im = images.dimensions(), k = kernel.dimensions();
  if (im.size() != 4) {
    return invalid(op, "images must be [batch, height, width, channels], got shape " +
                           dims_string(im));
  }
  if (patch_size < 1 || k.size() != 4 || k[0] != patch_size || k[1] != patch_size ||
      k[2] != im[3] || k[3] < 1) {
    return invalid(op, "kernel has shape " + dims_string(k) + ", expected [" +
                           std::to_string(patch_size) + ", " + std::to_string(patch_size) +
                           ", " + std::to_string(im[3]) + ", dim >= 1] (patch_size=" +
                           std::to_string(patch_size) + ")");
  }
  if (im[1] % patch_size != 0 || im[2] % patch_size != 0) {
    return invalid(op, "images' height and width " + dims_string(im) +
                           " are not multiples of patch_size=" + std::to_string(patch_size));
  }
  *s = PatchEmbedShape{im[0], im[1], im[2], im[3], patch_size, k[3], false, false, false};
  return same_dtype(op, "images", images, "kernel", kernel);
}

// A buffer that is either [0] (absent) or exactly `dims` with the images' dtype.
inline ffi::Error check_optional(const std::string& op, const char* name,
                                 const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& images,
                                 const std::vector<int64_t>& dims, bool* present) {
  *present = !is_placeholder(buffer);
  if (!*present) return ffi::Error::Success();
  JAXOPS_RETURN_IF_ERROR(dims_are(op, name, buffer, dims));
  return same_dtype(op, "images", images, name, buffer);
}

inline ffi::Error check_patch_embed_fwd(const ffi::AnyBuffer& images, const ffi::AnyBuffer& kernel,
                                        const ffi::AnyBuffer& bias, const ffi::AnyBuffer& pos,
                                        const ffi::AnyBuffer& cls, const ffi::AnyBuffer& tokens,
                                        int64_t patch_size, PatchEmbedShape* s) {
  const std::string op = kPatchEmbedFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_images_and_kernel(op, images, kernel, patch_size, s));
  JAXOPS_RETURN_IF_ERROR(check_optional(op, "cls_token", cls, images, {s->dim}, &s->has_cls));
  JAXOPS_RETURN_IF_ERROR(check_optional(op, "bias", bias, images, {s->dim}, &s->has_bias));
  JAXOPS_RETURN_IF_ERROR(
      check_optional(op, "pos_embed", pos, images, {s->tokens(), s->dim}, &s->has_pos));
  JAXOPS_RETURN_IF_ERROR(dims_are(op, "tokens", tokens,
                                  std::vector<int64_t>{s->batch, s->tokens(), s->dim}));
  return same_dtype(op, "images", images, "tokens", tokens);
}

// The gradient `name` is [0] unless `bit` is wanted, then exactly `dims`.
inline ffi::Error check_gradient(const std::string& op, const char* name,
                                 const ffi::AnyBuffer& grad, const ffi::AnyBuffer& images,
                                 int64_t wanted, int64_t bit, const std::vector<int64_t>& dims) {
  if (!(wanted & bit)) {
    if (is_placeholder(grad)) return ffi::Error::Success();
    return invalid(op, std::string(name) + " is not wanted but has shape " +
                           dims_string(grad.dimensions()) + ", expected [0]");
  }
  JAXOPS_RETURN_IF_ERROR(dims_are(op, name, grad, dims));
  return same_dtype(op, "images", images, name, grad);
}

// dtokens [B, N or N + 1, D]: N + 1 rows mean the forward had a class token.
inline ffi::Error check_patch_embed_bwd(const ffi::AnyBuffer& dtokens, const ffi::AnyBuffer& images,
                                        const ffi::AnyBuffer& kernel, const ffi::AnyBuffer& dimages,
                                        const ffi::AnyBuffer& dkernel, const ffi::AnyBuffer& dbias,
                                        const ffi::AnyBuffer& dpos, const ffi::AnyBuffer& dcls,
                                        int64_t patch_size, int64_t wanted, PatchEmbedShape* s) {
  const std::string op = kPatchEmbedBwd.name;
  JAXOPS_RETURN_IF_ERROR(check_images_and_kernel(op, images, kernel, patch_size, s));
  auto dt = dtokens.dimensions();
  if (dt.size() != 3 || dt[0] != s->batch || dt[2] != s->dim ||
      (dt[1] != s->patches() && dt[1] != s->patches() + 1)) {
    return invalid(op, "dtokens has shape " + dims_string(dt) + ", expected [" +
                           std::to_string(s->batch) + ", " + std::to_string(s->patches()) +
                           " (+1 with a class token), " + std::to_string(s->dim) + "]");
  }
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "images", images, "dtokens", dtokens));
  s->has_cls = dt[1] == s->patches() + 1;
  if ((wanted & kGradCls) && !s->has_cls) {
    return invalid(op, "dcls_token is wanted but dtokens has no class-token row");
  }
  auto im = images.dimensions();
  JAXOPS_RETURN_IF_ERROR(check_gradient(op, "dimages", dimages, images, wanted, kGradImages,
                                        {im.begin(), im.end()}));
  auto k = kernel.dimensions();
  JAXOPS_RETURN_IF_ERROR(check_gradient(op, "dkernel", dkernel, images, wanted, kGradKernel,
                                        {k.begin(), k.end()}));
  JAXOPS_RETURN_IF_ERROR(
      check_gradient(op, "dbias", dbias, images, wanted, kGradBias, {s->dim}));
  JAXOPS_RETURN_IF_ERROR(
      check_gradient(op, "dpos_embed", dpos, images, wanted, kGradPos, {s->tokens(), s->dim}));
  return check_gradient(op, "dcls_token", dcls, images, wanted, kGradCls, {s->dim});
}

// -- bindings -------------------------------------------------------------------------

template <typename Binding>
auto bind_patch_embed_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // images [B, H, W, C]
      .template Arg<ffi::AnyBuffer>()                      // kernel [p, p, C, D]
      .template Arg<ffi::AnyBuffer>()                      // bias [D] or [0]
      .template Arg<ffi::AnyBuffer>()                      // pos_embed [N(+1), D] or [0]
      .template Arg<ffi::AnyBuffer>()                      // cls_token [D] or [0]
      .template Ret<ffi::AnyBuffer>();                     // tokens [B, N(+1), D]
}

template <typename Binding>
auto bind_patch_embed_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dtokens [B, N(+1), D]
      .template Arg<ffi::AnyBuffer>()                      // images
      .template Arg<ffi::AnyBuffer>()                      // kernel
      .template Ret<ffi::AnyBuffer>()                      // dimages or [0]
      .template Ret<ffi::AnyBuffer>()                      // dkernel or [0]
      .template Ret<ffi::AnyBuffer>()                      // dbias or [0]
      .template Ret<ffi::AnyBuffer>()                      // dpos_embed or [0]
      .template Ret<ffi::AnyBuffer>();                     // dcls_token or [0]
}

}  // namespace jaxops::patch_embed_common
