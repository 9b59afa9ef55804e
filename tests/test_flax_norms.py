"""The Flax norm wrappers against Flax's own LayerNorm and RMSNorm, argument by
argument: the same parameter trees from the same init rng, the same outputs (and
gradients) on shared parameters. Configurations the kernel cannot run (several
reduction axes, features on another axis, a mask, axis_name, reductions in the
input's dtype, complex inputs) run Flax's own computation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from support.flax_twins import linen_twins, nnx_twins

from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_tree_close, custom_call_targets, random_inputs

_normal = nn.initializers.normal(0.5)
_MASK = jnp.array([[True, True, False, True, True, True, False, True]] * 3)

# (module, constructor arguments, input shape, input dtype, call arguments,
#  whether the jaxops kernel runs: else Flax's own computation)
CASES = [
    ("LayerNorm", {}, (3, 8), jnp.float32, {}, True),
    ("LayerNorm", dict(use_bias=False, epsilon=1e-3), (3, 8), jnp.float32, {}, True),
    ("LayerNorm", dict(use_scale=False), (3, 8), jnp.float32, {}, True),
    ("LayerNorm", dict(use_scale=False, use_bias=False), (3, 8), jnp.bfloat16, {}, True),
    ("LayerNorm", dict(scale_init=_normal, bias_init=_normal), (3, 8), jnp.float32, {}, True),
    ("LayerNorm", dict(use_fast_variance=False), (3, 8), jnp.float32, {}, True),
    ("LayerNorm", dict(dtype=jnp.bfloat16), (3, 8), jnp.float32, {}, True),
    ("LayerNorm", dict(param_dtype=jnp.bfloat16), (3, 8), jnp.bfloat16, {}, True),
    ("LayerNorm", {}, (3, 8), jnp.bfloat16, {}, True),
    ("LayerNorm", dict(force_float32_reductions=False), (3, 8), jnp.bfloat16, {}, False),
    ("LayerNorm", dict(reduction_axes=(-2, -1)), (2, 3, 8), jnp.float32, {}, False),
    ("LayerNorm", dict(reduction_axes=(1, 2), feature_axes=(-2, -1)), (2, 3, 8), jnp.float32, {},
     False),
    ("LayerNorm", dict(reduction_axes=1, feature_axes=1), (2, 3, 8), jnp.float32, {}, False),
    ("LayerNorm", {}, (3, 8), jnp.float32, dict(mask=_MASK), False),
    ("LayerNorm", {}, (3, 8), jnp.complex64, {}, False),
    ("RMSNorm", {}, (3, 8), jnp.float32, {}, True),
    ("RMSNorm", dict(use_scale=False, epsilon=1e-2), (3, 8), jnp.float32, {}, True),
    ("RMSNorm", dict(scale_init=_normal, dtype=jnp.bfloat16), (3, 8), jnp.float32, {}, True),
    ("RMSNorm", {}, (3, 8), jnp.bfloat16, {}, True),
    ("RMSNorm", dict(force_float32_reductions=False), (3, 8), jnp.bfloat16, {}, False),
    ("RMSNorm", dict(reduction_axes=(-2, -1)), (2, 3, 8), jnp.float32, {}, False),
    ("RMSNorm", dict(reduction_axes=(0, 1), feature_axes=0), (2, 3, 8), jnp.float32, {}, False),
    ("RMSNorm", {}, (3, 8), jnp.float32, dict(mask=_MASK), False),
]
_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def _inputs(shape, dtype):
  if jnp.issubdtype(dtype, jnp.complexfloating):
    re, im = random_inputs(0, [shape, shape])
    return (re + 1j * im).astype(dtype)
  return random_inputs(0, [shape], dtype)[0]


def _loss(out):
  return jnp.sum(jnp.sin(jnp.real(out).astype(jnp.float32)))


@pytest.mark.parametrize("name,kwargs,shape,dtype,call,kernel", CASES, ids=_IDS)
def test_linen_matches_flax(name, kwargs, shape, dtype, call, kernel):
  x = _inputs(shape, dtype)
  ours, theirs = getattr(jlinen, name)(**kwargs), getattr(nn, name)(**kwargs)
  compute = kwargs.get("dtype", dtype)
  params = linen_twins(ours, theirs, (x,), call=call, dtype=compute, reduce_size=shape[-1])
  assert bool(custom_call_targets(lambda v: ours.apply(params, v, **call), x)) == kernel
  grad = jax.grad(lambda p: _loss(ours.apply(p, x, **call)))(params)
  grad_ref = jax.grad(lambda p: _loss(theirs.apply(p, x, **call)))(params)
  low = jnp.dtype(compute).itemsize < 4
  assert_tree_close(grad, grad_ref, atol=5e-2 if low else 1e-4, rtol=5e-2 if low else 1e-4)


@pytest.mark.parametrize("name,kwargs,shape,dtype,call,kernel", CASES, ids=_IDS)
def test_nnx_matches_flax(name, kwargs, shape, dtype, call, kernel):
  feature_axes = kwargs.get("feature_axes", -1)
  if not isinstance(feature_axes, int):
    pytest.skip("nnx norms have one feature axis (num_features)")
  x = _inputs(shape, dtype)
  if "force_float32_reductions" in kwargs:  # linen only: nnx reduces in float32
    kwargs, kernel = {k: v for k, v in kwargs.items() if k != "force_float32_reductions"}, True
  ours = getattr(jnnx, name)(shape[feature_axes], **kwargs, rngs=nnx.Rngs(0))
  theirs = getattr(nnx, name)(shape[feature_axes], **kwargs, rngs=nnx.Rngs(0))
  nnx_twins(ours, theirs, (x,), call=call, dtype=kwargs.get("dtype", dtype),
            reduce_size=shape[-1])
  assert bool(custom_call_targets(lambda v: ours(v, **call), x)) == kernel


def test_axis_name_statistics_across_a_mapped_axis():
  """``axis_name``: the mean and variance over the vmapped axis too (Flax's
  cross-device statistics), so Flax's own computation runs."""
  x, = random_inputs(1, [(4, 3, 8)])
  for name in ("LayerNorm", "RMSNorm"):
    ours, theirs = getattr(jlinen, name)(axis_name="i"), getattr(nn, name)(axis_name="i")
    params = getattr(nn, name)().init(jax.random.key(0), x[0])  # the same tree
    apply = lambda m: jax.vmap(lambda v: m.apply(params, v), axis_name="i")(x)
    assert_tree_close(apply(ours), apply(theirs), reduce_size=32)
    module = getattr(jnnx, name)(8, axis_name="i", rngs=nnx.Rngs(0))
    twin = getattr(nnx, name)(8, axis_name="i", rngs=nnx.Rngs(0))
    run = lambda m: nnx.vmap(lambda m, v: m(v), in_axes=(None, 0), axis_name="i")(m, x)
    assert_tree_close(run(module), run(twin), reduce_size=32)
