"""The Flax wrappers of the embedding, the gated MLP and rotary embedding,
against Flax's own modules (Embed) or the same computation written with Flax
and jnp (GatedMLP, RotaryEmbedding)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.flax_twins import assert_same_dtypes_and_close, linen_twins, nnx_twins, perturbed

from jaxops import reference
from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_close, assert_tree_close, custom_call_targets, random_inputs


def _linen_half(*args, dtype=None, inexact=True):
  return nn.dtypes.promote_dtype(*args, dtype=jnp.float16, inexact=inexact)


def _nnx_half(args, /, *, dtype=None, inexact=True):
  return nnx.nn.dtypes.promote_dtype(args, dtype=jnp.float16, inexact=inexact)


_IDS = jax.random.randint(jax.random.key(0), (3, 7), 0, 20)
# (constructor arguments, ids, whether the kernel runs: else Flax's jnp.take)
EMBED_CASES = [
    ({}, _IDS, True),
    (dict(dtype=jnp.bfloat16), _IDS, True),
    (dict(param_dtype=jnp.bfloat16), _IDS.astype(jnp.uint8), True),
    (dict(embedding_init=nn.initializers.normal(2.0)), _IDS[0], True),
    (dict(promote_dtype="half"), _IDS, True),
    (dict(param_dtype=jnp.complex64), _IDS, False),
    (dict(num_embeddings=1), jnp.zeros((2, 3), jnp.int32), True),
]


def _embed_kwargs(kwargs, half):
  kwargs = {"num_embeddings": 20, "features": 6, **kwargs}
  return {**kwargs, "promote_dtype": half} if "promote_dtype" in kwargs else kwargs


@pytest.mark.parametrize("kwargs,ids,kernel", EMBED_CASES)
def test_linen_embed_matches_flax(kwargs, ids, kernel):
  kwargs = _embed_kwargs(kwargs, _linen_half)
  ours, theirs = jlinen.Embed(**kwargs), nn.Embed(**kwargs)
  params = linen_twins(ours, theirs, (ids,))
  assert bool(custom_call_targets(lambda i: ours.apply(params, i), ids)) == kernel
  query, = random_inputs(2, [(4, 6)])
  assert_same_dtypes_and_close(ours.apply(params, query, method="attend"),
                               theirs.apply(params, query, method="attend"))
  if not kernel:
    return
  loss = lambda m: lambda p: jnp.sum(jnp.sin(m.apply(p, ids).astype(jnp.float32)))
  assert_tree_close(jax.grad(loss(ours))(params), jax.grad(loss(theirs))(params),
                    atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kwargs,ids,kernel", EMBED_CASES)
def test_nnx_embed_matches_flax(kwargs, ids, kernel):
  kwargs = _embed_kwargs(kwargs, _nnx_half)
  ours, theirs = jnnx.Embed(**kwargs, rngs=nnx.Rngs(0)), nnx.Embed(**kwargs, rngs=nnx.Rngs(0))
  nnx_twins(ours, theirs, (ids,))
  graph, state = nnx.split(ours)
  assert bool(custom_call_targets(lambda s, i: nnx.merge(graph, s)(i), state, ids)) == kernel
  query, = random_inputs(5, [(3, 6)])
  assert_same_dtypes_and_close(ours.attend(query), theirs.attend(query))


def test_linen_embed_clamps_out_of_range_ids():
  ours = jlinen.Embed(4, 3)
  params = ours.init(jax.random.key(0), jnp.zeros((1,), jnp.int32))
  out = ours.apply(params, jnp.array([-1, 4, 100]))
  table = params["params"]["embedding"]
  np.testing.assert_array_equal(out, table[jnp.array([0, 3, 3])])
  with pytest.raises(TypeError, match="Embed: inputs must have an integer dtype, got float32"):
    ours.apply(params, jnp.zeros((2,)))


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
  params = perturbed(params, 8)
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
