"""``jaxops.ring_attention``: attention over a sequence split along a mesh axis.

On 2, 4 and 8 host devices (tests/conftest.py asks XLA for 8; a mesh that
needs more devices than exist is skipped: support/meshes.py), with the
sequence axis of q, k, v (and of the segment ids and the bias's query rows)
split over the mesh axis "seq" of a ``jax.shard_map``: the output, the
log-sum-exp, the gradients (``jax.grad`` in q, k, v, sinks and the bias) and
the tangents (``jax.jvp``) equal single-device ``jaxops.attention`` on the
whole sequence, for both layouts (zigzag inputs reordered by
``jaxops.zigzag_permute``, outputs put back by ``zigzag_unpermute``) and both
strategies. The compiled programs: the ring has collective-permutes and no
all-gather, sends each block on in the step that uses it, and holds no K/V
buffer longer than 2 S/P (its buffers shrink as P grows), while the
all-gather strategy holds S.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops.testing import assert_tree_close, random_inputs
from support import meshes
from support.lowering import T, check_binding, custom_calls

AXIS = "seq"
SEQ, HEADS, HEAD_DIM = 32, 4, 8


def _mesh(devices):
  return meshes.make_mesh((devices,), (AXIS,))


# name: the arguments of attention (and what the inputs hold: "kv_heads", and
# "segments", "lengths", "sinks", "bias", "mask" for the operands to make).
CASES = {
    "full": {},
    "causal": {"is_causal": True},
    "window": {"local_window_size": (5, 3)},
    "causal window": {"is_causal": True, "local_window_size": (6, 0)},
    "gqa causal": {"kv_heads": 2, "is_causal": True},
    "mqa": {"kv_heads": 1},
    "segments causal": {"segments": True, "is_causal": True},
    "segments": {"segments": True},
    "soft cap causal": {"logits_soft_cap": 2.0, "is_causal": True},
    "sinks causal": {"sinks": True, "is_causal": True},
    "lengths causal": {"lengths": True, "is_causal": True},
    "bias mask": {"bias": True, "mask": True, "is_causal": True},
    "query offset": {"query_offset": 3, "is_causal": True, "local_window_size": (4, 9)},
}
# On 2 and 8 devices: every feature at once, and a window that skips steps.
EVERYTHING = {"kv_heads": 2, "is_causal": True, "segments": True, "logits_soft_cap": 3.0,
              "sinks": True, "lengths": True}
NARROW_WINDOW = {"local_window_size": (3, 0), "kv_heads": 1}

OPERANDS = ("segments", "lengths", "sinks", "bias", "mask", "kv_heads")


def _inputs(case, seq=SEQ, dtype=jnp.float32):
  """(q, k, v, extras): extras the case's other operands, by attention's names."""
  kv_heads = case.get("kv_heads", HEADS)
  q, k, v = random_inputs(0, [(1, seq, HEADS, HEAD_DIM), (1, seq, kv_heads, HEAD_DIM),
                              (1, seq, kv_heads, HEAD_DIM)], dtype=dtype)
  rng = np.random.default_rng(1)
  extras = {}
  if case.get("segments"):
    # Packed documents whose boundaries fall inside the devices' blocks.
    ids = np.repeat(np.arange(4), [7, 12, 4, seq - 23])[None]
    extras["query_segment_ids"] = extras["key_value_segment_ids"] = jnp.asarray(ids, jnp.int32)
  if case.get("lengths"):
    extras["query_seq_lengths"] = jnp.array([seq - 5], jnp.int32)
    extras["key_value_seq_lengths"] = jnp.array([seq - 11], jnp.int32)
  if case.get("sinks"):
    extras["sinks"] = jnp.asarray(rng.normal(size=(HEADS,)), jnp.float32)
  if case.get("bias"):
    extras["bias"] = jnp.asarray(rng.normal(size=(1, HEADS, seq, seq)), jnp.float32)
  if case.get("mask"):
    extras["mask"] = jnp.asarray(rng.random((1, 1, seq, seq)) < 0.8)
  return q, k, v, extras


def _static(case):
  return {k: v for k, v in case.items() if k not in OPERANDS}


# The sequence axis of each operand (None: passed whole to every device).
_SEQUENCE_AXIS = {"query_segment_ids": 1, "key_value_segment_ids": 1, "bias": 2, "mask": 2,
                  "query_seq_lengths": None, "key_value_seq_lengths": None, "sinks": None}


def _spec(axis):
  return P() if axis is None else P(*([None] * axis), AXIS)


def _ring(devices, layout="contiguous", strategy="ring", **static):
  """ring_attention on whole arrays: shard_map over the sequence, zigzag order
  applied before and undone after. Returns (out, lse)."""
  mesh = _mesh(devices)

  def order(x, axis, undo=False):
    if layout != "zigzag" or axis is None:
      return x
    move = jaxops.zigzag_unpermute if undo else jaxops.zigzag_permute
    return move(x, devices, axis=axis)

  def fn(q, k, v, extras):
    names = sorted(extras)

    def body(q, k, v, *values):
      return jaxops.ring_attention(q, k, v, axis_name=AXIS, layout=layout, strategy=strategy,
                                   return_residual=True, **dict(zip(names, values)), **static)

    specs = (_spec(1),) * 3 + tuple(_spec(_SEQUENCE_AXIS[n]) for n in names)
    args = [order(x, 1) for x in (q, k, v)]
    args += [order(extras[n], _SEQUENCE_AXIS[n]) for n in names]
    out, lse = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=_spec(1))(*args)
    return order(out, 1, undo=True), order(lse, 1, undo=True)

  return fn


def _single(**static):
  def fn(q, k, v, extras):
    return jaxops.attention(q, k, v, return_residual=True, **extras, **static)

  return fn


def _differentiable(extras):
  return [n for n in ("sinks", "bias") if n in extras]


def _everything(fn, q, k, v, extras):
  """out and lse, the gradients of a loss of both in q, k, v (and the sinks and
  bias), and the tangents of both: one program."""
  wrt = _differentiable(extras)

  def of(q, k, v, *diff):
    return fn(q, k, v, {**extras, **dict(zip(wrt, diff))})

  def loss(*args):
    out, lse = of(*args)
    # lse is -inf at rows with no key (the lengths): those rows do not count.
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(finite))

  primals = (q, k, v, *(extras[n] for n in wrt))
  tangents = tuple(random_inputs(7, [p.shape for p in primals]))
  return of(*primals), jax.grad(loss, argnums=tuple(range(len(primals))))(*primals), jax.jvp(
      of, primals, tangents)


def _check(devices, layout, case, strategy="ring"):
  q, k, v, extras = _inputs(case)
  static = _static(case)
  got = jax.jit(lambda *a: _everything(_ring(devices, layout, strategy, **static), *a))(
      q, k, v, extras)
  want = jax.jit(lambda *a: _everything(_single(**static), *a))(q, k, v, extras)
  # The gradients of K/V sum over every query row: float32 rounding of S terms.
  assert_tree_close(got, want, dtype=jnp.float32, reduce_size=SEQ)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", CASES)
def test_equals_single_device_on_4(layout, name):
  _check(4, layout, CASES[name])


@pytest.mark.parametrize("devices", [2, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", ["everything", "narrow window"])
def test_equals_single_device_on_2_and_8(devices, layout, name):
  _check(devices, layout, EVERYTHING if name == "everything" else NARROW_WINDOW)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", ["everything", "bias mask", "query offset"])
def test_all_gather_strategy_equals_single_device(layout, name):
  _check(4, layout, EVERYTHING if name == "everything" else CASES[name], strategy="all_gather")


def test_traced_query_offset_equals_static():
  """A traced offset cannot skip steps at trace time: every step runs, the kernel
  skips the empty tiles, and the answer is the same."""
  q, k, v, _ = _inputs({})
  static = dict(is_causal=True, local_window_size=(4, 0))
  traced = jax.jit(lambda q, k, v, offset: _ring(4, "zigzag", query_offset=offset, **static)(
      q, k, v, {}))(q, k, v, jnp.int32(2))
  known = jax.jit(lambda q, k, v: _ring(4, "zigzag", query_offset=2, **static)(q, k, v, {}))(
      q, k, v)
  assert_tree_close(traced, known, dtype=jnp.float32)


def test_bfloat16_equals_single_device():
  q, k, v, extras = _inputs({"sinks": True}, dtype=jnp.bfloat16)
  got = jax.jit(_ring(4, "zigzag", is_causal=True))(q, k, v, extras)
  want = jax.jit(_single(is_causal=True))(q, k, v, extras)
  # Each block's output is rounded to bfloat16 before the merge: a few ulps.
  assert_tree_close(got, want, dtype=jnp.bfloat16, reduce_size=64)


def test_reference_implementation_equals_the_kernels():
  """implementation="xla": the same ring on the jnp reference of a block."""
  q, k, v, extras = _inputs(EVERYTHING)
  static = _static(EVERYTHING)
  got = jax.jit(lambda *a: _everything(_ring(4, "zigzag", implementation="xla", **static), *a))(
      q, k, v, extras)
  want = jax.jit(lambda *a: _everything(_ring(4, "zigzag", **static), *a))(q, k, v, extras)
  assert_tree_close(got, want, dtype=jnp.float32, reduce_size=SEQ)


def test_second_order_equals_single_device():
  """Forward over reverse (a Hessian-vector product): the backward ring is
  differentiated through its reference."""
  q, k, v, _ = _inputs({"kv_heads": 2})

  def hvp(fn):
    def loss(q):
      out, lse = fn(q, k, v, {})
      return jnp.sum(jnp.sin(out)) + jnp.sum(lse)

    return jax.jit(lambda q, t: jax.jvp(jax.grad(loss), (q,), (t,)))

  (t,) = random_inputs(3, [q.shape])
  assert_tree_close(hvp(_ring(2, "zigzag", is_causal=True))(q, t),
                    hvp(_single(is_causal=True))(q, t), dtype=jnp.float32, reduce_size=SEQ)


def test_grad_and_vmap_inside_shard_map():
  """jax.grad and jax.vmap inside the shard_map (check_vma=True), and the
  shard_map called without jit and with check_vma=False."""
  mesh = _mesh(4)
  q, k, v, _ = _inputs({})
  spec = _spec(1)

  def loss(q, k, v):
    return jnp.sum(jnp.sin(jaxops.ring_attention(q, k, v, axis_name=AXIS, is_causal=True)))

  inside = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                                 in_specs=(spec,) * 3, out_specs=spec))
  single = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jaxops.attention(q, k, v, is_causal=True))),
                    argnums=(0, 1, 2))
  assert_tree_close(inside(q, k, v), jax.jit(single)(q, k, v), dtype=jnp.float32,
                    reduce_size=SEQ)

  def batched(q, k, v):  # two copies of the batch, vmapped inside the shard_map
    ring = lambda q, k, v: jaxops.ring_attention(q, k, v, axis_name=AXIS, is_causal=True)
    return jax.vmap(ring)(*(jnp.stack([x, 2 * x]) for x in (q, k, v)))

  vmapped = jax.jit(jax.shard_map(batched, mesh=mesh, in_specs=(spec,) * 3,
                                  out_specs=P(None, None, AXIS)))(q, k, v)
  want = jnp.stack([jaxops.attention(q, k, v, is_causal=True),
                    jaxops.attention(2 * q, 2 * k, 2 * v, is_causal=True)])
  assert_tree_close(vmapped, want, dtype=jnp.float32)

  eager = jax.shard_map(lambda q, k, v: jaxops.ring_attention(q, k, v, axis_name=AXIS,
                                                              layout="zigzag"),
                        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
  assert_tree_close(eager(q, k, v), jaxops.attention(q, k, v), dtype=jnp.float32)


def test_float64_runs_the_ring_on_the_reference():
  """Dtypes without a kernel: implementation=None runs the ring on the jnp
  reference of a block (values and gradients); "ffi" names the dtype."""
  with jax.enable_x64(True):
    q, k, v, _ = _inputs({"kv_heads": 2}, dtype=jnp.float64)

    def values_and_grads(fn):
      loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, {})[0]))
      return jax.jit(lambda *a: (fn(*a, {}), jax.grad(loss, argnums=(0, 1, 2))(*a)))(q, k, v)

    got = values_and_grads(_ring(4, "zigzag", is_causal=True))
    want = values_and_grads(_single(is_causal=True))
    assert got[0][0].dtype == jnp.float64
    assert_tree_close(got, want, dtype=jnp.float64, reduce_size=SEQ)
    with pytest.raises(TypeError, match=r"implementation='ffi' has no kernel for query of "
                                        r"dtype float64"):
      jax.jit(_ring(4, implementation="ffi"))(q, k, v, {})


def test_with_data_parallelism_and_over_a_tuple_of_axes():
  """On a 2 x 2 mesh: the batch over "data" and the ring over "seq"; then the ring
  over both axes at once (axis_name a tuple: 4 devices in the ring)."""
  mesh = meshes.make_mesh((2, 2), ("data", AXIS))
  q, k, v = random_inputs(0, [(2, SEQ, HEADS, HEAD_DIM), (2, SEQ, 2, HEAD_DIM),
                              (2, SEQ, 2, HEAD_DIM)])
  want = jaxops.attention(q, k, v, is_causal=True, return_residual=True)
  for axis_name, spec in ((AXIS, P("data", AXIS)), (("data", AXIS), P(None, ("data", AXIS)))):
    ring = jax.jit(jax.shard_map(
        lambda q, k, v, axis_name=axis_name: jaxops.ring_attention(
            q, k, v, axis_name=axis_name, layout="zigzag", is_causal=True,
            return_residual=True), mesh=mesh, in_specs=spec, out_specs=spec))
    size = 2 if axis_name == AXIS else 4
    permute = lambda x: jaxops.zigzag_permute(x, size)
    got = [jaxops.zigzag_unpermute(x, size) for x in ring(*map(permute, (q, k, v)))]
    assert_tree_close(got, list(want), dtype=jnp.float32)


def test_unbatched_inputs():
  q, k, v, extras = _inputs({"segments": True})
  ids = extras["query_segment_ids"][0]
  mesh = _mesh(2)
  ring = jax.jit(jax.shard_map(
      lambda q, k, v, ids: jaxops.ring_attention(
          q, k, v, axis_name=AXIS, is_causal=True, query_segment_ids=ids,
          key_value_segment_ids=ids),
      mesh=mesh, in_specs=(P(AXIS),) * 4, out_specs=P(AXIS)))
  assert_tree_close(ring(q[0], k[0], v[0], ids),
                    jaxops.attention(q[0], k[0], v[0], is_causal=True, query_segment_ids=ids,
                                     key_value_segment_ids=ids), dtype=jnp.float32)


def test_results_are_reproducible():
  """The blocks merge in the ring's fixed order: the same bits every run."""
  q, k, v, _ = _inputs({})
  fn = jax.jit(_ring(4, "zigzag", is_causal=True))
  first, second = fn(q, k, v, {}), fn(q, k, v, {})
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the compiled programs ---------------------------------------------------------------


