"""patch_embed: primitives and public function.

A ViT's patch embedding: the stride-p, VALID p x p convolution of the images
(Flax nn.Conv's layout), flattened to tokens, with the bias, the class token
and the positional embedding fused into the same pass. The kernels compute it
as a GEMM [B * N, p * p * C] x [p * p * C, D] whose patch rows are gathered
straight from the image (cpu/patch_embed.h, cuda/patch_embed.h).

Differentiation: the forward F is bilinear in (images, kernel) and affine in
bias, pos_embed and cls_token, so its tangent T is F itself applied to the
tangents (F(dimages, kernel, dbias, dpos, dcls) + F(images, dkernel)): T is a
composite of F's kernel. T's transpose is one fused backward kernel that writes
the wanted gradients (dimages, dkernel, dbias, dpos, dcls) in one call; it is
differentiable again through its reference. An absent bias / pos_embed /
cls_token, a zero tangent and an unwanted gradient are zero-size arrays.

Batching: vmapped images fold into the batch (the kernel runs once); a batched
kernel, bias, pos_embed or class token, and per-example parameter gradients
(vmap of grad), run the reference under vmap.

Sharding: the batch shards; D shards too (tensor parallelism: the kernel's
columns, bias, pos_embed and class token alike); the image gradient is summed
over D shards and the parameter gradients over batch shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import reference
from jaxops._src import matmul_precision, primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, batch_to_front, is_absent
from jaxops._src.sharding import Factors

_OP = "jaxops.patch_embed"

# The backward's `wanted` bits, in the order of its results (params/patch_embed.h).
GRAD_IMAGES, GRAD_KERNEL, GRAD_BIAS, GRAD_POS, GRAD_CLS = 1, 2, 4, 8, 16
_GRAD_BITS = (GRAD_IMAGES, GRAD_KERNEL, GRAD_BIAS, GRAD_POS, GRAD_CLS)


def _present(x):
  return None if is_absent(x) else x


def _num_patches(images, patch_size):
  return (images.shape[1] // patch_size) * (images.shape[2] // patch_size)


def _tokens_aval(images, kernel, cls, patch_size):
  tokens = _num_patches(images, patch_size) + (0 if is_absent(cls) else 1)
  return jax.core.ShapedArray((images.shape[0], tokens, kernel.shape[-1]), images.dtype)


# -- forward -------------------------------------------------------------------------


def _fwd_reference(images, kernel, bias, pos, cls, *, patch_size, allow_tf32):
  del allow_tf32  # the reference is full float32 at every precision
  return (reference.patch_embed(images, kernel, _present(bias), patch_size=patch_size,
                                pos_embed=_present(pos), cls_token=_present(cls)),)


def _fold_images_batch(prim, args, dims, **params):
  """vmapped images (only) become more images; anything else batched: reference."""
  if any(d is not NOT_MAPPED for d in dims[1:]):
    return None
  (images, *rest), size = batch_to_front(args, dims, (0,))
  folded = images.reshape(size * images.shape[1], *images.shape[2:])
  (tokens,) = prim(folded, *rest, **params)
  return (tokens.reshape(size, images.shape[1], *tokens.shape[1:]),), (0,)


def _dim_or_whole(x, factors):
  return (None,) if is_absent(x) else factors


def _fwd_sharding(avals_in, avals_out, **params):
  images, kernel, bias, pos, cls = avals_in
  return Factors(
      [("batch", None, None, None), (None, None, None, "dim"),
       _dim_or_whole(bias, ("dim",)), _dim_or_whole(pos, (None, "dim")),
       _dim_or_whole(cls, ("dim",))],
      [("batch", None, "dim")])


patch_embed_fwd_p = FfiPrimitive(
    name="jaxops_patch_embed_fwd", target="jaxops_patch_embed_fwd",
    abstract_eval=lambda images, kernel, bias, pos, cls, *, patch_size, allow_tf32: (
        _tokens_aval(images, kernel, cls, patch_size),),
    reference=_fwd_reference,
    batch_rule=_fold_images_batch,
    sharding=_fwd_sharding)


# -- tangent: F applied to the tangents ------------------------------------------------


def _affine_tangent(images, kernel, cls, dbias, dpos, dcls, *, patch_size):
  """The tangent when images and kernel have none: bias, class token and
  pos_embed tangents broadcast over the batch."""
  aval = _tokens_aval(images, kernel, cls, patch_size)
  y = jnp.zeros(aval.shape, jnp.float32)
  first = 0 if is_absent(cls) else 1
  if not is_absent(dbias):
    y = y.at[:, first:].add(dbias.astype(jnp.float32))
  if not is_absent(dcls):
    y = y.at[:, 0].add(dcls.astype(jnp.float32))
  if not is_absent(dpos):
    y = y + dpos.astype(jnp.float32)
  return y.astype(aval.dtype)


def _jvp_composite(images, kernel, cls, dimages, dkernel, dbias, dpos, dcls, *, patch_size,
                   allow_tf32):
  # A class token without a tangent still takes its row: a zero tangent.
  if not is_absent(cls) and is_absent(dcls):
    dcls = jnp.zeros_like(cls)
  if is_absent(dimages) and is_absent(dkernel):
    return (_affine_tangent(images, kernel, cls, dbias, dpos, dcls, patch_size=patch_size),)
  terms = []
  if not is_absent(dimages):
    terms.append(patch_embed_fwd_p(dimages, kernel, dbias, dpos, dcls, patch_size=patch_size,
                                   allow_tf32=allow_tf32)[0])
    dbias, dpos = absent(dbias.dtype), absent(dpos.dtype)
    dcls = dcls if is_absent(dcls) else jnp.zeros_like(dcls)
  if not is_absent(dkernel):
    terms.append(patch_embed_fwd_p(images, dkernel, dbias, dpos, dcls, patch_size=patch_size,
                                   allow_tf32=allow_tf32)[0])
  return (sum(terms[1:], terms[0]),)


def _jvp_reference(images, kernel, cls, dimages, dkernel, dbias, dpos, dcls, *, patch_size,
                   allow_tf32):
  del allow_tf32  # the reference is full float32 at every precision
  d = kernel.shape[-1]
  tokens = _tokens_aval(images, kernel, cls, patch_size).shape[1]
  zero = lambda t, shape: jnp.zeros(shape, images.dtype) if is_absent(t) else t
  fwd = lambda i, k, b, p, c: reference.patch_embed(
      i, k, b, patch_size=patch_size, pos_embed=p, cls_token=None if is_absent(cls) else c)
  primals = (images, kernel, jnp.zeros((d,), images.dtype), jnp.zeros((tokens, d), images.dtype),
             jnp.zeros((d,), images.dtype) if is_absent(cls) else cls)
  tangents = (zero(dimages, images.shape), zero(dkernel, kernel.shape), zero(dbias, (d,)),
              zero(dpos, (tokens, d)), zero(dcls, (d,)))
  return (jax.jvp(fwd, primals, tangents)[1],)


patch_embed_jvp_p = FfiPrimitive(
    name="jaxops_patch_embed_jvp", target=None,
    abstract_eval=lambda images, kernel, cls, *tangents, patch_size, allow_tf32: (
        _tokens_aval(images, kernel, cls, patch_size),),
    reference=_jvp_reference,
    composite=_jvp_composite)


# -- backward: the transpose of the tangent --------------------------------------------


def _bwd_avals(dtokens, images, kernel, wanted):
  shapes = (images.shape, kernel.shape, (kernel.shape[-1],), dtokens.shape[1:],
            (kernel.shape[-1],))
  return tuple(jax.core.ShapedArray(shape if wanted & bit else (0,), images.dtype)
               for shape, bit in zip(shapes, _GRAD_BITS))


def _bwd_reference(dtokens, images, kernel, *, patch_size, wanted, allow_tf32):
  del allow_tf32  # the reference is full float32 at every precision
  first = dtokens.shape[1] - _num_patches(images, patch_size)
  dtype = reference.compute_dtype(dtokens.dtype)
  dy = dtokens.astype(dtype)
  conv = lambda i, k: reference.patch_embed_conv(i, k, patch_size=patch_size)
  _, conv_vjp = jax.vjp(conv, images.astype(dtype), kernel.astype(dtype))
  dimages, dkernel = conv_vjp(dy[:, first:])
  grads = (dimages, dkernel, dy[:, first:].sum((0, 1)), dy.sum(0),
           dy[:, 0].sum(0) if first else None)
  return tuple(g.astype(images.dtype) if wanted & bit else jnp.zeros((0,), images.dtype)
               for g, bit in zip(grads, _GRAD_BITS))


def _bwd_batch_rule(prim, args, dims, *, wanted, **params):
  """vmap over dtokens and images with only the image gradient wanted folds into
  the batch; per-example parameter gradients run the reference."""
  if dims[2] is not NOT_MAPPED or wanted & ~GRAD_IMAGES:
    return None
  (dtokens, images, kernel), size = batch_to_front(args, dims, (0, 1))
  grads = prim(dtokens.reshape(-1, *dtokens.shape[2:]), images.reshape(-1, *images.shape[2:]),
               kernel, wanted=wanted, **params)
  dimages = grads[0].reshape(images.shape)
  rest = [jnp.broadcast_to(g, (size, *g.shape)) for g in grads[1:]]
  return (dimages, *rest), (0,) * 5


def _bwd_sharding(avals_in, avals_out, *, wanted, **params):
  dims = [("batch", None, None, None), (None, None, None, "dim"), ("dim",), (None, "dim"),
          ("dim",)]
  return Factors(
      [("batch", None, "dim"), ("batch", None, None, None), (None, None, None, "dim")],
      [d if w & bit else (None,) for d, w, bit in zip(dims, (wanted,) * 5, _GRAD_BITS)])


patch_embed_bwd_p = FfiPrimitive(
    name="jaxops_patch_embed_bwd", target="jaxops_patch_embed_bwd",
    abstract_eval=lambda dtokens, images, kernel, *, wanted, **params: _bwd_avals(
        dtokens, images, kernel, wanted),
    reference=_bwd_reference,
    batch_rule=_bwd_batch_rule,
    sharding=_bwd_sharding)


def _transpose(cotangents, saved, wanted, **params):
  (dtokens,) = cotangents
  images, kernel, cls = saved
  bits = sum(bit for w, bit in zip(wanted, _GRAD_BITS) if w is not None)
  grads = patch_embed_bwd_p(dtokens, images, kernel, wanted=bits, **params)
  return [g if w is not None else None for g, w in zip(grads, wanted)]


Differentiable(
    forward=patch_embed_fwd_p, tangent=patch_embed_jvp_p, transpose=_transpose,
    tangent_inputs=(0, 1, 2, 3, 4), saved_inputs=(0, 1, 4),
    checkpoint_name="jaxops.patch_embed")


# -- the public function ---------------------------------------------------------------


def _same_dtype(name, value, images):
  if value.dtype != images.dtype:
    raise validation.type_error(_OP, name, f"have the dtype of images ({images.dtype})",
                                str(value.dtype))


def _optional_vector(name, value, images, dim, vit_shape):
  """An optional [D] operand; the google-research ViT's [1, 1, D] is accepted too."""
  if value is None:
    return None
  value = validation.float_array(_OP, name, value)
  validation.shape(_OP, name, value, (dim,), vit_shape, of=f"[D] with D = {dim}")
  _same_dtype(name, value, images)
  return value.reshape(dim)


