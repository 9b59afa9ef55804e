"""Every differentiable op inside ``jax.shard_map`` with its default ``check_vma=True``.

On 4 host devices (tests/conftest.py; skipped where there are fewer:
support/meshes.py), the batch axis of each op's main operands is split over
the mesh axis "d" (``P("d")``: they vary over "d") and its weights, tables,
positions and biases are passed whole (``P()``: invariant). Inside the
shard_map, ``jax.grad`` of a sum of the outputs, ``jax.jvp`` and ``jax.vmap``
must equal the same function on the whole arrays outside it: the mechanism
types every result varying over its operands' varying axes, casts invariant
operands to varying before the bind, and gives each cotangent its primal's
varying axes (a weight's gradient comes back summed over the shards, as
``out_specs=P()`` then checks).

Not here: ops with no derivative (``sample``'s integer draws,
``paged_attention`` and ``paged_kv_update`` of the inference cache, the AdamW
update) and ``moe_aux_loss``, a jnp mean over all tokens with no primitive.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops.testing import assert_tree_close, random_inputs
from support import meshes

SHARDED, WHOLE = P("d"), P()
BATCH = 8  # two rows of the batch per device


def _ints(seed, shape, high):
  return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


def _cases():
  """name: (fn, args, in_specs, argnums): fn returns the op's float outputs, of the
  batch's rows, or (a name ending in "sum") their sum: a scalar per shard."""
  x, h, w, b = random_inputs(0, [(BATCH, 3, 16), (BATCH, 3, 16), (16,), (16,)])
  w = 1.0 + 0.5 * w
  q, k, v = random_inputs(1, [(BATCH, 6, 4, 8), (BATCH, 6, 2, 8), (BATCH, 6, 2, 8)])
  (attention_bias,) = random_inputs(2, [(1, 4, 6, 6)])
  images, kernel, embed_bias = random_inputs(3, [(BATCH, 4, 4, 3), (2, 2, 3, 16), (16,)])
  table, vocab_weight = random_inputs(4, [(20, 16), (16, 24)], scale=0.5)
  dense = random_inputs(5, [(12, 16)])[0]
  sparse_w = jaxops.sparse.compress(jaxops.sparse.prune_2_4(dense)[0])
  (sparse_bias,) = random_inputs(6, [(12,)])
  labels, tokens = _ints(7, (BATCH, 3), 16), _ints(8, (BATCH, 3), 20)
  positions = jnp.arange(6, dtype=jnp.int32)

  def linear(x, values, bias):
    return jaxops.sparse.linear(x, jaxops.sparse.SparseWeight(values, sparse_w.metadata, 16),
                                bias)

  # name: (fn, [(arg, spec)], argnums)
  cases = {
      "layer_norm": (jaxops.layer_norm, [(x, SHARDED), (w, WHOLE), (b, WHOLE)], (0, 1, 2)),
      "rms_norm": (jaxops.rms_norm, [(x, SHARDED), (w, WHOLE)], (0, 1)),
      "add_rms_norm": (jaxops.add_rms_norm, [(x, SHARDED), (h, SHARDED), (w, WHOLE)],
                       (0, 1, 2)),
      "softmax": (jaxops.softmax, [(x, SHARDED)], (0,)),
      "log_softmax": (jaxops.log_softmax, [(x, SHARDED)], (0,)),
      "causal_softmax": (jaxops.causal_softmax, [(x[:, :, :3], SHARDED)], (0,)),
      "cross_entropy": (
          lambda x, labels: jaxops.cross_entropy(x, labels, label_smoothing=0.1, z_loss=1e-3,
                                                 reduction="none"),
          [(x, SHARDED), (labels, SHARDED)], (0,)),
      "cross_entropy sum": (
          lambda x, labels: jaxops.cross_entropy(x, labels, reduction="sum"),
          [(x, SHARDED), (labels, SHARDED)], (0,)),
      "linear_cross_entropy": (
          lambda x, w, labels: jaxops.linear_cross_entropy(x, w, labels, reduction="none"),
          [(x, SHARDED), (vocab_weight, WHOLE), (labels, SHARDED)], (0, 1)),
      "linear_cross_entropy sum": (
          lambda x, w, labels: jaxops.linear_cross_entropy(x, w, labels, reduction="sum"),
          [(x, SHARDED), (vocab_weight, WHOLE), (labels, SHARDED)], (0, 1)),
      "gelu": (jaxops.gelu, [(x, SHARDED)], (0,)),
      "gelu exact": (lambda x: jaxops.gelu(x, approximate=False), [(x, SHARDED)], (0,)),
      "silu": (jaxops.silu, [(x, SHARDED)], (0,)),
      "swiglu": (jaxops.swiglu, [(x, SHARDED), (h, SHARDED)], (0, 1)),
      "geglu": (jaxops.geglu, [(x, SHARDED), (h, SHARDED)], (0, 1)),
      "rope": (jaxops.rope, [(q, SHARDED), (positions, WHOLE)], (0,)),
      "embedding": (jaxops.embedding, [(table, WHOLE), (tokens, SHARDED)], (0,)),
      "attention": (
          lambda q, k, v: jaxops.attention(q, k, v, is_causal=True),
          [(q, SHARDED), (k, SHARDED), (v, SHARDED)], (0, 1, 2)),
      "attention bias residual": (
          lambda q, k, v, bias: jaxops.attention(q, k, v, bias, return_residual=True),
          [(q, SHARDED), (q, SHARDED), (q, SHARDED), (attention_bias, WHOLE)], (0, 1, 2, 3)),
      "patch_embed": (
          lambda images, kernel, bias: jaxops.patch_embed(images, kernel, bias, patch_size=2),
          [(images, SHARDED), (kernel, WHOLE), (embed_bias, WHOLE)], (0, 1, 2)),
      "topk_router": (lambda logits: jaxops.topk_router(logits, 2)[0], [(x, SHARDED)], (0,)),
      "sparse.linear": (linear, [(x, SHARDED), (sparse_w.values, WHOLE), (sparse_bias, WHOLE)],
                        (0, 1, 2)),
  }
  return {name: (fn, [a for a, _ in args], tuple(s for _, s in args), argnums)
          for name, (fn, args, argnums) in cases.items()}


