"""The Flax norm wrappers against Flax's own modules with the same parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_tree_close, random_inputs

CASES = [
    ("LayerNorm", dict()), ("LayerNorm", dict(use_bias=False)),
    ("LayerNorm", dict(use_scale=False, epsilon=1e-3)), ("RMSNorm", dict()),
    ("RMSNorm", dict(use_scale=False)),
]


@pytest.mark.parametrize("name,kwargs", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_linen_matches_flax(name, kwargs, dtype):
  x, = random_inputs(0, [(2, 5, 24)], dtype)
  ours, theirs = getattr(jlinen, name)(**kwargs), getattr(nn, name)(**kwargs)
  params = theirs.init(jax.random.key(1), x)
  # Non-trivial parameters, shared by both modules: same names and shapes.
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
  assert jax.tree.structure(ours.init(jax.random.key(1), x)) == jax.tree.structure(params)
  out, out_ref = ours.apply(params, x), theirs.apply(params, x)
  assert out.dtype == out_ref.dtype
  assert_tree_close(out, out_ref, dtype=dtype, reduce_size=24)
  grad = jax.grad(lambda p: jnp.sum(jnp.sin(ours.apply(p, x).astype(jnp.float32))))(params)
  grad_ref = jax.grad(lambda p: jnp.sum(jnp.sin(theirs.apply(p, x).astype(jnp.float32))))(params)
  assert_tree_close(grad, grad_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,kwargs", CASES)
def test_nnx_matches_flax(name, kwargs):
  x, = random_inputs(3, [(4, 24)])
  ours = getattr(jnnx, name)(24, **kwargs, rngs=nnx.Rngs(0))
  theirs = getattr(nnx, name)(24, **kwargs, rngs=nnx.Rngs(0))
  state = nnx.state(theirs, nnx.Param)
  state = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(4), p.shape), state)
  nnx.update(theirs, state)
  nnx.update(ours, state)
  assert_tree_close(ours(x), theirs(x), reduce_size=24)

  def loss(module, x):
    return jnp.sum(jnp.sin(module(x)))

  assert_tree_close(nnx.grad(loss)(ours, x), nnx.grad(loss)(theirs, x), atol=1e-4, rtol=1e-4)
