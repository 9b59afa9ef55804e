// The parameters of the patch embedding and its gradient, one set for the CPU
// kernels (cpu/patch_embed.h), the CUDA kernels (cuda/patch_embed.h) and the
// FFI handlers that fill them (xla_ffi/patch_embed_common.h).
#pragma once

#include <cstdint>

#include "params/host_device.h"

namespace jaxops::params {

// images [batch, height, width, channels] (NHWC), kernel [patch, patch,
// channels, dim] (Flax nn.Conv's HWIO), tokens [batch, cls + patches, dim].
// height and width are multiples of patch: the patches tile the image exactly.
// A patch row of the GEMM is the patch's pixels in kernel order (ky, kx, c), so
// the GEMM is [batch * patches, patch_len] x [patch_len, dim].
struct PatchEmbedShape {
  int64_t batch;
  int64_t height;
  int64_t width;
  int64_t channels;
  int64_t patch;
  int64_t dim;
  bool has_bias;
  bool has_pos;  // pos_embed [cls + patches, dim]
  bool has_cls;  // the class token [dim] is row 0 of every image's tokens

  JAXOPS_HOST_DEVICE int64_t grid_w() const { return width / patch; }
  JAXOPS_HOST_DEVICE int64_t patches() const { return (height / patch) * grid_w(); }
  JAXOPS_HOST_DEVICE int64_t tokens() const { return patches() + (has_cls ? 1 : 0); }
  JAXOPS_HOST_DEVICE int64_t patch_len() const { return patch * patch * channels; }
  // Image element offset of pixel (ky, 0, 0) of patch n of image b; the patch's
  // ky-th pixel row is the next patch * channels values.
  JAXOPS_HOST_DEVICE int64_t patch_row_offset(int64_t b, int64_t n, int64_t ky) const {
    const int64_t i = n / grid_w(), j = n % grid_w();
    return ((b * height + i * patch + ky) * width + j * patch) * channels;
  }
};

// Which gradients the backward computes (its `wanted` attribute); the others
// are zero-size results.
enum PatchEmbedGrad : int64_t {
  kGradImages = 1,
  kGradKernel = 2,
  kGradBias = 4,
  kGradPos = 8,
  kGradCls = 16,
};

}  // namespace jaxops::params
