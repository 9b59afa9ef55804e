"""rope against its jnp reference.

Tests taking `backend` run on the CPU kernels and on the CUDA kernel
(cuda/rope.cu) in the harness (tests/support/backends.py), which runs every
CUDA thread, so its shapes stay small. The rest (rules, kernel selection,
validation) are backend-independent.
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
    assert_tree_close,
    random_inputs,
    scalarize,
    upcast,
    vjp_against_reference,
    vmap_against_loop,
)

# [batch, seq, heads, head_dim]: size-1 axes, primes, an odd head_dim (partial
# rotary only), and one large enough to run on several threads.
SHAPES = [(1, 1, 1, 2), (2, 7, 3, 10), (3, 5, 1, 7), (1, 13, 2, 64), (2, 67, 4, 128)]
STYLES = ("neox", "gptj")


def _rotary_dims(head_dim):
  """All features (when head_dim is even) and one partial rotary width."""
  full = [None] if head_dim % 2 == 0 else []
  partial = max(2, head_dim // 2 - (head_dim // 2) % 2)
  return full + ([partial] if partial < head_dim else [])


def _positions(seed, shape, per_batch, scale=1000):
  batch, seq = shape[:2]
  key = jax.random.key(seed)
  pos_shape = (batch, seq) if per_batch else (seq,)
  return jax.random.randint(key, pos_shape, 0, scale * seq + 1, jnp.int32)


def _cases():
  for shape in SHAPES:
    for style in STYLES:
      for rotary_dim in _rotary_dims(shape[-1]):
        yield shape, style, rotary_dim


CASES = list(_cases())


def _forward_id(case):
  shape, style, rotary_dim, dtype, per_batch = case
  return f"{shape}-{style}-rd{rotary_dim}-{jnp.dtype(dtype).name}-pos[{'B,S' if per_batch else 'S'}]"


@backends.parametrize("shape,style,rotary_dim,dtype,per_batch", {
    backends.CPU: [(*c, d, p) for c in CASES for d, p in [
        (jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True), (jnp.float16, False)]],
    # Not the largest shape: the harness runs every CUDA thread on the CPU.
    backends.HARNESS: [(*c, d, p) for c in CASES if c[0] != SHAPES[-1] for d, p in [
        (jnp.float32, False), (jnp.bfloat16, True), (jnp.float16, True)]]}, ids=_forward_id)
def test_forward_matches_reference(backend, shape, style, rotary_dim, dtype, per_batch):
  x, = random_inputs(0, [shape], dtype)
  positions = _positions(1, shape, per_batch)
  fn = jax.jit(functools.partial(jaxops.rope, style=style, rotary_dim=rotary_dim))
  out = fn(x, positions)
  assert out.dtype == x.dtype and out.shape == x.shape
  expected = reference.rope(upcast(x), positions, style=style, rotary_dim=rotary_dim)
  assert_close(out, expected, dtype=dtype, name="rope")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("shape,style,rotary_dim", {
    backends.CPU: [c for c in CASES if c[0] in (SHAPES[1], SHAPES[2], SHAPES[4])],
    backends.HARNESS: [(SHAPES[1], style, 4) for style in STYLES]},
    ids=lambda c: f"{c[0]}-{c[1]}-rd{c[2]}")
def test_vjp_matches_reference(backend, shape, style, rotary_dim, dtype):
  x, = random_inputs(2, [shape], dtype)
  positions = _positions(3, shape, per_batch=True)
  kwargs = dict(style=style, rotary_dim=rotary_dim)
  vjp_against_reference(jax.jit(lambda x: jaxops.rope(x, positions, **kwargs)),
                        lambda x: reference.rope(x, positions, **kwargs), [x], dtype=dtype)


def test_large_positions_and_theta(backend):
  # Angles up to ~5e5 rad: the kernel's sin/cos of the float32 angle must match
  # the reference's, which needs an accurate argument reduction.
  x, = random_inputs(4, [(2, 64, 2, 32)])
  positions = jnp.arange(64, dtype=jnp.int32)[None] * 7919 + jnp.array([[0], [1 << 16]])
  for theta in (10000.0, 500000.0, 1.5):
    assert_close(jaxops.rope(x, positions, theta=theta),
                 reference.rope(x, positions, theta=theta), atol=2e-5, rtol=2e-5)


def test_traced_positions_and_offsets():
  x, = random_inputs(5, [(2, 9, 3, 16)])

  @jax.jit
  def decode(x, offset):
    return jaxops.rope(x, offset + jnp.arange(9, dtype=jnp.int32))

  for offset in (0, 17, 4096):
    assert_close(decode(x, offset), reference.rope(x, offset + jnp.arange(9)))


def test_inverse_undoes_the_rotation_and_preserves_norms(backend):
  x, = random_inputs(6, [(2, 11, 3, 24)])
  positions = _positions(7, x.shape, per_batch=True)
  for style in STYLES:
    y = jaxops.rope(x, positions, style=style, rotary_dim=16)
    assert_close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1))
    _, vjp = jax.vjp(lambda v: jaxops.rope(v, positions, style=style, rotary_dim=16), x)
    assert_close(vjp(y)[0], x, atol=1e-5, rtol=1e-5)
    assert_close(y[..., 16:], x[..., 16:], atol=0, rtol=0)


def test_position_zero_is_the_identity():
  x, = random_inputs(8, [(1, 3, 2, 8)])
  assert_close(jaxops.rope(x, jnp.zeros(3, jnp.int32)), x, atol=0, rtol=0)


@pytest.mark.parametrize("style", STYLES)
def test_check_grads_order_2(style):
  x, = random_inputs(9, [(2, 3, 2, 6)])
  positions = jnp.array([0, 5, 11], jnp.int32)
  fn = lambda x: jaxops.rope(x, positions, style=style, rotary_dim=4)
  check_grads(fn, [x], order=2, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_jvp_matches_reference(dtype):
  x, = random_inputs(16, [(2, 7, 3, 10)], dtype)
  positions = _positions(17, x.shape, per_batch=True)
  for style in STYLES:
    jvp_against_reference(jax.jit(lambda x: jaxops.rope(x, positions, style=style, rotary_dim=8)),
                          lambda x: reference.rope(x, positions, style=style, rotary_dim=8), [x],
                          dtype=dtype)


@pytest.mark.parametrize("style", STYLES)
def test_forward_mode_and_every_transformation(style):
  x, = random_inputs(18, [(1, 3, 2, 6)])
  positions = jnp.array([0, 5, 11], jnp.int32)
  check_transformations(lambda x: jaxops.rope(x, positions, style=style, rotary_dim=4),
                        lambda x: reference.rope(x, positions, style=style, rotary_dim=4), [x],
                        checkpoint_name="jaxops.rope", atol=1e-5, rtol=1e-5)


def test_each_mode_runs_the_rotation_kernel():
  """The rotation is linear: forward mode rotates the tangent, reverse mode
  rotates the cotangent back, each with the one kernel."""
  x, = random_inputs(19, [(2, 3, 2, 6)])
  positions = jnp.array([0, 5, 11], jnp.int32)
  fn = lambda x: jaxops.rope(x, positions)
  assert custom_call_targets(jax.grad(scalarize(fn)), x) == ["jaxops_rope"] * 2
  assert custom_call_targets(lambda x: jax.jvp(fn, (x,), (x,)), x) == ["jaxops_rope"] * 2


def test_grad_of_grad_matches_reference():
  x, = random_inputs(10, [(2, 5, 2, 8)])
  positions = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) * 3

  def grad_norm(f):
    inner = jax.grad(lambda x: jnp.sum(jnp.sin(f(x, positions))))
    return lambda x: jnp.sum(inner(x) ** 2)

  assert_close(jax.grad(grad_norm(jaxops.rope))(x), jax.grad(grad_norm(reference.rope))(x),
               atol=1e-5, rtol=1e-5)


@backends.parametrize("style", {backends.CPU: STYLES, backends.HARNESS: ["gptj"]})
def test_vmap_in_axes(backend, style):
  fn = functools.partial(jaxops.rope, style=style, rotary_dim=6)
  x, = random_inputs(11, [(3, 2, 5, 2, 8)])  # [vmap, batch, seq, heads, head_dim]
  pos_shared = jnp.arange(5, dtype=jnp.int32) * 7
  pos_batch = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) * 5
  pos_vmapped = jnp.arange(15, dtype=jnp.int32).reshape(3, 5) * 11
  pos_vmapped_batch = jnp.arange(30, dtype=jnp.int32).reshape(3, 2, 5) * 3
  vmap_against_loop(fn, [x, pos_shared], (0, None))
  vmap_against_loop(fn, [x, pos_batch], (0, None))
  vmap_against_loop(fn, [jnp.moveaxis(x, 0, 3), pos_shared], (3, None))
  vmap_against_loop(fn, [x, pos_vmapped], (0, 0))
  vmap_against_loop(fn, [x, jnp.moveaxis(pos_vmapped_batch, 0, 2)], (0, 2))
  vmap_against_loop(fn, [x[0], pos_vmapped], (None, 0))
  nested = jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(0, None))
  nested_ref = jax.vmap(jax.vmap(functools.partial(reference.rope, style=style, rotary_dim=6),
                                 in_axes=(0, None)), in_axes=(0, None))
  xs = jnp.stack([x, 2 * x])
  assert_close(nested(xs, pos_shared), nested_ref(xs, pos_shared))


def test_vmap_of_grad_and_grad_of_vmap():
  x, = random_inputs(12, [(4, 2, 3, 2, 8)])
  positions = jnp.arange(12, dtype=jnp.int32).reshape(4, 3) * 9

  def loss(f):
    return lambda x, p: jnp.sum(jnp.sin(f(x, p)) * x)

  assert_close(jax.vmap(jax.grad(loss(jaxops.rope)))(x, positions),
               jax.vmap(jax.grad(loss(reference.rope)))(x, positions), atol=1e-5, rtol=1e-5)

  def summed(f):
    return lambda x: jnp.sum(jax.vmap(loss(f))(x, positions))

  assert_close(jax.grad(summed(jaxops.rope))(x), jax.grad(summed(reference.rope))(x),
               atol=1e-5, rtol=1e-5)


def test_implementations_agree_and_kernel_is_used():
  x, = random_inputs(13, [(2, 5, 3, 8)])
  positions = jnp.arange(5)
  assert_close(jaxops.rope(x, positions, implementation="ffi"),
               jaxops.rope(x, positions, implementation="xla"))
  fn = functools.partial(jaxops.rope, implementation="ffi")
  assert "jaxops_rope" in str(jax.make_jaxpr(fn)(x, positions))
  grad_jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: fn(x, positions).sum()))(x))
  assert "inverse=True" in grad_jaxpr
  assert "jaxops_" not in str(
      jax.make_jaxpr(functools.partial(jaxops.rope, implementation="xla"))(x, positions))


def test_empty_batch():
  assert jaxops.rope(jnp.zeros((0, 4, 2, 8)), jnp.arange(4)).shape == (0, 4, 2, 8)


# -- bad input -------------------------------------------------------------------

@pytest.mark.backends(backends.HARNESS)
def test_os_thread_mode(harness):
  with harness.scheduled("threads"):
    x, = random_inputs(2, [SHAPES[1]], jnp.float16)
    positions = _positions(3, SHAPES[1], per_batch=True)
    vjp_against_reference(jax.jit(lambda x: jaxops.rope(x, positions, style="neox")),
                          lambda x: reference.rope(x, positions, style="neox"), [x],
                          dtype=jnp.float16)


_X = jnp.ones((2, 3, 4, 8))


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.rope(jnp.ones((3, 4, 8)), jnp.arange(3)), ValueError,
     r"rope: x must have rank 4: \[batch, seq, heads, head_dim\], got shape \(3, 4, 8\)"),
    (lambda: jaxops.rope(_X.astype(jnp.int32), jnp.arange(3)), TypeError,
     "x must have a floating or complex dtype"),
    (lambda: jaxops.rope(_X, jnp.arange(4)), ValueError,
     r"positions must have shape .* = \(3,\) or \(2, 3\), got \(4,\)"),
    (lambda: jaxops.rope(_X, jnp.ones((3, 3), jnp.int32)), ValueError, "positions must have shape"),
    (lambda: jaxops.rope(_X, jnp.arange(3.0)), TypeError, "positions must have an integer dtype"),
    (lambda: jaxops.rope(_X, [0, 1, 2]), TypeError, "positions must be an array"),
    (lambda: jaxops.rope(_X, jnp.arange(3), theta=0.0), ValueError, "theta must be > 0"),
    (lambda: jaxops.rope(_X, jnp.arange(3), theta=jnp.float32(1e4) + jnp.zeros(2)), TypeError,
     "theta must be a Python float"),
    (lambda: jaxops.rope(_X, jnp.arange(3), style="llama"), ValueError,
     r"style must be one of 'neox', 'gptj', got str 'llama'"),
    (lambda: jaxops.rope(_X, jnp.arange(3), rotary_dim=5), ValueError,
     r"rotary_dim must be an even int in \[2, head_dim = 8\], got 5"),
    (lambda: jaxops.rope(_X, jnp.arange(3), rotary_dim=10), ValueError, "rotary_dim must be an even int .* got 10"),
    (lambda: jaxops.rope(_X, jnp.arange(3), rotary_dim=4.0), TypeError,
     "rotary_dim must be a Python int"),
    (lambda: jaxops.rope(jnp.ones((2, 3, 4, 7)), jnp.arange(3)), ValueError,
     r"rotary_dim must be an even int in \[2, head_dim = 7\] \(None rotates all head_dim"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_traced_theta_is_rejected():
  with pytest.raises(TypeError, match="theta must be a Python float"):
    jax.jit(lambda t: jaxops.rope(_X, jnp.arange(3), theta=t))(1e4)


@pytest.mark.parametrize("operands,results,attrs,match", [
    ([np.ones((2, 3, 4), np.float32), np.zeros((1, 3), np.int32)],
     [((2, 3, 4), np.float32), ((3, 4), np.float32)], {}, "x must have rank 4"),
    ([np.ones((2, 3, 1, 8), np.float32), np.zeros((3, 3), np.int32)],
     [((2, 3, 1, 8), np.float32), ((9, 8), np.float32)], {}, "positions has shape"),
    ([np.ones((2, 3, 1, 8), np.float32), np.zeros((1, 3), np.int32)],
     [((2, 3, 1, 8), np.float32), ((3, 8), np.float32)], {"rotary_dim": np.int64(9)},
     "rotary_dim=9"),
    ([np.ones((2, 3, 1, 8), np.float32), np.zeros((1, 3), np.int32)],
     [((2, 3, 1, 8), np.float32), ((2, 8), np.float32)], {}, "workspace has"),
    ([np.ones((2, 3, 1, 8), np.float32), np.zeros((1, 3), np.int32)],
     [((2, 3, 1, 8), np.float32), ((3, 8), np.float32)], {"theta": np.float64(-1.0)},
     "theta must be > 0"),
])
def test_handler_rejects_inconsistent_buffers(operands, results, attrs, match):
  attrs = {"theta": np.float64(1e4), "rotary_dim": np.int64(8), "interleaved": False,
           "inverse": False, **attrs}
  call = jax.ffi.ffi_call("jaxops_rope", [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
