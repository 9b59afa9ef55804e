"""PatchEmbed for linen and nnx (exported as ``jaxops.flax.linen.PatchEmbed`` and
``jaxops.flax.nnx.PatchEmbed``): a ViT's patch embedding on ``jaxops.patch_embed``.

Parameters are named as the google-research/vision_transformer model names them,
so its trained weights load unchanged:

========================  =======================  =================================
parameter                 shape                    ViT's name
========================  =======================  =================================
``kernel``                [p, p, C, D]             ``params['embedding']['kernel']``
``bias`` (use_bias)       [D]                      ``params['embedding']['bias']``
``cls`` (use_cls_token)   [1, 1, D]                ``params['cls']``
``pos_embedding``         [1, N(+1), D]            ``params['Transformer']['posembed_input']['pos_embedding']``
========================  =======================  =================================

``PatchEmbed(name="embedding")`` (linen) therefore takes ``params['embedding']``
as it is; the class token and positional embedding, which that model keeps
elsewhere, are copied into this module's ``cls`` / ``pos_embedding`` with
their shapes unchanged. The output is ``nn.Conv(D, (p, p), strides=p,
padding="VALID")`` reshaped to [B, N, D] (+ the class token as token 0, + the
positional embedding): the ViT's input to its encoder, before dropout.

``precision`` is nn.Conv's: the precision of the float32 products
(``jaxops.patch_embed``'s ``precision``: TF32 tensor cores on a GPU at the
default and "high" precisions, full float32 at "highest"); None follows
``jax.default_matmul_precision``, as nn.Conv does (docs/precision.md).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

import jaxops
from jaxops.flax._dtypes import compute_dtype

Initializer = Callable[..., Any]
# google-research/vision_transformer's initialisers of the class token and positions.
CLS_INIT = nn.initializers.zeros
POS_EMBEDDING_INIT = nn.initializers.normal(stddev=0.02)


def _tokens(height, width, patch_size, use_cls_token):
  return (height // patch_size) * (width // patch_size) + (1 if use_cls_token else 0)


def _embed(images, kernel, bias, cls, pos, *, dtype, patch_size, precision, implementation):
  cast = lambda x: None if x is None else jnp.asarray(x).astype(dtype)
  return jaxops.patch_embed(cast(images), cast(kernel), cast(bias), patch_size=patch_size,
                            pos_embed=cast(pos), cls_token=cast(cls), precision=precision,
                            implementation=implementation)


class LinenPatchEmbed(nn.Module):
  """Patch embedding of images [B, H, W, C] into tokens [B, N(+1), D]
  (``features`` = D), with the parameters of the module docstring; the
  positional embedding's length is taken from the first images seen."""

  features: int
  patch_size: int
  use_bias: bool = True
  use_cls_token: bool = False
  use_pos_embedding: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Initializer = nn.linear.default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  cls_init: Initializer = CLS_INIT
  pos_embedding_init: Initializer = POS_EMBEDDING_INIT
  implementation: str | None = None

  @nn.compact
  def __call__(self, images):
    p, d = self.patch_size, self.features
    kernel = self.param("kernel", self.kernel_init, (p, p, images.shape[-1], d), self.param_dtype)
    bias = self.param("bias", self.bias_init, (d,), self.param_dtype) if self.use_bias else None
    cls = (self.param("cls", self.cls_init, (1, 1, d), self.param_dtype)
           if self.use_cls_token else None)
    pos = None
    if self.use_pos_embedding:
      tokens = _tokens(images.shape[1], images.shape[2], p, self.use_cls_token)
      pos = self.param("pos_embedding", self.pos_embedding_init, (1, tokens, d),
                       self.param_dtype)
    dtype = compute_dtype(images, self.dtype, self.param_dtype, True)
    return _embed(images, kernel, bias, cls, pos, dtype=dtype, patch_size=p,
                  precision=self.precision, implementation=self.implementation)


class NnxPatchEmbed(nnx.Module):
  """The nnx twin of :class:`LinenPatchEmbed`: attributes ``kernel``, ``bias``,
  ``cls`` and ``pos_embedding`` (``nnx.Param``); the positional embedding needs
  the image size, ``image_size=(H, W)``."""

  def __init__(self, in_features: int, features: int, patch_size: int, *,
               use_bias: bool = True, use_cls_token: bool = False,
               image_size: tuple[int, int] | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Initializer = nn.linear.default_kernel_init,
               bias_init: Initializer = nn.initializers.zeros,
               cls_init: Initializer = CLS_INIT,
               pos_embedding_init: Initializer = POS_EMBEDDING_INIT,
               implementation: str | None = None, rngs: nnx.Rngs):
    p, d = patch_size, features
    self.patch_size, self.dtype, self.param_dtype = patch_size, dtype, param_dtype
    self.precision, self.implementation = precision, implementation
    self.kernel = nnx.Param(kernel_init(rngs.params(), (p, p, in_features, d), param_dtype))
    self.bias = nnx.Param(bias_init(rngs.params(), (d,), param_dtype)) if use_bias else None
    self.cls = (nnx.Param(cls_init(rngs.params(), (1, 1, d), param_dtype))
                if use_cls_token else None)
    tokens = None if image_size is None else _tokens(*image_size, p, use_cls_token)
    self.pos_embedding = (None if tokens is None else nnx.Param(
        pos_embedding_init(rngs.params(), (1, tokens, d), param_dtype)))

  def __call__(self, images):
    value = lambda param: None if param is None else param[...]
    dtype = compute_dtype(images, self.dtype, self.param_dtype, True)
    return _embed(images, value(self.kernel), value(self.bias), value(self.cls),
                  value(self.pos_embedding), dtype=dtype, patch_size=self.patch_size,
                  precision=self.precision, implementation=self.implementation)
