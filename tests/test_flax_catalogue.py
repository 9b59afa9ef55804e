"""The Flax wrappers of the embedding, the gated MLP and rotary embedding,
against Flax's own modules (Embed) or the same computation written with Flax
and jnp (GatedMLP, RotaryEmbedding)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxops import reference
from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_close, assert_tree_close, random_inputs


def _perturbed(tree, seed):
  return jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(seed), p.shape), tree)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["param-dtype", "bfloat16"])
def test_linen_embed_matches_flax(dtype):
  ids = jax.random.randint(jax.random.key(0), (3, 7), 0, 50)
  ours = jlinen.Embed(50, 12, dtype=dtype)
  theirs = nn.Embed(50, 12, dtype=dtype)
  params = theirs.init(jax.random.key(1), ids)
  assert jax.tree.structure(ours.init(jax.random.key(1), ids)) == jax.tree.structure(params)
  out, out_ref = ours.apply(params, ids), theirs.apply(params, ids)
  assert out.dtype == out_ref.dtype
  np.testing.assert_array_equal(out, out_ref)
  grad = jax.grad(lambda p: jnp.sum(jnp.sin(ours.apply(p, ids).astype(jnp.float32))))(params)
  grad_ref = jax.grad(lambda p: jnp.sum(jnp.sin(theirs.apply(p, ids).astype(jnp.float32))))(
      params)
  assert_tree_close(grad, grad_ref, atol=1e-2 if dtype else 1e-6, rtol=1e-2 if dtype else 1e-6)
  query, = random_inputs(2, [(4, 12)])
  assert_close(ours.apply(params, query, method="attend"),
               theirs.apply(params, query, method="attend"))


def test_linen_embed_clamps_out_of_range_ids():
  ours = jlinen.Embed(4, 3)
  params = ours.init(jax.random.key(0), jnp.zeros((1,), jnp.int32))
  out = ours.apply(params, jnp.array([-1, 4, 100]))
  table = params["params"]["embedding"]
  np.testing.assert_array_equal(out, table[jnp.array([0, 3, 3])])
  with pytest.raises(TypeError, match="Embed: inputs must have an integer dtype, got float32"):
    ours.apply(params, jnp.zeros((2,)))


def test_nnx_embed_matches_flax():
  ids = jax.random.randint(jax.random.key(3), (2, 9), 0, 30)
  ours, theirs = jnnx.Embed(30, 8, rngs=nnx.Rngs(0)), nnx.Embed(30, 8, rngs=nnx.Rngs(0))
  state = _perturbed(nnx.state(theirs, nnx.Param), 4)
  nnx.update(theirs, state)
  nnx.update(ours, state)
  np.testing.assert_array_equal(ours(ids), theirs(ids))
  loss = lambda module: jnp.sum(jnp.sin(module(ids)))
  assert_tree_close(nnx.grad(loss)(ours), nnx.grad(loss)(theirs), atol=1e-6, rtol=1e-6)
  query, = random_inputs(5, [(3, 8)])
  assert_close(ours.attend(query), theirs.attend(query))


def _gated_mlp_reference(params, x, activation):
  dense = lambda name, v: v @ params[name]["kernel"] + params[name].get("bias", 0.0)
  act = jax.nn.silu if activation == "swiglu" else jax.nn.gelu
  return dense("down", act(dense("gate", x)) * dense("up", x))


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_linen_gated_mlp(activation, use_bias):
  x, = random_inputs(6, [(2, 5, 16)])
  module = jlinen.GatedMLP(hidden_features=24, activation=activation, use_bias=use_bias)
  params = module.init(jax.random.key(7), x)
  names = {"gate": (16, 24), "up": (16, 24), "down": (24, 16)}
  for name, shape in names.items():
    assert params["params"][name]["kernel"].shape == shape
    assert ("bias" in params["params"][name]) == use_bias
  params = _perturbed(params, 8)
  assert_close(module.apply(params, x), _gated_mlp_reference(params["params"], x, activation),
               atol=1e-5, rtol=1e-5)
  grad = jax.grad(lambda p: jnp.sum(jnp.sin(module.apply(p, x))))(params)
  grad_ref = jax.grad(lambda p: jnp.sum(jnp.sin(_gated_mlp_reference(p["params"], x,
                                                                     activation))))(params)
  assert_tree_close(grad, grad_ref, atol=1e-4, rtol=1e-4)
  assert jlinen.GatedMLP(8, out_features=3).init_with_output(jax.random.key(0), x)[0].shape == (
      2, 5, 3)
  with pytest.raises(ValueError, match="GatedMLP: activation must be one of 'swiglu', 'geglu'"):
    jlinen.GatedMLP(8, activation="relu").init(jax.random.key(0), x)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_nnx_gated_mlp(activation):
  x, = random_inputs(9, [(3, 16)])
  module = jnnx.GatedMLP(16, 24, activation=activation, use_bias=True, rngs=nnx.Rngs(0))
  params = {name: {"kernel": getattr(module, name).kernel[...],
                   "bias": getattr(module, name).bias[...]} for name in ("gate", "up", "down")}
  assert_close(module(x), _gated_mlp_reference(params, x, activation), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="activation must be"):
    jnnx.GatedMLP(16, 24, activation="tanh", rngs=nnx.Rngs(0))


def test_rotary_embedding_modules():
  x, = random_inputs(10, [(2, 6, 3, 16)])
  positions = jnp.arange(6) + 5
  expected = reference.rope(x, positions, theta=500.0, style="gptj", rotary_dim=8)
  linen_module = jlinen.RotaryEmbedding(theta=500.0, style="gptj", rotary_dim=8)
  assert linen_module.init(jax.random.key(0), x, positions) == {}
  assert_close(linen_module.apply({}, x, positions), expected)
  assert_close(jnnx.RotaryEmbedding(theta=500.0, style="gptj", rotary_dim=8)(x, positions),
               expected)
