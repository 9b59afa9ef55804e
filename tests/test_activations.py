"""gelu, silu, swiglu, geglu against their jnp references.

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/activations.cu) in the harness (tests/support/backends.py), which runs
every CUDA thread, so its shapes cover one and many blocks and stay small. The
rest (rules, kernel selection, validation) are backend-independent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from scipy import special

import jaxops
from jaxops import reference
from support import backends
from jaxops.testing import (
    FLOAT_DTYPES,
    assert_close,
    assert_tree_close,
    check_transformations,
    custom_call_targets,
    jvp_against_reference,
    random_inputs,
    scalarize,
    upcast,
    vjp_against_reference,
    vmap_against_loop,
)

# Size 1, primes, a flat length that is not a multiple of any vector or block
# width, and one large enough to run on several threads.
SHAPES = [(), (1,), (7,), (3, 1), (2, 3, 5), (13, 127), (3, 4099), (1, 65537)]


def _ops():
  """(name, jaxops function, reference function, number of array arguments)."""
  return [
      ("gelu_tanh", functools.partial(jaxops.gelu, approximate=True),
       functools.partial(reference.gelu, approximate=True), 1),
      ("gelu_erf", functools.partial(jaxops.gelu, approximate=False),
       functools.partial(reference.gelu, approximate=False), 1),
      ("silu", jaxops.silu, reference.silu, 1),
      ("swiglu", jaxops.swiglu, reference.swiglu, 2),
      ("geglu_tanh", functools.partial(jaxops.geglu, approximate=True),
       functools.partial(reference.geglu, approximate=True), 2),
      ("geglu_erf", functools.partial(jaxops.geglu, approximate=False),
       functools.partial(reference.geglu, approximate=False), 2),
  ]


OPS = _ops()
OP_IDS = [op[0] for op in OPS]


def _args(seed, shape, dtype, arity, scale=3.0):
  return random_inputs(seed, [shape] * arity, dtype, scale=scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("shape", {backends.CPU: SHAPES,
                                backends.HARNESS: [(), (7,), (13, 127), (3, 4099)]})
@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_forward_matches_reference(name, fn, ref, arity, backend, shape, dtype):
  args = _args(0, shape, dtype, arity)
  out = jax.jit(fn)(*args)
  assert out.dtype == args[0].dtype and out.shape == shape
  assert_close(out, ref(*upcast(args)), dtype=dtype, name=name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("shape", {backends.CPU: [(1,), (5, 3), (2, 4099), (70001,)],
                                backends.HARNESS: [(1,), (5, 3), (2, 4099)]})
@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_vjp_matches_reference(name, fn, ref, arity, backend, shape, dtype):
  vjp_against_reference(jax.jit(fn), ref, _args(1, shape, dtype, arity), dtype=dtype)


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1,), (5, 3), (2, 4099)], ids=str)
def test_jvp_matches_reference(name, fn, ref, arity, dtype, shape):
  jvp_against_reference(jax.jit(fn), ref, _args(11, shape, dtype, arity), dtype=dtype)


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_check_grads_order_2(name, fn, ref, arity):
  args = _args(2, (3, 5), jnp.float32, arity, scale=1.5)
  check_grads(fn, args, order=2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_forward_mode_and_every_transformation(name, fn, ref, arity):
  check_transformations(fn, ref, _args(12, (2, 5), jnp.float32, arity, scale=1.5),
                        checkpoint_name=f"jaxops.{name.split('_')[0]}", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_each_mode_runs_the_fused_kernels(name, fn, ref, arity):
  """grad: the forward and backward kernels. jvp: gelu and silu multiply the
  tangent by f'(x) with their backward kernel; the gated ops' tangent is one
  XLA fusion."""
  family = name.split("_")[0]
  args = _args(13, (4, 6), jnp.float32, arity)
  grad = jax.grad(scalarize(fn), argnums=tuple(range(arity)))
  assert custom_call_targets(grad, *args) == [f"jaxops_{family}_fwd", f"jaxops_{family}_bwd"]
  jvp_kernels = [f"jaxops_{family}_fwd"] + ([f"jaxops_{family}_bwd"] if arity == 1 else [])
  assert custom_call_targets(lambda *p: jax.jvp(fn, p, p), *args) == jvp_kernels


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_grad_of_grad_matches_reference(name, fn, ref, arity):
  args = _args(3, (4, 9), jnp.float32, arity, scale=2.0)

  def grad_norm(g):
    inner = jax.grad(lambda *a: jnp.sum(jnp.sin(g(*a))), argnums=tuple(range(arity)))
    return lambda *a: sum(jnp.sum(t ** 2) for t in inner(*a))

  argnums = tuple(range(arity))
  assert_tree_close(jax.grad(grad_norm(fn), argnums)(*args),
                    jax.grad(grad_norm(ref), argnums)(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_vmap_in_axes(name, fn, ref, arity, backend):
  batched = _args(4, (3, 4, 6), jnp.float32, arity)
  vmap_against_loop(fn, batched, (0,) * arity)
  vmap_against_loop(fn, [jnp.moveaxis(a, 0, 2) for a in batched], (2,) * arity)
  if arity == 2:
    # Batch axes that differ between the operands, and an unbatched operand.
    vmap_against_loop(fn, [batched[0], jnp.moveaxis(batched[1], 0, 1)], (0, 1))
    vmap_against_loop(fn, [batched[0], batched[1][0]], (0, None))
    vmap_against_loop(fn, [batched[0][0], jnp.moveaxis(batched[1], 0, 2)], (None, 2))
  nested = jax.vmap(jax.vmap(fn, in_axes=1), in_axes=0)
  nested_ref = jax.vmap(jax.vmap(ref, in_axes=1), in_axes=0)
  assert_tree_close(nested(*batched), nested_ref(*batched))


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_vmap_of_grad_and_grad_of_vmap(name, fn, ref, arity):
  batched = _args(5, (4, 3, 7), jnp.float32, arity, scale=2.0)
  argnums = tuple(range(arity))

  def loss(g):
    return lambda *a: jnp.sum(jnp.sin(g(*a)))

  in_axes = (0,) + (None,) * (arity - 1)
  unbatched_rest = [a[0] for a in batched[1:]]
  assert_tree_close(jax.vmap(jax.grad(loss(fn), argnums), in_axes)(batched[0], *unbatched_rest),
                    jax.vmap(jax.grad(loss(ref), argnums), in_axes)(batched[0], *unbatched_rest),
                    atol=1e-5, rtol=1e-5)

  def summed(g):
    return lambda *a: jnp.sum(jax.vmap(loss(g), in_axes=1)(*a))

  assert_tree_close(jax.grad(summed(fn), argnums)(*batched),
                    jax.grad(summed(ref), argnums)(*batched), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,fn,ref,arity", OPS, ids=OP_IDS)
def test_implementations_agree_and_kernel_is_used(name, fn, ref, arity):
  args = _args(6, (9, 31), jnp.float32, arity)
  assert_close(fn(*args, implementation="ffi"), fn(*args, implementation="xla"))
  family = name.split("_")[0]
  jaxpr = str(jax.make_jaxpr(functools.partial(fn, implementation="ffi"))(*args))
  assert f"jaxops_{family}_fwd" in jaxpr
  grad_jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: fn(*a).sum()))(*args))
  assert f"jaxops_{family}_bwd" in grad_jaxpr
  assert "jaxops_" not in str(jax.make_jaxpr(functools.partial(fn, implementation="xla"))(*args))


def test_empty_arrays():
  for fn in (jaxops.gelu, jaxops.silu):
    assert fn(jnp.zeros((0, 3))).shape == (0, 3)
  assert jaxops.swiglu(jnp.zeros((2, 0)), jnp.zeros((2, 0))).shape == (2, 0)


# -- the float32 math against float64 ---------------------------------------------


def _float64_reference(name, x):
  """The activation and its derivative in float64 (scipy's normal CDF)."""
  x = np.asarray(x, np.float64)
  if name == "silu":
    s = special.expit(x)
    return x * s, s * (1 + x * (1 - s))
  if name == "gelu_erf":
    pdf = np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)
    cdf = special.ndtr(x)
    return x * cdf, cdf + x * pdf
  k0, k1 = np.sqrt(2 / np.pi), np.sqrt(2 / np.pi) * 0.044715
  s = special.expit(2 * x * (k0 + k1 * x * x))
  return x * s, s + x * 2 * s * (1 - s) * (k0 + 3 * k1 * x * x)


