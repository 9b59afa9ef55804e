"""A small ViT-style classifier from the jaxops inference-and-vision pieces
trains: ``PatchEmbed`` (class token, positional embedding) -> a pre-norm block
of jaxops attention and a ``SparseDense`` MLP (2:4 weights, trained in their
packed form) -> a linear head on the class token. The task (which quadrant of
a noisy image is bright) is learnt within a few dozen steps: the loss falls,
and the 2:4 pattern of every SparseDense kernel survives training."""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxops
from jaxops.flax import nnx as jn

IMAGE, PATCH, WIDTH, CLASSES = 16, 4, 32, 4


class TinyViT(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = jn.PatchEmbed(3, WIDTH, PATCH, use_cls_token=True, image_size=(IMAGE, IMAGE),
                               rngs=rngs)
    self.attn_norm = jn.LayerNorm(WIDTH, rngs=rngs)
    self.attn = jn.MultiHeadAttention(4, WIDTH, decode=False, rngs=rngs)
    self.mlp_norm = jn.LayerNorm(WIDTH, rngs=rngs)
    self.up = jn.SparseDense(WIDTH, 2 * WIDTH, rngs=rngs)
    self.down = jn.SparseDense(2 * WIDTH, WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

  def __call__(self, images):
    x = self.embed(images)
    x = x + self.attn(self.attn_norm(x))
    x = x + self.down(jaxops.gelu(self.up(self.mlp_norm(x))))
    return self.head(x[:, 0])


def _quadrant_images(count, seed):
  """Noise with one bright quadrant; the label says which."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, CLASSES, count)
  images = rng.normal(0.0, 1.0, (count, IMAGE, IMAGE, 3)).astype(np.float32)
  half = IMAGE // 2
  for i, label in enumerate(labels):
    row, col = divmod(int(label), 2)
    images[i, row * half:(row + 1) * half, col * half:(col + 1) * half] += 1.5
  return jnp.asarray(images), jnp.asarray(labels, jnp.int32)


def test_small_vit_with_patch_embed_attention_and_sparse_mlp_trains():
  model = TinyViT(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  images, labels = _quadrant_images(64, seed=0)

  @nnx.jit
  def train_step(model, optimizer, images, labels):
    def loss_fn(model):
      return jaxops.cross_entropy(model(images), labels)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  sparse_layers = (model.up, model.down)
  metadata = [np.asarray(layer.kernel_metadata[...]) for layer in sparse_layers]
  values = [np.asarray(layer.kernel_values[...]) for layer in sparse_layers]
  losses = [float(train_step(model, optimizer, images, labels)) for _ in range(40)]
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.3 * losses[0], losses
  for layer, before_metadata, before_values in zip(sparse_layers, metadata, values):
    # The packed values trained; the 2:4 positions are state, untouched.
    np.testing.assert_array_equal(layer.kernel_metadata[...], before_metadata)
    assert not np.allclose(layer.kernel_values[...], before_values)
