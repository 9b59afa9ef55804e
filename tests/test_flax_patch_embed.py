"""jaxops.flax.linen.PatchEmbed and its nnx twin against Flax's nn.Conv (stride
= kernel, VALID) reshaped to tokens, plus the class token and the positional
embedding, on the same parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_tree_close, custom_call_targets, random_inputs

IMAGES = random_inputs(0, [(2, 8, 12, 3)])[0]


def conv_tokens(conv, images, cls, pos):
  """The ViT's input to its encoder, written with Flax's Conv."""
  y = conv(images)
  y = y.reshape(y.shape[0], -1, y.shape[-1])
  if cls is not None:
    y = jnp.concatenate([jnp.broadcast_to(cls, (y.shape[0], 1, y.shape[-1])), y], axis=1)
  return y if pos is None else y + pos


@pytest.mark.parametrize("cls,pos,bias", [(True, True, True), (False, True, True),
                                          (True, False, False), (False, False, True)])
def test_linen_matches_flax_conv(cls, pos, bias):
  module = jlinen.PatchEmbed(features=5, patch_size=4, use_bias=bias, use_cls_token=cls,
                             use_pos_embedding=pos, bias_init=nn.initializers.normal(1.0),
                             cls_init=nn.initializers.normal(1.0))
  params = module.init(jax.random.key(1), IMAGES)["params"]
  assert params["kernel"].shape == (4, 4, 3, 5)
  assert ("cls" in params) == cls and ("bias" in params) == bias
  if pos:
    assert params["pos_embedding"].shape == (1, 6 + cls, 5)
  conv = nn.Conv(5, (4, 4), strides=4, padding="VALID", use_bias=bias)
  conv_params = {"kernel": params["kernel"], **({"bias": params["bias"]} if bias else {})}
  expected = conv_tokens(lambda x: conv.apply({"params": conv_params}, x), IMAGES,
                         params.get("cls"), params.get("pos_embedding"))
  assert_tree_close(module.apply({"params": params}, IMAGES), expected, atol=1e-5, rtol=1e-5)


def test_linen_takes_a_vit_embedding_unchanged():
  """params['embedding'] of a ViT (an nn.Conv named "embedding") loads as is."""

  class ViTStem(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.Conv(7, (2, 2), strides=(2, 2), padding="VALID", name="embedding")(x)
      return y.reshape(y.shape[0], -1, 7)

  class JaxopsStem(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jlinen.PatchEmbed(features=7, patch_size=2, name="embedding")(x)

  vit_params = ViTStem().init(jax.random.key(2), IMAGES)
  assert jax.tree.structure(vit_params) == jax.tree.structure(
      JaxopsStem().init(jax.random.key(2), IMAGES))
  assert_tree_close(JaxopsStem().apply(vit_params, IMAGES), ViTStem().apply(vit_params, IMAGES),
                    atol=1e-5, rtol=1e-5)
  assert custom_call_targets(lambda x: JaxopsStem().apply(vit_params, x), IMAGES) == [
      "jaxops_patch_embed_fwd"]


def test_linen_bfloat16_computation():
  module = jlinen.PatchEmbed(features=6, patch_size=2, dtype=jnp.bfloat16, use_cls_token=True,
                             use_pos_embedding=True)
  params = module.init(jax.random.key(3), IMAGES)
  out = module.apply(params, IMAGES)
  assert out.dtype == jnp.bfloat16 and out.shape == (2, 25, 6)
  reference = jlinen.PatchEmbed(features=6, patch_size=2, use_cls_token=True,
                                use_pos_embedding=True).apply(params, IMAGES)
  assert_tree_close(out, reference, atol=5e-2, rtol=5e-2)


def test_nnx_matches_flax_conv():
  module = jnnx.PatchEmbed(3, 5, 4, use_cls_token=True, image_size=(8, 12),
                           bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(4))
  conv = nnx.Conv(3, 5, (4, 4), strides=4, padding="VALID", rngs=nnx.Rngs(5))
  conv.kernel[...] = module.kernel[...]
  conv.bias[...] = module.bias[...]
  expected = conv_tokens(conv, IMAGES, module.cls[...], module.pos_embedding[...])
  assert_tree_close(module(IMAGES), expected, atol=1e-5, rtol=1e-5)
  grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(IMAGES))))(module)
  expected_grads = jax.grad(lambda k: jnp.sum(jnp.sin(conv_tokens(
      lambda x: jax.lax.conv_general_dilated(x, k, (4, 4), "VALID",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
      + module.bias[...], IMAGES, module.cls[...], module.pos_embedding[...]))))(
          module.kernel[...])
  assert_tree_close(grads.kernel[...], expected_grads, atol=1e-4, rtol=1e-4)
