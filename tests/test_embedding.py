"""embedding against its jnp reference.

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/embedding.cu) in the harness (tests/support/backends.py), which runs every
CUDA thread, so it leaves out the largest case. The rest (rules, kernel
selection, validation) are backend-independent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from support import backends
from jaxops.testing import (
    FLOAT_DTYPES,
    assert_close,
    check_transformations,
    custom_call_targets,
    jvp_against_reference,
    random_inputs,
    scalarize,
    upcast,
    vjp_against_reference,
    vmap_against_loop,
)

# (vocab, dim), ids shape: size 1, primes, scalar ids, many ids per row, and
# one large enough to run on several threads.
CASES = [((1, 1), ()), ((7, 3), (5,)), ((13, 1), (2, 3)), ((31, 17), (4, 1, 9)),
         ((257, 130), (64, 3)), ((5, 64), (1000,)), ((4099, 16), (2, 300))]


def _ids(seed, vocab, shape, out_of_range=True):
  """Random ids, with some out of range on both sides when asked."""
  low, high = (-3, vocab + 3) if out_of_range else (0, vocab)
  return jax.random.randint(jax.random.key(seed), shape, low, high, jnp.int32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("table_shape,ids_shape", {backends.CPU: CASES, backends.HARNESS: CASES[:-1]})
def test_forward_matches_reference(backend, table_shape, ids_shape, dtype):
  table, = random_inputs(0, [table_shape], dtype)
  ids = _ids(1, table_shape[0], ids_shape)
  out = jax.jit(jaxops.embedding)(table, ids)
  assert out.dtype == table.dtype and out.shape == ids_shape + table_shape[1:]
  # A lookup is a copy: exact.
  assert_close(out, reference.embedding(table, ids), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("table_shape,ids_shape", {backends.CPU: CASES, backends.HARNESS: CASES[:-1]})
def test_vjp_matches_reference(backend, table_shape, ids_shape, dtype):
  check_vjp(table_shape, ids_shape, dtype)


def check_vjp(table_shape, ids_shape, dtype):
  table, = random_inputs(2, [table_shape], dtype)
  ids = _ids(3, table_shape[0], ids_shape)
  # Each row sums as many cotangent rows as it has ids.
  most = int(np.bincount(np.clip(np.asarray(ids).ravel(), 0, table_shape[0] - 1)).max(initial=1))
  vjp_against_reference(jax.jit(lambda t: jaxops.embedding(t, ids)),
                        lambda t: reference.embedding(t, ids), [table], dtype=dtype,
                        reduce_size=most)


def test_out_of_range_ids_are_clamped(backend):
  table = jnp.arange(12.0).reshape(4, 3)
  ids = jnp.array([-100, -1, 0, 3, 4, 2**31 - 1], jnp.int32)
  out = jaxops.embedding(table, ids)
  np.testing.assert_array_equal(out, table[jnp.array([0, 0, 0, 3, 3, 3])])
  grad = jax.grad(lambda t: jnp.sum(jaxops.embedding(t, ids) * jnp.arange(1.0, 7.0)[:, None]))(table)
  np.testing.assert_array_equal(grad[:, 0], [1 + 2 + 3, 0, 0, 4 + 5 + 6])


def test_wide_and_unsigned_ids_are_clamped_before_int32():
  table = jnp.arange(6.0).reshape(3, 2)
  np.testing.assert_array_equal(jaxops.embedding(table, jnp.array([0, 7], jnp.uint32)),
                                table[jnp.array([0, 2])])
  np.testing.assert_array_equal(jaxops.embedding(table, jnp.array([2, -5], jnp.int8)),
                                table[jnp.array([2, 0])])


def test_gradient_is_deterministic_and_accumulates_in_float32(backend):
  # 4096 ids on 2 rows of a bfloat16 table: float32 accumulation keeps the sum
  # exact where bfloat16 accumulation would lose most of it.
  table = jnp.zeros((2, 8), jnp.bfloat16)
  ids = jnp.arange(4096, dtype=jnp.int32) % 2
  dout = jnp.ones((4096, 8), jnp.bfloat16)
  grad_fn = jax.jit(lambda t, d: jax.vjp(lambda t: jaxops.embedding(t, ids), t)[1](d)[0])
  first = grad_fn(table, dout)
  np.testing.assert_array_equal(first, jnp.full((2, 8), 2048.0, jnp.bfloat16))
  dout = random_inputs(4, [(4096, 8)])[0]
  first = grad_fn(table.astype(jnp.float32), dout)
  for _ in range(3):
    np.testing.assert_array_equal(grad_fn(table.astype(jnp.float32), dout), first)


def test_check_grads_order_2():
  table, = random_inputs(5, [(6, 4)])
  ids = jnp.array([[0, 5, 5], [2, 9, -1]], jnp.int32)
  fn = lambda t: jnp.sin(jaxops.embedding(t, ids))
  check_grads(fn, [table], order=2, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_jvp_matches_reference(dtype):
  table, = random_inputs(20, [(13, 6)], dtype)
  ids = _ids(21, 13, (4, 7))
  jvp_against_reference(jax.jit(lambda t: jaxops.embedding(t, ids)),
                        lambda t: reference.embedding(t, ids), [table], dtype=dtype)


def test_forward_mode_and_every_transformation():
  table, = random_inputs(22, [(6, 4)])
  ids = jnp.array([[0, 5, 5], [2, 9, -1]], jnp.int32)
  check_transformations(lambda t: jnp.sin(jaxops.embedding(t, ids)),
                        lambda t: jnp.sin(reference.embedding(t, ids)), [table],
                        checkpoint_name="jaxops.embedding", atol=1e-5, rtol=1e-5)


def test_each_mode_runs_the_gather_and_scatter_kernels():
  """The lookup is linear in the table: forward mode gathers the tangent's
  rows, reverse mode scatter-adds the cotangent, and the scatter-add's own
  derivatives gather again."""
  table, = random_inputs(23, [(6, 4)])
  ids = jnp.array([[0, 5, 5], [2, 9, -1]], jnp.int32)
  fn = lambda t: jaxops.embedding(t, ids)
  assert custom_call_targets(jax.grad(scalarize(fn)), table) == [
      "jaxops_embedding_fwd", "jaxops_embedding_bwd"]
  assert custom_call_targets(lambda t: jax.jvp(fn, (t,), (t,)), table) == [
      "jaxops_embedding_fwd"] * 2
  scatter = lambda d: jax.vjp(fn, table)[1](d)[0]
  dout = jnp.ones((2, 3, 4))
  assert custom_call_targets(lambda d: jax.jvp(scatter, (d,), (d,)), dout) == [
      "jaxops_embedding_bwd"] * 2


def test_grad_of_grad_matches_reference():
  table, = random_inputs(6, [(9, 5)])
  ids = _ids(7, 9, (4, 3))

  def grad_norm(f):
    inner = jax.grad(lambda t: jnp.sum(jnp.sin(f(t, ids))))
    return lambda t: jnp.sum(inner(t) ** 2)

  assert_close(jax.grad(grad_norm(jaxops.embedding))(table),
               jax.grad(grad_norm(reference.embedding))(table), atol=1e-5, rtol=1e-5)


def test_vmap_in_axes():
  tables, = random_inputs(8, [(3, 10, 4)])
  ids = _ids(9, 10, (3, 2, 5))
  vmap_against_loop(jaxops.embedding, [tables[0], ids], (None, 0))
  vmap_against_loop(jaxops.embedding, [tables[0], jnp.moveaxis(ids, 0, 2)], (None, 2))
  vmap_against_loop(jaxops.embedding, [tables, ids], (0, 0))
  vmap_against_loop(jaxops.embedding, [jnp.moveaxis(tables, 0, 2), ids[0]], (2, None))
  vmap_against_loop(jaxops.embedding, [tables, jnp.moveaxis(ids, 0, 1)], (0, 1))
  nested = jax.vmap(jax.vmap(jaxops.embedding, in_axes=(None, 0)), in_axes=(0, None))
  nested_ref = jax.vmap(jax.vmap(reference.embedding, in_axes=(None, 0)), in_axes=(0, None))
  assert_close(nested(tables, ids[0]), nested_ref(tables, ids[0]), atol=0, rtol=0)


def test_vmap_of_grad_and_grad_of_vmap(backend):
  tables, = random_inputs(10, [(4, 7, 3)])
  ids = _ids(11, 7, (4, 6))

  def loss(f):
    return lambda t, i: jnp.sum(jnp.sin(f(t, i)) * jnp.arange(1.0, 4.0))

  # Per-example gradients of a shared table, and of per-example tables.
  for in_axes in ((None, 0), (0, 0)):
    t = tables[0] if in_axes[0] is None else tables
    assert_close(jax.vmap(jax.grad(loss(jaxops.embedding)), in_axes)(t, ids),
                 jax.vmap(jax.grad(loss(reference.embedding)), in_axes)(t, ids),
                 atol=1e-5, rtol=1e-5)

    def summed(f):
      return lambda t: jnp.sum(jax.vmap(loss(f), in_axes)(t, ids))

    assert_close(jax.grad(summed(jaxops.embedding))(t), jax.grad(summed(reference.embedding))(t),
                 atol=1e-5, rtol=1e-5)


def test_implementations_agree_and_kernel_is_used():
  table, = random_inputs(12, [(20, 6)])
  ids = _ids(13, 20, (3, 4))
  assert_close(jaxops.embedding(table, ids, implementation="ffi"),
               jaxops.embedding(table, ids, implementation="xla"))
  fn = functools.partial(jaxops.embedding, implementation="ffi")
  assert "jaxops_embedding_fwd" in str(jax.make_jaxpr(fn)(table, ids))
  assert "jaxops_embedding_bwd" in str(
      jax.make_jaxpr(jax.grad(lambda t: fn(t, ids).sum()))(table))
  assert "jaxops_" not in str(
      jax.make_jaxpr(functools.partial(jaxops.embedding, implementation="xla"))(table, ids))


def test_no_ids_and_zero_width(backend):
  table, = random_inputs(14, [(5, 3)])
  assert jaxops.embedding(table, jnp.zeros((0, 2), jnp.int32)).shape == (0, 2, 3)
  grad = jax.grad(lambda t: jaxops.embedding(t, jnp.zeros((0,), jnp.int32)).sum())(table)
  np.testing.assert_array_equal(grad, jnp.zeros((5, 3)))
  assert jaxops.embedding(jnp.zeros((5, 0)), jnp.array([1, 2])).shape == (2, 0)


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_thread_order(harness, seed):
  """Threads and blocks in a random order: a result that depends on it is a race.
  The gradient's threads cooperate (row counts, scan, warp placement)."""
  with harness.scheduled("fibers", seed=seed):
    table, = random_inputs(seed, [(37, 9)])
    ids = jax.random.randint(jax.random.key(seed), (5, 61), -2, 40)
    dout, = random_inputs(seed + 10, [(5, 61, 9)])
    grad = jax.vjp(lambda t: jaxops.embedding(t, ids), table)[1](dout)[0]
    assert_close(grad, reference.embedding_grad(dout, ids, 37), atol=1e-5, rtol=1e-5)