CASES = _cases()


@pytest.fixture(scope="module")
def mesh():
  return meshes.make_mesh((4,), ("d",))


def _outputs(fn, args):
  out = fn(*args)
  return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _reduced(name):
  return name.endswith(" sum")


def _loss(name, fn):
  """What grad differentiates: the shards' losses add up to the loss of the whole."""
  if _reduced(name):
    return fn
  # sin weighs each output element differently: the gradient is not all ones.
  return lambda *args: sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in _outputs(fn, args))


def _in_shard_map(mesh, body, in_specs, out_specs):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("name", CASES)
def test_grad(mesh, name):
  fn, args, specs, argnums = CASES[name]
  grad = jax.grad(_loss(name, fn), argnums=argnums)
  # A whole operand's gradient is invariant: the sum of every shard's.
  inside = _in_shard_map(mesh, grad, specs, tuple(specs[i] for i in argnums))
  assert_tree_close(inside(*args), jax.jit(grad)(*args), dtype=jnp.float32)


@pytest.mark.parametrize("name", CASES)
def test_jvp(mesh, name):
  fn, args, specs, argnums = CASES[name]
  tangents = random_inputs(10, [args[i].shape for i in argnums])

  def jvp(*args_and_tangents):
    primals, tangent = args_and_tangents[:len(args)], args_and_tangents[len(args):]

    def of_differentiated(*diff):
      full = list(primals)
      for i, d in zip(argnums, diff):
        full[i] = d
      return _outputs(fn, full)

    return jax.jvp(of_differentiated, tuple(primals[i] for i in argnums), tuple(tangent))

  def per_shard(*args_and_tangents):
    # A shard's sum (a scalar) becomes its entry of a [shards] vector.
    return jax.tree.map(lambda o: o[None], jvp(*args_and_tangents))

  in_specs = (*specs, *(specs[i] for i in argnums))
  if _reduced(name):
    inside = _in_shard_map(mesh, per_shard, in_specs, SHARDED)(*args, *tangents)
    inside = jax.tree.map(lambda o: o.sum(0), inside)
  else:
    inside = _in_shard_map(mesh, jvp, in_specs, SHARDED)(*args, *tangents)
  assert_tree_close(inside, jax.jit(jvp)(*args, *tangents), dtype=jnp.float32)


@pytest.mark.parametrize("name", CASES)
def test_vmap(mesh, name):
  """vmap over a shard's rows, each a batch of one: the op's batching rule inside
  the shard_map."""
  fn, args, specs, _ = CASES[name]

  def rows(*args):
    in_axes = tuple(0 if s == SHARDED else None for s in specs)
    split = [a[:, None] if s == SHARDED else a for a, s in zip(args, specs)]
    outs = jax.vmap(lambda *a: _outputs(fn, a), in_axes=in_axes)(*split)
    return tuple(o.reshape(o.shape[:1] + o.shape[2:]) for o in outs)

  inside = _in_shard_map(mesh, rows, specs, SHARDED)
  # A sum's rows are the op on each row alone: vmap outside the shard_map.
  whole = jax.jit(rows if _reduced(name) else lambda *a: _outputs(fn, a))
  assert_tree_close(inside(*args), whole(*args), dtype=jnp.float32)


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "cross_entropy sum"])
def test_grad_without_vma_checks(mesh, name):
  """check_vma=False, where no type varies, still works. Unchecked, a whole
  operand's gradient would be one shard's: the sharded operands' are compared."""
  fn, args, specs, argnums = CASES[name]
  argnums = tuple(i for i in argnums if specs[i] == SHARDED)
  grad = jax.grad(_loss(name, fn), argnums=argnums)
  inside = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=specs, out_specs=SHARDED,
                                 check_vma=False))
  assert_tree_close(inside(*args), jax.jit(grad)(*args), dtype=jnp.float32)
