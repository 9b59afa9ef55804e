"""A jaxops Flax wrapper against its Flax twin: the same parameter tree from the
same init rng, then the same outputs on shared, perturbed parameters."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxops.testing import assert_tree_close


def perturbed(tree, seed=2):
  """Parameters moved off their initial values (ones and zeros hide mistakes)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
  moved = [p + (0.1 * jax.random.normal(k, p.shape)).astype(p.dtype)
           if jnp.issubdtype(p.dtype, jnp.inexact) else p for p, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, moved)


def assert_same_tree(actual, expected):
  """Same structure (nnx variable types included), shapes, dtypes and values."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert (a.shape, a.dtype) == (e.shape, e.dtype)
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):  # nnx's dropout streams
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    np.testing.assert_array_equal(a, e)


def linen_twins(ours, theirs, args, *, call=None, apply=None, rngs=None, **close):
  """Inits both with the same rngs, compares the trees, applies both to the
  perturbed Flax parameters and compares the outputs; returns the parameters.
  ``call``: call arguments (init and apply); ``apply``: arguments of ``apply``
  only (``mutable``...); ``rngs``: extra rng streams (``dropout``...)."""
  call, apply, rngs = call or {}, apply or {}, rngs or {}
  init_rngs = {"params": jax.random.key(1), **rngs}
  params = theirs.init(init_rngs, *args, **call)
  assert_same_tree(ours.init(init_rngs, *args, **call), params)
  params = perturbed(params)
  out = ours.apply(params, *args, **call, **apply, rngs=rngs)
  out_ref = theirs.apply(params, *args, **call, **apply, rngs=rngs)
  assert_same_dtypes_and_close(out, out_ref, **close)
  return params


def nnx_twins(ours, theirs, args, *, call=None, **close):
  """``ours`` and ``theirs`` built with the same Rngs: compares their states,
  gives both the perturbed parameters, and compares the outputs. ``call``: the
  call arguments, or a function giving them afresh for each module (an
  ``nnx.Rngs`` is consumed by the call)."""
  arguments = call if callable(call) else lambda: call or {}
  assert_same_tree(nnx.state(ours), nnx.state(theirs))
  params = perturbed(nnx.state(theirs, nnx.Param))
  nnx.update(theirs, params)
  nnx.update(ours, params)
  out, out_ref = ours(*args, **arguments()), theirs(*args, **arguments())
  assert_same_dtypes_and_close(out, out_ref, **close)


def assert_same_dtypes_and_close(actual, expected, **close):
  """Same tree structure and dtypes, and close (complex leaves: real and
  imaginary parts)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  assert jax.tree.map(lambda a: a.dtype, actual) == jax.tree.map(lambda a: a.dtype, expected)
  parts = lambda tree: jax.tree.map(
      lambda a: (a.real, a.imag) if jnp.iscomplexobj(a) else a, tree)
  assert_tree_close(parts(actual), parts(expected), **close)