def _compiled(devices, seq, strategy="ring", layout="contiguous", grad=False, heads=2,
              head_dim=8):
  q = k = v = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32)
  fn = _ring(devices, layout, strategy, is_causal=True)
  run = lambda q, k, v: fn(q, k, v, {})[0]
  if grad:
    run = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, {})[0] ** 2), argnums=(0, 1, 2))
  return jax.jit(run).lower(q, k, v).compile()


def _float_dims(hlo):
  """The extents of every float array in an HLO text."""
  return [int(d) for shape in re.findall(r"\bf32\[([\d,]+)\]", hlo) for d in shape.split(",")]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_sends_blocks_around_and_gathers_nothing(layout):
  hlo = _compiled(4, 64, layout=layout, grad=True).as_text()
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo
  assert "jaxops_attention_fwd" in hlo and "jaxops_attention_bwd" in hlo


def test_all_gather_strategy_gathers_once():
  hlo = _compiled(4, 64, strategy="all_gather").as_text()
  assert "all-gather" in hlo
  assert "collective-permute" not in hlo


def test_each_step_sends_its_block_while_its_kernel_runs():
  """In the ring's loop, the block a step's kernel reads is also the operand of
  that step's collective-permute (the next holder's copy): the transfer does not
  wait for the kernel, so XLA can overlap them."""
  hlo = _compiled(4, 64).as_text()
  bodies = [c for c in re.split(r"\n(?=%|ENTRY)", hlo) if "while/body" in c
            and "collective-permute(" in c and "jaxops_attention_fwd" in c]
  assert bodies, "no loop body holds both the transfer and the kernel"
  for body in bodies:
    sent = set(re.findall(r"collective-permute\((%[\w.-]+)\)", body))
    kernels = re.findall(r"custom-call\(([^)]*)\).*jaxops_attention_fwd", body)
    assert kernels
    read = {operand.strip() for call in kernels for operand in call.split(",")}
    assert sent & read, (sent, read)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward and backward"])
