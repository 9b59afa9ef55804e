// Patch embedding (a ViT's stride-p, VALID p x p convolution, flattened to
// tokens) and its gradient. Shapes: params/patch_embed.h. T is float, bfloat16
// or float16; products accumulate in float32.
//
// Forward: tokens[b, cls + n] = patch(b, n) . kernel + bias + pos[cls + n], and
// tokens[b, 0] = cls + pos[0] with a class token. The GEMM's A panel (a few
// dozen patch rows) is gathered straight from the image into a float32 buffer
// (no im2col of the whole batch), the kernel is read in place when it is
// float32 with whole SIMD vectors of columns (else copied once as float32, its
// columns padded), and the bias/pos epilogue is applied to the product before
// the one store of each token.
//
// Backward: dimages = dtokens . kernel^T scattered straight back into the
// (non-overlapping) patches; dkernel = patches^T dtokens, per-thread float32
// partials summed at the end; dpos / dcls / dbias from the per-token sums over
// the batch. Null pointers are gradients not wanted.
#pragma once

#include <cstdint>

#include "params/patch_embed.h"

namespace jaxops::cpu {

using ::jaxops::params::PatchEmbedShape;

// bias, pos, cls: null when absent (shape.has_*).
template <typename T>
void patch_embed_fwd(const T* images, const T* kernel, const T* bias, const T* pos,
                     const T* cls, T* tokens, PatchEmbedShape shape);

template <typename T>
void patch_embed_bwd(const T* dtokens, const T* images, const T* kernel, T* dimages,
                     T* dkernel, T* dbias, T* dpos, T* dcls, PatchEmbedShape shape);

}  // namespace jaxops::cpu