def _condition(fn, x):
  """|x d/dx log|fn(x)||: how many ulps of output one ulp of input moves. On
  the negative tails this grows like |x|^2 or |x|^3, and float32 rounding of the
  intermediates (x^2, the exp argument) is amplified by as much."""
  x = np.asarray(x, np.float64)
  h = 1e-6 * np.maximum(1.0, np.abs(x))
  with np.errstate(divide="ignore", invalid="ignore"):
    slope = (np.log(np.abs(fn(x + h))) - np.log(np.abs(fn(x - h)))) / (2 * h)
  return np.nan_to_num(np.abs(x * slope), nan=0.0, posinf=0.0)


@pytest.mark.parametrize("name,fn", [
    ("gelu_tanh", functools.partial(jaxops.gelu, approximate=True)),
    ("gelu_erf", functools.partial(jaxops.gelu, approximate=False)),
    ("silu", jaxops.silu),
])
def test_float32_accuracy_in_ulps(name, fn, backend):
  """The kernels' exp and normal CDF keep the activations and their derivatives
  within a few float32 ulps of the exact values, times the condition number of
  the function, including the negative tails (where 1 + tanh and 1 + erf
  would cancel)."""
  x = np.concatenate([np.linspace(-30, 30, 200_001), np.geomspace(1e-30, 1e3, 2001),
                      -np.geomspace(1e-30, 10, 2001)]).astype(np.float32)
  y = np.asarray(fn(jnp.asarray(x)), np.float64)
  dydx = np.asarray(jax.grad(lambda v: fn(v).sum())(jnp.asarray(x)), np.float64)
  y_exact, dydx_exact = _float64_reference(name, x)
  for index, label, actual, exact in ((0, "value", y, y_exact), (1, "derivative", dydx,
                                                                dydx_exact)):
    # XLA runs CPU kernels with subnormals flushed to zero, so results whose
    # intermediates are subnormal (sigmoid(-87) and below) are 0.
    normal = np.abs(exact) > 1e-30
    ulp = np.spacing(np.abs(exact[normal]).astype(np.float32)).astype(np.float64)
    # The derivatives are sums of O(1) terms that cancel where they cross zero;
    # there a few ulps of 1/2 is the floor.
    floor = 0.0 if label == "value" else 8 * 2.0 ** -25
    ulps = np.maximum(np.abs(actual[normal] - exact[normal]) - floor, 0.0) / ulp
    allowed = 8.0 + 2.0 * _condition(lambda v: _float64_reference(name, v)[index], x[normal])
    worst = int(np.argmax(ulps / allowed))
    assert ulps[worst] <= allowed[worst], (
        f"{name} {label}: {ulps[worst]:.1f} ulps (allowed {allowed[worst]:.1f}) at "
        f"x={x[normal][worst]!r} ({actual[normal][worst]!r} vs {exact[normal][worst]!r})")