def patch_embed(images, kernel, bias=None, *, patch_size, pos_embed=None, cls_token=None,
                precision=None, implementation=None):
  """ViT patch embedding: images [B, H, W, C] to tokens [B, N(+1), D].

  The values of Flax's ``nn.Conv(D, (p, p), strides=p, padding="VALID")``
  (whose ``kernel`` [p, p, C, D] and ``bias`` [D] load unchanged) reshaped to
  [B, N, D] with N = (H/p)(W/p) patches in row-major (h, w) order; with
  ``cls_token`` [D] prepended as token 0 of every image; plus ``pos_embed``
  [N(+1), D] (N + 1 rows with a class token, row 0 being the class token's).
  All fused into one pass; products accumulate in float32.

  Args:
    images: [B, H, W, C]; H and W multiples of ``patch_size`` (no pixel is
      silently dropped: anything else is a ValueError). float32, bfloat16 or
      float16 (the kernel), float64 (the jnp reference).
    kernel: [p, p, C, D], the dtype of images (as every other operand).
    bias: optional [D].
    patch_size: p, a positive int.
    pos_embed: optional [N(+1), D] (or the google-research ViT's [1, N(+1), D]).
    cls_token: optional [D] (or the google-research ViT's [1, 1, D]).
    precision: the float32 products' precision, as ``lax.conv``'s argument;
      None follows ``jax.default_matmul_precision``. The CUDA kernels (forward
      and backward) may use TF32 tensor cores at the default and ``"high"``
      precisions and compute in full float32 at ``"highest"``/``"float32"``,
      as XLA's GPU convolution does; the CPU kernels are full float32 at
      every setting (docs/precision.md).
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  Returns:
    ``[B, N, D]`` tokens (``[B, N + 1, D]`` with ``cls_token``), in ``images``' dtype.

  Raises:
    TypeError: an operand is not a floating-point array of ``images``' dtype,
      or ``patch_size`` is not an int.
    ValueError: ``images`` is not ``[B, H, W, C]`` with H and W multiples of
      ``patch_size``, or an operand's shape does not match.

  Examples:
    >>> images = jnp.ones((1, 4, 4, 3))                       # [B, H, W, C]
    >>> kernel = jnp.ones((2, 2, 3, 8))                       # [p, p, C, D]
    >>> tokens = jaxops.patch_embed(images, kernel, patch_size=2)
    >>> tokens.shape, float(tokens[0, 0, 0])                  # N = 4 patches; 2 * 2 * 3 ones
    ((1, 4, 8), 12.0)
  """
  patch_size = validation.positive_int(_OP, "patch_size", patch_size)
  images = validation.float_array(_OP, "images", images)
  validation.rank(_OP, "images", images, low=4, high=4, labels="[B, H, W, C]")
  _, height, width, channels = images.shape
  for axis_name, extent in (("height", height), ("width", width)):
    if extent == 0 or extent % patch_size:
      raise validation.value_error(
          _OP, "images", f"have a {axis_name} that is a positive multiple of "
          f"patch_size={patch_size} (no pixel is dropped)", f"shape {images.shape}")
  kernel = validation.float_array(_OP, "kernel", kernel)
  validation.rank(_OP, "kernel", kernel, low=4, high=4, labels="[p, p, C, D]")
  dim = kernel.shape[-1]
  validation.shape(_OP, "kernel", kernel, (patch_size, patch_size, channels, dim),
                   of="[patch_size, patch_size, images' C, D]")
  validation.non_empty_axis(_OP, "kernel", kernel)
  _same_dtype("kernel", kernel, images)
  bias = _optional_vector("bias", bias, images, dim, (dim,))
  cls_token = _optional_vector("cls_token", cls_token, images, dim, (1, 1, dim))
  if pos_embed is not None:
    tokens = (height // patch_size) * (width // patch_size) + (cls_token is not None)
    pos_embed = validation.float_array(_OP, "pos_embed", pos_embed)
    validation.shape(_OP, "pos_embed", pos_embed, (tokens, dim), (1, tokens, dim),
                     of="[N(+1 with cls_token), D]")
    _same_dtype("pos_embed", pos_embed, images)
    pos_embed = pos_embed.reshape(tokens, dim)
  allow_tf32 = matmul_precision.allow_tf32(_OP, precision)
  if not primitive.use_kernel(_OP, implementation, {"images": images.dtype}):
    return reference.patch_embed(images, kernel, bias, patch_size=patch_size,
                                 pos_embed=pos_embed, cls_token=cls_token)
  placeholder = absent(images.dtype)
  pick = lambda x: placeholder if x is None else x
  return patch_embed_fwd_p(images, kernel, pick(bias), pick(pos_embed), pick(cls_token),
                           patch_size=patch_size, allow_tf32=allow_tf32)[0]
