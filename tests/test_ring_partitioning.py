"""``jaxops.attention(..., context_parallel="ring")`` under ``jax.jit``: a
sequence axis sharded by a NamedSharding partitions into ring attention.

On a 2 x 2 mesh ("data", "seq"; 4 host devices, tests/conftest.py; skipped
where fewer exist: support/meshes.py), with the batch over "data" and the
sequence of q, k, v (and of the segment ids and the bias's query rows) over
"seq": values, gradients and tangents equal unsharded ``jaxops.attention``,
and the compiled programs pass K/V around the ring (collective-permute) and
all-gather nothing, in the forward and in forward+backward. Without the
option the sequence is gathered as before (tests/test_sharding.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxops
from jaxops import testing
from support import meshes

B, SEQ, HEADS, HEAD_DIM = 2, 32, 4, 8
RING = 2  # the size of the "seq" axis


@pytest.fixture(params=["auto", "explicit"])
def mesh(request):
  kind = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = meshes.make_mesh((2, RING), ("data", "seq"), kind[request.param])
  with jax.set_mesh(mesh):
    yield mesh


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _inputs(kv_heads=HEADS):
  q = _normal(0, (B, SEQ, HEADS, HEAD_DIM))
  k, v = (_normal(i, (B, SEQ, kv_heads, HEAD_DIM)) for i in (1, 2))
  return q, k, v


SEQUENCE = P("data", "seq")  # [B, S, ...] and [B, S] arrays
ROWS = P("data", None, "seq")  # a bias [B, N, T, S]: its query rows

# name: (attention keywords, kv_heads, extra operands: "segments", "bias", "sinks")
CASES = {
    "causal gqa": (dict(is_causal=True), 2, ()),
    "window offset mqa": (dict(is_causal=True, local_window_size=(6, 0), query_offset=2), 1, ()),
    "segments sinks soft cap": (dict(logits_soft_cap=3.0), HEADS, ("segments", "sinks")),
    "bias lengths": (dict(is_causal=True), HEADS, ("bias", "lengths")),
}


def _case(name):
  """(fn(q, k, v, *extras), args, their shardings, argnums to differentiate)."""
  kwargs, kv_heads, extras = CASES[name]
  args, specs = list(_inputs(kv_heads)), [SEQUENCE] * 3
  names = []
  if "segments" in extras:
    ids = jnp.repeat(jnp.array([[0, 1], [1, 2]]), SEQ // 2, axis=1).astype(jnp.int32)
    args.append(ids)
    specs.append(SEQUENCE)
    names.append("segments")
  if "bias" in extras:
    args.append(_normal(5, (B, HEADS, SEQ, SEQ)))
    specs.append(ROWS)
    names.append("bias")
  if "lengths" in extras:
    args.append(jnp.array([SEQ - 5, SEQ], jnp.int32))
    specs.append(P("data"))
    names.append("lengths")
  if "sinks" in extras:
    args.append(_normal(6, (HEADS,)))
    specs.append(P())
    names.append("sinks")

  def fn(q, k, v, *rest, **options):
    extra = dict(zip(names, rest))
    return jaxops.attention(
        q, k, v, extra.get("bias"), query_segment_ids=extra.get("segments"),
        key_value_segment_ids=extra.get("segments"), key_value_seq_lengths=extra.get("lengths"),
        sinks=extra.get("sinks"), **kwargs, **options)

  argnums = tuple(i for i, n in enumerate(["q", "k", "v", *names])
                  if n in ("q", "k", "v", "bias", "sinks"))
  return fn, args, specs, argnums


def _place(mesh, args, specs):
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]


def _value_and_grad(fn, argnums):
  loss = lambda *args: jnp.sum(jnp.sin(fn(*args)))
  return jax.jit(jax.value_and_grad(loss, argnums=argnums))


def _assert_ring(hlo):
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_sequence_runs_the_ring(mesh, case):
  fn, args, specs, argnums = _case(case)
  ring = lambda *a: fn(*a, context_parallel="ring")
  placed = _place(mesh, args, specs)

  forward = jax.jit(ring)
  out = forward(*placed)
  testing.assert_tree_close(out, fn(*args), atol=1e-5, rtol=1e-5)
  assert out.sharding.spec[:2] == SEQUENCE[:2]
  _assert_ring(forward.lower(*placed).compile().as_text())

  step = _value_and_grad(ring, argnums)
  compiled = step.lower(*placed).compile()
  testing.assert_tree_close(compiled(*placed), _value_and_grad(fn, argnums)(*args),
                            atol=1e-4, rtol=1e-4)
  _assert_ring(compiled.as_text())


def test_sharded_sequence_tangents(mesh):
  fn, args, specs, _ = _case("causal gqa")
  tangents = [0.5 * a for a in args]
  jvp = lambda f: jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))
  ring = jvp(lambda *a: fn(*a, context_parallel="ring"))
  placed = _place(mesh, args + tangents, specs * 2)
  testing.assert_tree_close(ring(*placed), jvp(fn)(*args, *tangents), atol=1e-5, rtol=1e-5)
  _assert_ring(ring.lower(*placed).compile().as_text())


def test_zigzag_layout(mesh):
  """Inputs in zigzag order (jaxops.zigzag_permute for the ring's size), the bias's
  query rows too, its keys natural: the output, put back, is attention's."""
  q, k, v = _inputs()
  bias = _normal(7, (B, HEADS, SEQ, SEQ))
  zig = lambda x, axis=1: jaxops.zigzag_permute(x, RING, axis=axis)
  ring = jax.jit(lambda q, k, v, bias: jaxops.attention(
      q, k, v, bias, is_causal=True, context_parallel="ring", context_parallel_layout="zigzag"))
  placed = _place(mesh, [zig(q), zig(k), zig(v), zig(bias, 2)], [SEQUENCE] * 3 + [ROWS])
  out = jaxops.zigzag_unpermute(np.asarray(ring(*placed)), RING, axis=1)
  testing.assert_tree_close(out, jaxops.attention(q, k, v, bias, is_causal=True),
                            atol=1e-5, rtol=1e-5)
  _assert_ring(ring.lower(*placed).compile().as_text())


def test_unsharded_and_default_programs_are_unchanged():
  """One device: the option changes nothing. Without it the jaxpr is the one
  of before (no context_parallel parameter)."""
  q, k, v = _inputs()
  np.testing.assert_array_equal(jaxops.attention(q, k, v, is_causal=True, context_parallel="ring"),
                                jaxops.attention(q, k, v, is_causal=True))
  assert "context_parallel" not in str(jax.make_jaxpr(jaxops.attention)(q, k, v))
  assert "context_parallel" in str(jax.make_jaxpr(
      lambda q, k, v: jaxops.attention(q, k, v, context_parallel="ring"))(q, k, v))


def test_context_parallel_arguments():
  q, k, v = _inputs()
  with pytest.raises(ValueError, match="context_parallel must be one of None, 'ring'"):
    jaxops.attention(q, k, v, context_parallel="all_to_all")
  with pytest.raises(ValueError, match="context_parallel_layout must be one of"):
    jaxops.attention(q, k, v, context_parallel="ring", context_parallel_layout="striped")
  with pytest.raises(ValueError, match="context_parallel_layout must be 'contiguous' without"):
    jaxops.attention(q, k, v, context_parallel_layout="zigzag")
  with pytest.raises(ValueError, match="context_parallel must be None when the query and key"):
    jaxops.attention(q[:, :8], k, v, context_parallel="ring")