@pytest.mark.backends(backends.HARNESS)
def test_os_thread_mode(harness):
  with harness.scheduled("threads"):
    check_vjp((31, 17), (4, 1, 9), jnp.float32)


@pytest.mark.backends(backends.HARNESS)
def test_gradient_is_bitwise_deterministic_in_any_thread_order(harness):
  table, = random_inputs(7, [(16, 33)])
  ids = jax.random.randint(jax.random.key(8), (300,), 0, 16)
  dout, = random_inputs(9, [(300, 33)])
  grad_fn = jax.jit(lambda t, d: jax.vjp(lambda t: jaxops.embedding(t, ids), t)[1](d)[0])
  first = np.asarray(grad_fn(table, dout))
  for seed in (4, 5):
    with harness.scheduled("fibers", seed=seed):
      np.testing.assert_array_equal(np.asarray(grad_fn(table, dout + 0.0)), first)


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.embedding(jnp.ones(4), jnp.array([0])), ValueError,
     r"embedding: table must have rank 2: \[vocab, dim\], got shape \(4,\)"),
    (lambda: jaxops.embedding(jnp.ones((0, 4)), jnp.array([0])), ValueError,
     r"table must have a non-empty axis 0, got shape \(0, 4\)"),
    (lambda: jaxops.embedding(jnp.ones((3, 4), jnp.int32), jnp.array([0])), TypeError,
     "table must have a floating or complex dtype"),
    (lambda: jaxops.embedding(jnp.ones((3, 4)), jnp.array([0.0])), TypeError,
     "ids must have an integer dtype"),
    (lambda: jaxops.embedding(jnp.ones((3, 4)), [0, 1]), TypeError, "ids must be an array"),
    (lambda: jaxops.embedding(jnp.ones((3, 4)), jnp.array([0]), implementation="tpu"),
     ValueError, "implementation must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    ("jaxops_embedding_fwd", [np.ones((3, 4), np.float32), np.zeros((2,), np.int32)],
     [((2, 5), np.float32)], {}, "out has shape"),
    ("jaxops_embedding_fwd", [np.ones((3, 4), np.float32), np.zeros((2,), np.int32)],
     [((2, 4), np.float16)], {}, "out must have the dtype of table"),
    ("jaxops_embedding_fwd", [np.ones((0, 4), np.float32), np.zeros((2,), np.int32)],
     [((2, 4), np.float32)], {}, r"table must be \[vocab >= 1, dim\]"),
    ("jaxops_embedding_bwd", [np.ones((2, 4), np.float32), np.zeros((2,), np.int32)],
     [((3, 4), np.float32), ((5,), np.int32)], {"vocab": np.int64(3)},
     "workspace has 5 elements, expected 6"),
    ("jaxops_embedding_bwd", [np.ones((2, 3), np.float32), np.zeros((2,), np.int32)],
     [((3, 4), np.float32), ((6,), np.int32)], {"vocab": np.int64(3)}, "dout has shape"),
    ("jaxops_embedding_bwd", [np.ones((2, 4), np.float32), np.zeros((2,), np.int32)],
     [((3, 4), np.float32), ((6,), np.int32)], {"vocab": np.int64(4)},
     "dtable has 3 rows, expected vocab=4"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