def test_special_values(backend):
  x = jnp.array([0.0, -0.0, 1e30, -1e30, 100.0, -100.0, 1e-30, np.nan], jnp.float32)
  for fn, ref in [(jaxops.gelu, reference.gelu), (jaxops.silu, reference.silu),
                  (functools.partial(jaxops.gelu, approximate=False),
                   functools.partial(reference.gelu, approximate=False))]:
    assert_close(fn(x), ref(x))
    grad = jax.grad(lambda v: fn(v).sum())(x)
    assert np.isnan(grad[-1]) and np.all(np.isfinite(grad[:-1]))
    # The reference's gradient too: 1 or 0 at +-1e30 (the tanh form's cube
    # overflowed there, giving it NaN: issue 43's sweep).
    assert_close(grad, jax.grad(lambda v: ref(v).sum())(x))
  assert jaxops.gelu(jnp.float32(np.inf)) == np.inf


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_thread_order(harness, seed):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  name, fn, ref, arity = OPS[3]
  with harness.scheduled("fibers", seed=seed):
    vjp_against_reference(jax.jit(fn), ref, _args(1, (3, 700), jnp.bfloat16, arity),
                          dtype=jnp.bfloat16)


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.gelu(jnp.ones(3, jnp.int32)), TypeError, "gelu: x must have a floating or complex dtype"),
    (lambda: jaxops.gelu([1.0, 2.0]), TypeError, "x must be an array, got list"),
    (lambda: jaxops.gelu(jnp.ones(3), approximate="tanh"), TypeError,
     "approximate must be a Python bool"),
    (lambda: jaxops.silu(jnp.ones(3), implementation="gpu"), ValueError,
     "implementation must be one of"),
    (lambda: jaxops.swiglu(jnp.ones((2, 4)), jnp.ones((2, 5))), ValueError,
     r"swiglu: up must have the shape of gate \(2, 4\)"),
    (lambda: jaxops.geglu(jnp.ones(4), jnp.ones(4, jnp.complex64), approximate=False),
     TypeError, "geglu: up must have a floating dtype with approximate=False"),
    (lambda: jaxops.geglu(jnp.ones(4, jnp.int8), jnp.ones(4)), TypeError,
     "geglu: gate must have a floating or complex dtype"),
    (lambda: jaxops.geglu(jnp.ones(4), None), TypeError, "up must be an array"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    ("jaxops_gelu_fwd", [np.ones((2, 4), np.float32)], [((2, 5), np.float32)],
     {"approximate": True}, "y has shape"),
    ("jaxops_silu_fwd", [np.ones((3,), np.int32)], [((3,), np.int32)], {}, "unsupported dtype"),
    ("jaxops_swiglu_fwd", [np.ones((4,), np.float32), np.ones((4,), np.float16)],
     [((4,), np.float32)], {}, "up must have the dtype of gate"),
    ("jaxops_geglu_bwd", [np.ones((4,), np.float32)] * 3,
     [((4,), np.float32), ((3,), np.float32)], {"approximate": False}, "dup has shape"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