def test_ring_memory_is_per_block(grad):
  """S = 32k over 8 devices: no float buffer longer than 2 S/P in the ring's
  program; the all-gather strategy holds S. Going from 4 to 8 devices halves
  the ring's temporary memory, and leaves the all-gather's as it is."""
  seq = 32768
  ring = _compiled(8, seq, grad=grad)
  assert max(_float_dims(ring.as_text())) <= 2 * seq // 8
  gathered = _compiled(8, seq, strategy="all_gather", grad=grad)
  assert seq in _float_dims(gathered.as_text())
  temp = lambda compiled: compiled.memory_analysis().temp_size_in_bytes
  assert temp(ring) < 0.65 * temp(_compiled(4, seq, grad=grad))
  assert temp(ring) < 0.5 * temp(gathered)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_lowers_to_the_cuda_targets(dtype):
  """Lowered for CUDA (no GPU needed): the forward, forward-mode and backward
  rings call attention's CUDA targets with the operands and attributes their
  handlers bind, and the bias gradient (with_dbias) only where it is wanted."""
  case = {"bias": True, "segments": True, "lengths": True, "is_causal": True}
  q, k, v, extras = _inputs(case, dtype=getattr(jnp, dtype))
  ring = _ring(4, "zigzag", **_static(case))

  def both_modes(q, k, v, bias):
    primals = (q, k, v, bias)
    of = lambda *p: ring(*p[:3], {**extras, "bias": p[3]})[0].astype(jnp.float32)
    grads = jax.grad(lambda *p: of(*p).sum(), argnums=(0, 1, 2, 3))(*primals)
    return grads, jax.jvp(of, primals, primals)[1]

  calls = custom_calls(both_modes, q, k, v, extras["bias"])
  targets = {call.target for call in calls}
  assert targets == {"jaxops_attention_fwd", "jaxops_attention_fwd_jvp", "jaxops_attention_bwd"}
  for call in calls:
    check_binding(call, dtype, _CUDA_BUFFERS)
    # Each call sees one zigzag chunk of queries and keys: 32 / (2 * 4) rows.
    assert call.operands[0][0] == (1, SEQ // 8, HEADS, HEAD_DIM)
    if call.target == "jaxops_attention_bwd":
      assert "with_dbias = true" in call.text


# q, k, v, bias, mask, the two sequence lengths, the two segment ids, query_offset.
_OPERANDS = (T, T, T, "f32", "i1", "i32", "i32", "i32", "i32", "i32")
_CUDA_BUFFERS = {
    "jaxops_attention_fwd": (_OPERANDS, (T, "f32", "ui8")),
    "jaxops_attention_bwd": ((*_OPERANDS, T, "f32", T, "f32"), (T, T, T, "f32", "ui8")),
    "jaxops_attention_fwd_jvp": ((*_OPERANDS, T, T, T, "f32"), (T, "f32", T, "f32")),
}


# -- the zigzag layout, and bad input ---------------------------------------------------------


def test_zigzag_permute_puts_chunks_i_and_2p_minus_1_minus_i_together():
  x = jnp.arange(16).reshape(1, 16)
  z = jaxops.zigzag_permute(x, 4)
  np.testing.assert_array_equal(z.reshape(4, 4)[1], [2, 3, 12, 13])  # device 1: chunks 1, 6
  np.testing.assert_array_equal(jaxops.zigzag_unpermute(z, 4), x)
  np.testing.assert_array_equal(jaxops.zigzag_permute(x.T, 2, axis=0)[:, 0],
                                [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  with jax.enable_x64(True):  # a reordering: any dtype keeps its values and dtype
    for dtype in (jnp.float64, jnp.complex64, jnp.bfloat16, jnp.bool_):
      y = jnp.arange(8).astype(dtype)
      z = jaxops.zigzag_permute(y, 2, axis=0)
      assert z.dtype == dtype
      np.testing.assert_array_equal(jaxops.zigzag_unpermute(z, 2, axis=0), y)


def test_zigzag_permute_rejects_a_length_not_divisible_by_2p():
  with pytest.raises(ValueError, match=r"zigzag_permute: x must have a length along axis 1 "
                                       r"divisible by 2 \* axis_size = 8"):
    jaxops.zigzag_permute(jnp.zeros((1, 12)), 4)


def _in_shard_map(body, devices=2, specs=None):
  mesh = _mesh(devices)
  q = jnp.zeros((1, 12, 2, 8))
  specs = specs or (_spec(1),) * 3
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=_spec(1)))(q, q, q)


@pytest.mark.parametrize("argument,value,message", [
    ("layout", "striped", r"layout must be one of 'contiguous', 'zigzag', got str 'striped'"),
    ("strategy", "ulysses", r"strategy must be one of 'ring', 'all_gather', got str 'ulysses'"),
    ("axis_name", "model", r"axis_name must name an axis of the enclosing jax.shard_map"),
])
def test_bad_arguments_are_named(argument, value, message):
  kwargs = {"axis_name": AXIS, argument: value}
  with pytest.raises(ValueError, match=message):
    _in_shard_map(lambda q, k, v: jaxops.ring_attention(q, k, v, **kwargs))


def test_zigzag_needs_an_even_local_length():
  with pytest.raises(ValueError, match=r"query must have an even local sequence length under "
                                       r"layout='zigzag'.*got local length 3"):
    _in_shard_map(lambda q, k, v: jaxops.ring_attention(q, k, v, axis_name=AXIS,
                                                        layout="zigzag"), devices=4)


def test_outside_shard_map_is_an_error():
  q = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(ValueError, match=r"axis_name must name an axis"):
    jaxops.ring_attention(q, q, q, axis_name=AXIS)


def test_query_that_is_not_split_is_an_error():
  with pytest.raises(ValueError, match=r"query must be this device's block of a sequence split "
                                       r"over 'seq'"):
    _in_shard_map(lambda q, k, v: jaxops.ring_attention(q, k, v, axis_name=AXIS),
                  specs=(P(), _spec(1), _spec(1)))
