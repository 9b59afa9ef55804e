"""layer_norm, rms_norm, add_rms_norm against their jnp references.

Tests taking `backend` run on the CPU kernels and on the CUDA kernels (cuda/norms.cu)
in the harness (tests/support/backends.py); the harness's shapes are chosen for the
CUDA block sizes. The rest (rules, kernel selection, validation) are backend-independent.
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
    assert_tree_close,
    check_transformations,
    custom_call_targets,
    derivative_against_reference,
    random_inputs,
    scalarize,
    upcast,
    vjp_against_reference,
    vmap_against_loop,
)

# Size-1 axes, primes, and a row longer than any vector tile (and a 4099-wide one).
SHAPES = [(1,), (7,), (3, 1), (2, 3, 5), (13, 127), (5, 4099), (2, 1, 64)]
# CUDA: rows of one warp and of a block, cols = 1, primes, rows longer than one
# chunk of a block's registers (8192 elements vectorised, 4096 scalar).
HARNESS_SHAPES = [(1,), (3, 1), (2, 3, 5), (13, 127), (5, 4099), (2, 64), (2, 8200), (2, 9001)]
DERIVATIVE_SHAPES = [(1, 1), (3, 5), (11, 257), (3, 2, 4099)]
# CUDA: the backward (one-warp rows, block rows, weight-gradient groups, long
# rows), and the JVP kernel (one-warp rows, block rows, rows longer than a block's registers).
HARNESS_DERIVATIVES = ([("vjp", s) for s in [(1, 1), (3, 5), (11, 257), (2, 1000), (2, 9001)]]
                       + [("jvp", s) for s in [(1, 1), (11, 257), (2, 9001)]])


def _ops():
  """(name, jaxops function, reference function, argument builder)."""

  def ln_args(seed, shape, dtype, weight=True, bias=True):
    x, w, b = random_inputs(seed, [shape, shape[-1:], shape[-1:]], dtype)
    return [x, (1.0 + 0.5 * w).astype(dtype) if weight else None, b if bias else None]

  def rms_args(seed, shape, dtype, weight=True):
    x, w = random_inputs(seed, [shape, shape[-1:]], dtype, offset=0.3)
    return [x, (1.0 + 0.5 * w).astype(dtype) if weight else None]

  def add_args(seed, shape, dtype, weight=True):
    x, r, w = random_inputs(seed, [shape, shape, shape[-1:]], dtype)
    return [x, r, (1.0 + 0.5 * w).astype(dtype) if weight else None]

  return [
      ("layer_norm", jaxops.layer_norm, reference.layer_norm, ln_args),
      ("rms_norm", jaxops.rms_norm, reference.rms_norm, rms_args),
      ("add_rms_norm", jaxops.add_rms_norm, reference.add_rms_norm, add_args),
  ]


OPS = _ops()
OP_IDS = [op[0] for op in OPS]


def _present(args):
  """Drops the Nones (absent weight/bias) for functions of arrays only."""
  return [a for a in args if a is not None], [i for i, a in enumerate(args) if a is not None]


def _bind(fn, args, **kwargs):
  """fn as a function of the non-None args only."""
  present, where = _present(args)

  def f(*arrays):
    full = list(args)
    for i, a in zip(where, arrays):
      full[i] = a
    return fn(*full, **kwargs)

  return f, present


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("shape", {backends.CPU: SHAPES, backends.HARNESS: HARNESS_SHAPES})
@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_forward_matches_reference(name, fn, ref, make_args, backend, shape, dtype):
  args = make_args(0, shape, dtype)
  out = jax.jit(fn)(*args)
  expected = ref(*upcast(args))
  jax.tree.map(lambda o, a: np.testing.assert_equal(o.dtype, a.dtype), out,
               jax.tree.map(lambda _: args[0], out))
  assert_tree_close(out, expected, dtype=dtype, reduce_size=shape[-1], name=name)


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_optional_parameters(name, fn, ref, make_args, backend):
  shape = (6, 37)
  combos = [dict(weight=False)] + ([dict(bias=False), dict(weight=False, bias=False)]
                                   if name == "layer_norm" else [])
  for combo in combos:
    args = make_args(1, shape, jnp.float32, **combo)
    f, present = _bind(fn, args)
    r, _ = _bind(ref, args)
    vjp_against_reference(f, r, present, reduce_size=shape[-1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("mode,shape", {
    backends.CPU: [(m, s) for m in ("vjp", "jvp") for s in DERIVATIVE_SHAPES],
    backends.HARNESS: HARNESS_DERIVATIVES})
@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_derivatives_match_reference(name, fn, ref, make_args, backend, mode, shape, dtype):
  check_derivatives(name, fn, ref, make_args, mode, shape, dtype)


def check_derivatives(name, fn, ref, make_args, mode, shape, dtype):
  args = make_args(2, shape, dtype)
  f, present = _bind(jax.jit(fn), args)
  r, _ = _bind(ref, args)
  # Weight gradients sum over every row, so their tolerance grows with the rows.
  rows = int(np.prod(shape[:-1]))
  derivative_against_reference(mode, f, r, present, dtype=dtype,
                               reduce_size=max(shape[-1], rows))


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_check_grads_order_2(name, fn, ref, make_args):
  args = make_args(3, (3, 8), jnp.float32)
  f, present = _bind(fn, args)
  check_grads(f, present, order=2, atol=2e-2, rtol=2e-2)  # order 1 included


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_forward_mode_and_every_transformation(name, fn, ref, make_args):
  args = make_args(4, (3, 7), jnp.float32)
  f, present = _bind(fn, args)
  r, _ = _bind(ref, args)
  check_transformations(f, r, present, forward_kernel=f"jaxops_{name}_fwd",
                        checkpoint_name=f"jaxops.{name}", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_each_mode_runs_the_fused_kernels(name, fn, ref, make_args):
  """grad: the forward and backward kernels; jvp: the forward and JVP kernels."""
  args = make_args(5, (4, 16), jnp.float32)
  f, present = _bind(fn, args)
  backward = "jaxops_rms_norm_bwd" if name == "add_rms_norm" else f"jaxops_{name}_bwd"
  grad = jax.grad(scalarize(f), argnums=tuple(range(len(present))))
  assert custom_call_targets(grad, *present) == [f"jaxops_{name}_fwd", backward]
  tangent = "jaxops_rms_norm_jvp" if name == "add_rms_norm" else f"jaxops_{name}_jvp"
  jvp = lambda *p: jax.jvp(f, p, p)
  assert custom_call_targets(jvp, *present) == [f"jaxops_{name}_fwd", tangent]


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_vmap_in_axes(name, fn, ref, make_args, backend):
  args = make_args(5, (4, 19), jnp.float32)
  n_rows = len(args) - (1 if name != "layer_norm" else 2)  # x (and residual) first
  f, present = _bind(fn, args)
  # x batched on axis 0, then on axis 1 (the batch axis inside the rows).
  batched_x = [jnp.stack([a * (1 + 0.1 * i) for i in range(3)]) for a in present[:n_rows]]
  vmap_against_loop(f, batched_x + present[n_rows:], (0,) * n_rows + (None,) * (len(present) - n_rows))
  moved = [jnp.moveaxis(a, 0, 1) for a in batched_x]
  vmap_against_loop(f, moved + present[n_rows:], (1,) * n_rows + (None,) * (len(present) - n_rows))
  # x and weight both batched (the weight batch takes the reference path).
  batched_w = [jnp.stack([a + 0.1 * i for i in range(3)]) for a in present[n_rows:]]
  vmap_against_loop(f, batched_x + batched_w, (0,) * len(present))
  # Nested vmap over two leading axes of x.
  nested = jax.vmap(jax.vmap(f, in_axes=(0,) * n_rows + (None,) * (len(present) - n_rows)),
                    in_axes=(0,) * n_rows + (None,) * (len(present) - n_rows))
  xs = [jnp.stack([a, 2 * a]) for a in batched_x]
  r, _ = _bind(ref, args)
  nested_ref = jax.vmap(jax.vmap(r, in_axes=(0,) * n_rows + (None,) * (len(present) - n_rows)),
                        in_axes=(0,) * n_rows + (None,) * (len(present) - n_rows))
  assert_tree_close(nested(*xs, *present[n_rows:]), nested_ref(*xs, *present[n_rows:]))


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_vmap_of_grad_and_grad_of_vmap(name, fn, ref, make_args, backend):
  """Per-example gradients (on CUDA: the weight-gradient groups)."""
  args = make_args(6, (5, 23), jnp.float32)
  n_rows = len(args) - (1 if name != "layer_norm" else 2)
  f, present = _bind(fn, args)
  r, _ = _bind(ref, args)
  argnums = tuple(range(len(present)))
  in_axes = (0,) * n_rows + (None,) * (len(present) - n_rows)
  xs = [jnp.stack([a * (1 + 0.2 * i) for i in range(4)]) for a in present[:n_rows]]
  batch = xs + present[n_rows:]

  def loss(g):
    return lambda *a: jnp.sum(jnp.sin(jnp.stack(jax.tree.leaves(g(*a)))))

  # Per-example gradients, including per-example weight gradients.
  per_example = jax.vmap(jax.grad(loss(f), argnums), in_axes=in_axes)(*batch)
  per_example_ref = jax.vmap(jax.grad(loss(r), argnums), in_axes=in_axes)(*batch)
  assert_tree_close(per_example, per_example_ref, atol=5e-5, rtol=5e-5)

  def summed(g):
    return lambda *a: jnp.sum(jax.vmap(loss(g), in_axes=in_axes)(*a))

  assert_tree_close(jax.grad(summed(f), argnums)(*batch), jax.grad(summed(r), argnums)(*batch),
                    atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_implementations_agree(name, fn, ref, make_args):
  args = make_args(7, (9, 31), jnp.float32)
  assert_tree_close(fn(*args, implementation="ffi"), fn(*args, implementation="xla"))
  jaxpr = str(jax.make_jaxpr(functools.partial(fn, implementation="ffi"))(*args))
  assert f"jaxops_{name}_fwd" in jaxpr
  assert "jaxops_" not in str(jax.make_jaxpr(functools.partial(fn, implementation="xla"))(*args))


def test_epsilon_is_honoured():
  x = jnp.full((2, 8), 3.0) + jnp.arange(8.0) * 1e-3
  for eps in (1e-5, 1.0):
    assert_close(jaxops.layer_norm(x, epsilon=eps), reference.layer_norm(x, epsilon=eps))
    assert_close(jaxops.rms_norm(x, epsilon=eps), reference.rms_norm(x, epsilon=eps))


def test_add_rms_norm_with_donated_residual(backend):
  x, r, w = random_inputs(8, [(16, 48), (16, 48), (48,)])
  expected = reference.add_rms_norm(x, r, w)
  f = jax.jit(jaxops.add_rms_norm, donate_argnums=(1,))
  out = f(x, jnp.array(r), w)
  assert_tree_close(out, expected)
  hlo = jax.jit(jaxops.add_rms_norm, donate_argnums=(1,)).lower(x, r, w).as_text()
  assert "output_operand_aliases" in hlo


def test_large_mean_rows_keep_precision(backend):
  # A row with a large offset: the centred variance must not cancel.
  x = 1000.0 + random_inputs(9, [(4, 512)])[0]
  assert_close(jaxops.layer_norm(x), reference.layer_norm(x), atol=1e-3, rtol=1e-3)


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name,fn,ref,make_args", OPS, ids=OP_IDS)
def test_random_thread_order(harness, name, fn, ref, make_args, seed):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  with harness.scheduled("fibers", seed=seed):
    for mode in ("vjp", "jvp"):
      check_derivatives(name, fn, ref, make_args, mode, (6, 70), jnp.float32)
      check_derivatives(name, fn, ref, make_args, mode, (9, 1030), jnp.bfloat16)


@pytest.mark.backends(backends.HARNESS)
def test_os_thread_mode(harness):
  with harness.scheduled("threads"):
    for name, fn, ref, make_args in OPS:
      check_derivatives(name, fn, ref, make_args, "vjp", (3, 96), jnp.float16)


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.layer_norm(jnp.float32(1.0)), ValueError, "x must have rank >= 1"),
    (lambda: jaxops.layer_norm(jnp.ones((2, 0))), ValueError, "x must have a non-empty last axis"),
    (lambda: jaxops.layer_norm(jnp.ones((2, 4)), jnp.ones(5)), ValueError, r"weight must have shape x.shape\[-1:\] = \(4,\), got \(5,\)"),
    (lambda: jaxops.layer_norm(jnp.ones((2, 4)), None, jnp.ones((1, 4))), ValueError, "bias must have shape"),
    (lambda: jaxops.layer_norm(jnp.ones((2, 4), jnp.int32)), TypeError, "x must have a floating or complex dtype"),
    (lambda: jaxops.rms_norm([[1.0, 2.0]]), TypeError, "x must be an array, got list"),
    (lambda: jaxops.rms_norm(jnp.ones((2, 4)), jnp.ones(4, jnp.int32)), TypeError, "weight must have a floating dtype"),
    (lambda: jaxops.rms_norm(jnp.ones((2, 4)), epsilon=-1.0), ValueError, "epsilon must be >= 0"),
    (lambda: jaxops.rms_norm(jnp.ones((2, 4)), implementation="cuda"), ValueError, "implementation must be one of"),
    (lambda: jaxops.add_rms_norm(jnp.ones((2, 4)), jnp.ones((2, 5))), ValueError, "residual must have the shape of x"),
    (lambda: jaxops.add_rms_norm(jnp.ones((2, 4)), jnp.ones((2, 4), jnp.int8)), TypeError, "residual must have a floating or complex dtype"),
    (lambda: jaxops.add_rms_norm(jnp.ones((2, 4)), "r"), TypeError, "residual must be an array"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_integer_input_is_refused_whatever_the_implementation():
  for implementation in (None, "ffi", "xla"):
    with pytest.raises(TypeError, match="x must have a floating or complex dtype"):
      jaxops.layer_norm(jnp.ones((2, 3), jnp.int8), implementation=implementation)


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    # y shaped unlike x
    ("jaxops_rms_norm_fwd", [np.ones((2, 4), np.float32), np.ones((4,), np.float32)],
     [((2, 5), np.float32), ((2,), np.float32)], {"epsilon": np.float32(1e-6)}, "y has shape"),
    # weight of the wrong length
    ("jaxops_layer_norm_fwd", [np.ones((2, 4), np.float32), np.ones((3,), np.float32),
                               np.ones((0,), np.float32)],
     [((2, 4), np.float32), ((2,), np.float32), ((2,), np.float32)],
     {"epsilon": np.float32(1e-5)}, "weight has shape"),
    # integer input
    ("jaxops_rms_norm_fwd", [np.ones((2, 4), np.int32), np.ones((0,), np.int32)],
     [((2, 4), np.int32), ((2,), np.float32)], {"epsilon": np.float32(1e-6)}, "unsupported dtype"),
    # groups that do not divide the rows
    ("jaxops_rms_norm_bwd", [np.ones((3, 4), np.float32)] * 2 + [np.ones((4,), np.float32),
                             np.ones((3,), np.float32), np.ones((0,), np.float32)],
     [((3, 4), np.float32), ((2, 4), np.float32), ((2, 1, 4), np.float32)],
     {"groups": np.int64(2)}, "groups=2"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  """Calls a handler directly with buffers the public API would never pass: the
  handler must return an error (raised in Python), not crash the process."""
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("cols", {backends.CPU: [37], backends.HARNESS: [37, 300, 9001]})
def test_layer_norm_row_with_overflowing_square(backend, cols, dtype):
  """A row holding 1e30: its squares overflow, the reference's variance is inf
  and rsqrt makes rstd 0, so the row is its bias (finite), with finite
  gradients and tangents; the kernels must not make inf - inf or 0 * inf of it."""
  x, w, b = random_inputs(10, [(3, cols), (cols,), (cols,)], dtype)
  x = x.at[1, cols // 2].set(1e30)
  w = (1.0 + 0.5 * w).astype(dtype)
  f = jax.jit(functools.partial(jaxops.layer_norm, implementation="ffi"))
  out = f(x, w, b)
  expected = reference.layer_norm(*upcast([x, w, b]))
  assert bool(jnp.all(jnp.isfinite(out))), "non-finite output"
  assert_close(out, expected, dtype=dtype, reduce_size=cols)
  derivative_against_reference("vjp", f, reference.layer_norm, [x, w, b], dtype=dtype,
                               reduce_size=cols)
  derivative_against_reference("jvp", f, reference.layer_norm, [x, w, b], dtype=dtype,
                               reduce_size=cols)
