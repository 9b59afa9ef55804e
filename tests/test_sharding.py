"""Sharding rules: every op runs on its local shards of a sharded input.

On a 4 x 2 mesh (8 host CPU devices: tests/conftest.py; skipped on a GPU
machine with fewer GPUs: support/meshes.py): values and gradients equal the
unsharded run, outputs keep the input's sharding, and the compiled program
has no all-gather (the check JAX's own custom_partitioning docs use). A
sharding an op cannot honour (the normalised axis, attention's sequence axis)
falls back to XLA gathering the operand, and the answer is still right.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxops
from jaxops import testing
from support import meshes


# Auto axes: the user shards the inputs and XLA (Shardy) propagates; Explicit
# axes: shardings are part of the types (jax.make_mesh's default).
@pytest.fixture(params=["auto", "explicit"])
def mesh(request):
  kind = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = meshes.make_mesh((4, 2), ("data", "model"), kind[request.param])
  with jax.set_mesh(mesh):  # explicit axes are used under their mesh, as JAX asks
    yield mesh


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _loss_and_grads(fn, argnums):
  def loss(*args):
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    # Weight each output so that the gradient is not a trivial all-ones one.
    return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in outs)

  return jax.jit(jax.value_and_grad(loss, argnums=argnums))


def _run_sharded(mesh, fn, args, specs, argnums):
  """(sharded result, unsharded result, compiled HLO text of the sharded run)."""
  step = _loss_and_grads(fn, argnums)
  placed = [a if s is None else jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip(args, specs)]
  compiled = step.lower(*placed).compile()
  return compiled(*placed), step(*args), compiled.as_text()


def _forward_sharding(mesh, fn, args, specs):
  placed = [a if s is None else jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip(args, specs)]
  out = jax.jit(fn)(*placed)
  return (out if isinstance(out, tuple) else (out,))[0].sharding.spec


x3 = _normal(0, (8, 12, 32))
w = _normal(1, (32,))
labels = jax.random.randint(jax.random.key(2), (8, 12), 0, 32)
heads_x = _normal(3, (4, 16, 8, 32))
positions = jnp.arange(16, dtype=jnp.int32)
table = _normal(4, (50, 32))
ids = jax.random.randint(jax.random.key(5), (8, 12), 0, 50)
q = _normal(6, (4, 16, 8, 32))
kv = _normal(7, (4, 16, 2, 32))
bias = _normal(8, (1, 8, 16, 16))
w_vocab = _normal(15, (32, 40)) * 0.2
segment_ids = jnp.repeat(jnp.array([[0, 1], [2, 2], [3, 4], [5, 6]], jnp.int32), 8, axis=1)

# name: (fn, args, shardings of the args, argnums differentiated)
LOCAL_CASES = {
    "layer_norm rows": (lambda x, w: jaxops.layer_norm(x, w, w), [x3, w],
                        [P("data", "model"), None], (0, 1)),
    "rms_norm rows": (lambda x, w: jaxops.rms_norm(x, w), [x3, w], [P("data"), None], (0, 1)),
    "add_rms_norm rows": (lambda x, h, w: jaxops.add_rms_norm(x, h, w), [x3, 2 * x3, w],
                          [P("data"), P("data"), None], (0, 1, 2)),
    "softmax rows": (jaxops.softmax, [x3], [P("data", "model")], (0,)),
    "log_softmax rows": (jaxops.log_softmax, [x3], [P("data")], (0,)),
    "causal_softmax batch": (jaxops.causal_softmax, [_normal(9, (8, 16, 16))], [P("data")], (0,)),
    "cross_entropy tokens": (lambda x, l: jaxops.cross_entropy(x, l), [x3, labels],
                             [P("data"), P("data")], (0,)),
    "cross_entropy per token": (lambda x, l: jaxops.cross_entropy(x, l, reduction="none"),
                                [x3, labels], [P("data", "model"), P("data", "model")], (0,)),
    "linear_cross_entropy tokens": (
        lambda x, w, l: jaxops.linear_cross_entropy(x, w, l), [x3.reshape(96, 32), w_vocab,
                                                               labels.reshape(96)],
        [P("data"), None, P("data")], (0, 1)),
    "gelu any axis": (jaxops.gelu, [x3], [P("data", None, "model")], (0,)),
    "swiglu any axis": (jaxops.swiglu, [x3, 2 * x3], [P(None, "data", "model")] * 2, (0, 1)),
    "rope batch and heads": (lambda x: jaxops.rope(x, positions), [heads_x],
                             [P("data", None, "model")], (0,)),
    "embedding tokens": (jaxops.embedding, [table, ids], [None, P("data")], (0,)),
    "embedding columns": (jaxops.embedding, [table, ids], [P(None, "model"), P("data")], (0,)),
    "attention batch and heads (GQA)": (
        lambda q, k, v: jaxops.attention(q, k, v, is_causal=True), [q, kv, 2 * kv],
        [P("data", None, "model")] * 3, (0, 1, 2)),
    "attention heads (MQA)": (
        lambda q, k, v: jaxops.attention(q, k, v), [q, kv[:, :, :1], kv[:, :, 1:]],
        [P("data", None, "model"), P("data"), P("data")], (0, 1, 2)),
    "attention broadcast bias": (
        lambda q, k, v, b: jaxops.attention(q, k, v, bias=b), [q, q, 2 * q, bias],
        [P("data"), P("data"), P("data"), None], (0, 1, 2, 3)),
    # Segment ids follow the batch; a value head dim of its own, a soft cap and
    # sinks (merged after the kernel, per head) change nothing in the layout.
    "attention packed, capped, sinks, Hv != H": (
        lambda q, k, v, qs, ks: jaxops.attention(
            q, k, v, is_causal=True, logits_soft_cap=5.0, query_segment_ids=qs,
            key_value_segment_ids=ks, sinks=np.linspace(-1.0, 1.0, 8, dtype=np.float32)),
        [q, kv, kv[..., :24], segment_ids, segment_ids],
        [P("data", None, "model")] * 3 + [P("data"), P("data")], (0, 1, 2)),
}


@pytest.mark.parametrize("case", sorted(LOCAL_CASES))
def test_sharded_op_runs_locally(mesh, case):
  fn, args, specs, argnums = LOCAL_CASES[case]
  sharded, unsharded, hlo = _run_sharded(mesh, fn, args, specs, argnums)
  testing.assert_tree_close(sharded, unsharded, dtype=jnp.float32)
  assert "all-gather" not in hlo
  # The kernel itself runs, on each shard.
  assert "custom_call_target=\"jaxops_" in hlo


@pytest.mark.parametrize("case", ["layer_norm rows", "attention batch and heads (GQA)",
                                  "embedding columns", "gelu any axis"])
def test_output_keeps_input_sharding(mesh, case):
  fn, args, specs, _ = LOCAL_CASES[case]
  spec = _forward_sharding(mesh, fn, args, specs)
  expected = {"embedding columns": P("data", None, "model")}.get(case, specs[0])
  assert tuple(spec) + (None,) * 4 == tuple(expected) + (None,) * (4 + len(spec) - len(expected))


FALLBACK_CASES = {
    "layer_norm feature axis": (lambda x, w: jaxops.layer_norm(x, w, w), [x3, w],
                                [P(None, None, "data"), None], (0, 1)),
    "attention query sequence": (lambda q, k, v: jaxops.attention(q, k, v), [q, q, q],
                                 [P(None, "data"), None, None], (0, 1, 2)),
    "softmax softmax axis": (jaxops.softmax, [x3], [P(None, None, "model")], (0,)),
}


@pytest.mark.parametrize("case", sorted(FALLBACK_CASES))
def test_unsupported_sharding_gathers_and_stays_right(mesh, case):
  fn, args, specs, argnums = FALLBACK_CASES[case]
  if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
    with pytest.raises(ValueError, match="keeps whole"):
      _run_sharded(mesh, fn, args, specs, argnums)
    return
  sharded, unsharded, hlo = _run_sharded(mesh, fn, args, specs, argnums)
  testing.assert_tree_close(sharded, unsharded, dtype=jnp.float32)
  assert "all-gather" in hlo


# Forward mode: the tangent kernels (and attention's fused one) shard like the forward.
JVP_CASES = ["layer_norm rows", "add_rms_norm rows", "softmax rows", "cross_entropy per token",
             "linear_cross_entropy tokens", "swiglu any axis", "rope batch and heads",
             "embedding columns", "attention batch and heads (GQA)", "attention broadcast bias"]


@pytest.mark.parametrize("case", JVP_CASES)
def test_sharded_jvp_runs_locally(mesh, case):
  fn, args, specs, argnums = LOCAL_CASES[case]

  def jvp(*args):
    primals = [args[i] for i in argnums]

    def restricted(*p):
      full = list(args)
      for i, x in zip(argnums, p):
        full[i] = x
      return fn(*full)

    return jax.jvp(restricted, primals, [0.5 * x for x in primals])

  placed = [a if s is None else jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip(args, specs)]
  compiled = jax.jit(jvp).lower(*placed).compile()
  testing.assert_tree_close(compiled(*placed), jax.jit(jvp)(*args), dtype=jnp.float32)
  assert "all-gather" not in compiled.as_text()


def test_vmap_of_grad_under_sharding(mesh):
  """Per-example weight gradients (several groups) with sharded rows."""
  def per_example(x, w):
    return jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(jaxops.rms_norm(x, w))), argnums=1),
                    in_axes=(0, None))(x, w)

  placed = jax.device_put(x3, NamedSharding(mesh, P("data")))
  testing.assert_close(jax.jit(per_example)(placed, w), jax.jit(per_example)(x3, w), dtype=jnp.float32)


def test_one_device_lowers_straight_to_the_kernel():
  hlo = jax.jit(lambda x: jaxops.rms_norm(x, w)).lower(x3).as_text()
  assert "jaxops_rms_norm_fwd" in hlo and "CustomSPMDPartitioning" not in hlo


def test_sharded_training_step_matches_unsharded(mesh):
  """A small block (norm, attention, gated MLP, loss) trained data- and head-parallel."""
  params = {"w_norm": w, "wq": _normal(10, (32, 32)) * 0.2, "wo": _normal(11, (32, 32)) * 0.2,
            "w_out": _normal(12, (32, 32)) * 0.2}

  def loss(params, x, labels):
    h = jaxops.rms_norm(x, params["w_norm"])
    qkv = (h @ params["wq"]).reshape(*h.shape[:-1], 4, 8)
    a = jaxops.attention(qkv, qkv, qkv, is_causal=True).reshape(h.shape) @ params["wo"]
    h = jaxops.swiglu(a, h) + x
    return jaxops.cross_entropy(h @ params["w_out"], labels)

  step = jax.jit(jax.value_and_grad(loss))
  xs = jax.device_put(x3, NamedSharding(mesh, P("data")))
  ls = jax.device_put(labels, NamedSharding(mesh, P("data")))
  testing.assert_tree_close(step(params, xs, ls), step(params, x3, labels), dtype=jnp.float32)


def test_adamw_updates_sharded_parameters_in_place(mesh):
  """FSDP-style: parameters and moments sharded, each shard updated locally;
  two leaves sharded over the same mesh axes (the kernel's one call for all
  leaves is then partitioned leaf by leaf)."""
  tx = jaxops.optim.adamw(1e-2, weight_decay=0.1, implementation="ffi")
  params = {"w": _normal(13, (16, 32)), "u": _normal(15, (8, 32))}
  grads = {"w": _normal(14, (16, 32)), "u": _normal(16, (8, 32))}

  def update(params, grads):
    updates, state = tx.update(grads, tx.init(params), params)
    return updates, state.mu, state.nu

  placed = [jax.device_put(a, NamedSharding(mesh, P("data", "model"))) for a in (params, grads)]
  compiled = jax.jit(update).lower(*placed).compile()
  testing.assert_tree_close(compiled(*placed), jax.jit(update)(params, grads), dtype=jnp.float32)
  assert "all-gather" not in compiled.as_text()
