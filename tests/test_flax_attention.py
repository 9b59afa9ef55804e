"""The Flax attention wrappers against Flax's own modules with the same parameters."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxops
from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_tree_close, random_inputs


def _perturbed(params, seed=2):
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
  return jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape), params)


def test_linen_matches_flax_module():
  x, kv = random_inputs(0, [(2, 9, 24), (2, 13, 24)])
  theirs = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, out_features=20)
  ours = jlinen.MultiHeadAttention(num_heads=4, qkv_features=32, out_features=20)
  params = _perturbed(theirs.init(jax.random.key(1), x, kv))
  assert jax.tree.structure(ours.init(jax.random.key(1), x, kv)) == jax.tree.structure(params)
  mask = jax.random.bernoulli(jax.random.key(3), 0.8, (2, 1, 9, 13)).at[..., 0].set(True)
  assert_tree_close(ours.apply(params, x, kv, mask=mask), theirs.apply(params, x, kv, mask=mask),
                    reduce_size=13)
  # is_causal against Flax with a causal mask, and its parameter gradients
  causal = jlinen.MultiHeadAttention(num_heads=4, qkv_features=32, out_features=20, is_causal=True)
  loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p)))
  grads = jax.grad(loss(lambda p: causal.apply(p, x)))(params)
  grads_ref = jax.grad(loss(lambda p: theirs.apply(p, x, mask=nn.make_causal_mask(x[..., 0]))))(params)
  assert_tree_close(grads, grads_ref, atol=1e-4, rtol=1e-4)


def test_jaxops_as_attention_fn_of_flax_modules():
  x, = random_inputs(4, [(2, 7, 16)])
  mask = nn.make_causal_mask(x[..., 0])  # float32, as Flax makes masks
  expected_module = nn.MultiHeadDotProductAttention(num_heads=2)
  params = _perturbed(expected_module.init(jax.random.key(5), x))
  expected = expected_module.apply(params, x, mask=mask)
  module = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=jlinen.dot_product_attention)
  assert_tree_close(module.apply(params, x, mask=mask), expected, reduce_size=7)
  # jaxops.attention itself, with a boolean mask as jax.nn wants
  module = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=jaxops.attention)
  assert_tree_close(module.apply(params, x, mask=mask.astype(bool)), expected, reduce_size=7)
  # nnx, grouped-query, is_causal passed through the call
  theirs = nnx.MultiHeadAttention(4, 16, 32, num_kv_heads=2, decode=False, rngs=nnx.Rngs(6))
  ours = nnx.MultiHeadAttention(4, 16, 32, num_kv_heads=2, decode=False, rngs=nnx.Rngs(6),
                                attention_fn=jnnx.dot_product_attention)
  assert_tree_close(ours(x, is_causal=True), theirs(x, is_causal=True), reduce_size=7)


def test_linen_gqa_rope_and_batch_axes_match_the_reference_path():
  x, = random_inputs(7, [(2, 3, 8, 16)])  # two batch axes

  def rope(t, positions):
    angle = positions[:, None, None] * (0.1 + jnp.arange(t.shape[-1] // 2))
    c, s = jnp.cos(angle), jnp.sin(angle)
    a, b = jnp.split(t, 2, axis=-1)
    return jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)

  make = functools.partial(jlinen.MultiHeadAttention, num_heads=4, num_kv_heads=2,
                           qkv_features=32, is_causal=True, rope=rope)
  params = make().init(jax.random.key(8), x)
  assert params["params"]["key"]["kernel"].shape == (16, 2, 8)
  out = make().apply(params, x, query_offset=jnp.int32(3))
  ref = make(implementation="xla").apply(params, x, query_offset=jnp.int32(3))
  assert out.shape == x.shape
  assert_tree_close(out, ref, reduce_size=8)


def test_linen_dropout_is_on_the_output():
  x, = random_inputs(9, [(2, 5, 8)])
  module = jlinen.MultiHeadAttention(num_heads=2, dropout_rate=0.5)
  params = module.init(jax.random.key(10), x, deterministic=True)
  kept = module.apply(params, x, deterministic=True)
  dropped = module.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(11)})
  zeros = np.asarray(dropped) == 0
  assert 0 < zeros.mean() < 1
  np.testing.assert_allclose(np.asarray(dropped)[~zeros], 2 * np.asarray(kept)[~zeros], rtol=1e-5)


def test_nnx_matches_flax_module():
  x, kv = random_inputs(12, [(2, 6, 16), (2, 11, 12)])
  theirs = nnx.MultiHeadAttention(4, 16, 32, 24, num_kv_heads=2, in_kv_features=12,
                                  decode=False, rngs=nnx.Rngs(13))
  ours = jnnx.MultiHeadAttention(4, 16, 32, 24, num_kv_heads=2, in_kv_features=12,
                                 rngs=nnx.Rngs(14))
  params = nnx.state(theirs, nnx.Param)
  params = jax.tree.map(lambda p: p + 0.1, params)
  nnx.update(theirs, params)
  nnx.update(ours, params)
  mask = jax.random.bernoulli(jax.random.key(15), 0.8, (2, 4, 6, 11)).at[..., 0].set(True)
  assert_tree_close(ours(x, kv, mask=mask), theirs(x, kv, mask=mask), reduce_size=11)
  causal = jnnx.MultiHeadAttention(4, 16, 32, 24, num_kv_heads=2, in_kv_features=12,
                                   is_causal=True, rngs=nnx.Rngs(14))
  nnx.update(causal, params)
  loss = lambda m, **kw: jnp.sum(jnp.sin(m(x, kv, **kw)))
  grads = nnx.grad(loss)(causal)
  grads_ref = nnx.grad(functools.partial(loss, is_causal=True))(theirs)
  assert_tree_close(nnx.state(grads, nnx.Param), nnx.state(grads_ref, nnx.Param),
                    atol=1e-4, rtol=1e-4)
