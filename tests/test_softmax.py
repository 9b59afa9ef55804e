"""softmax, log_softmax and causal_softmax against their jnp references.

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/softmax.cu) in the harness (tests/support/backends.py); the harness's
shapes are chosen for the CUDA block sizes. The rest (rules, kernel selection,
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

# Size-1 axes, primes, and a row longer than any vector tile.
SHAPES = [(1,), (7,), (3, 1), (2, 3, 5), (13, 127), (5, 4099), (2, 1, 64)]
# CUDA: one-warp rows, block rows, cols = 1, primes, rows longer than a block's
# registers hold (512 threads of 8 elements on the scalar path: 4099; of 16
# on the 16-byte path: 8200).
HARNESS_SHAPES = [(1,), (3, 1), (2, 3, 5), (13, 127), (3, 700), (2, 4099), (2, 8200)]
MASKED = [("softmax", jaxops.softmax, reference.softmax),
          ("log_softmax", jaxops.log_softmax, reference.log_softmax)]
MASKED_IDS = [m[0] for m in MASKED]
dtype_id = lambda d: jnp.dtype(d).name


def _mask(seed, shape, p=0.7):
  return jax.random.bernoulli(jax.random.key(seed), p, shape)


def _finite(y):
  """-inf log-probabilities as 0, for functions checked by finite differences."""
  return jnp.where(jnp.isneginf(y), 0.0, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@backends.parametrize("shape", {backends.CPU: SHAPES, backends.HARNESS: HARNESS_SHAPES})
@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_forward_matches_reference(name, fn, ref, backend, shape, dtype):
  x, = random_inputs(0, [shape], dtype, scale=3.0)
  out = jax.jit(fn)(x)
  assert out.dtype == x.dtype
  assert_close(out, ref(upcast(x)), dtype=dtype, reduce_size=shape[-1], name=name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("query_offset", [0, 2, -1])
@backends.parametrize("shape", {backends.CPU: [(1, 1), (3, 7, 7), (2, 5, 3), (4, 129)],
                                backends.HARNESS: [(3, 7, 7), (4, 129)]})
def test_causal_forward_matches_reference(backend, shape, query_offset, dtype):
  x, = random_inputs(1, [shape], dtype, scale=3.0)
  out = jax.jit(functools.partial(jaxops.causal_softmax, query_offset=query_offset))(x)
  expected = reference.causal_softmax(upcast(x), query_offset=query_offset)
  assert_close(out, expected, dtype=dtype, reduce_size=shape[-1])


# (x shape, where shape, bias shape, axis): full, row-, column- and
# scalar-broadcast masks and biases, leading-axis broadcasts, other axes.
BROADCASTS = [
    ((6, 37), (6, 37), (6, 37), -1),
    ((6, 37), (37,), (6, 1), -1),
    ((2, 3, 4, 11), (2, 1, 4, 11), (1, 3, 1, 11), -1),
    ((2, 3, 4, 11), (4, 11), (3, 1, 1), -1),
    ((2, 3, 4, 11), (2, 3, 4, 1), (), -1),
    ((5, 9, 4), (9, 1), (5, 9, 4), 1),
    ((5, 9, 4), (1, 9, 4), (9, 4), 0),
    ((3, 1, 8), (3, 1, 8), (1, 1, 8), 1),
]


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
@pytest.mark.parametrize("x_shape,where_shape,bias_shape,axis", BROADCASTS, ids=str)
def test_where_and_bias_broadcast(name, fn, ref, x_shape, where_shape, bias_shape, axis,
                                  backend):
  x, bias = random_inputs(2, [x_shape, bias_shape], scale=2.0)
  where = _mask(3, where_shape)
  both = dict(where=where, bias=bias)
  # Each broadcast alone on the first cases; together on all.
  combos = [dict(where=where), dict(bias=bias), both] if x_shape == (6, 37) else [both]
  for kwargs in combos:
    f = lambda x, b=None: fn(x, axis, where=kwargs.get("where"), bias=b)
    r = lambda x, b=None: ref(x, axis, where=kwargs.get("where"), bias=b)
    args = [x, bias] if "bias" in kwargs else [x]
    vjp_against_reference(jax.jit(f), r, args, reduce_size=x_shape[axis] * 8)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@backends.parametrize("mode,shape", {
    backends.CPU: [(m, s) for m in ("vjp", "jvp") for s in [(1, 1), (11, 257), (3, 2, 4099)]],
    # The masked forward mode with a bias tangent runs the CUDA linear-map kernel;
    # 4104 columns are two chunks of its 16-byte path.
    backends.HARNESS: [(m, s) for m in ("vjp", "jvp") for s in [(1, 1), (11, 257), (2, 1030)]]
                      + [("vjp", (2, 4104))]})
@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_derivatives_match_reference(name, fn, ref, backend, mode, shape, dtype):
  check_derivatives(fn, ref, mode, shape, dtype)


def check_derivatives(fn, ref, mode, shape, dtype):
  x, bias = random_inputs(4, [shape, shape[-1:]], dtype, scale=2.0)
  where = _mask(5, shape)
  f = jax.jit(lambda x, b: fn(x, where=where, bias=b))
  r = lambda x, b: ref(x, where=where, bias=b)
  rows = int(np.prod(shape[:-1]))
  derivative_against_reference(mode, f, r, [x, bias], dtype=dtype,
                               reduce_size=max(shape[-1], rows))


@backends.parametrize("mode,dtype", {
    backends.CPU: [(m, d) for m in ("vjp", "jvp") for d in FLOAT_DTYPES],
    backends.HARNESS: [("vjp", jnp.float32)] + [("jvp", d) for d in FLOAT_DTYPES]})
def test_causal_derivatives_match_reference(backend, mode, dtype):
  x, = random_inputs(6, [(2, 9, 13)], dtype)
  for offset in (0, 4, -3):
    derivative_against_reference(
        mode, jax.jit(functools.partial(jaxops.causal_softmax, query_offset=offset)),
        functools.partial(reference.causal_softmax, query_offset=offset), [x], dtype=dtype,
        reduce_size=13)


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_check_grads_order_2(name, fn, ref):
  x, bias = random_inputs(7, [(3, 8), (8,)])
  where = _mask(8, (3, 8)).at[:, 0].set(True)
  f = lambda x, b: _finite(fn(x, where=where, bias=b))
  check_grads(f, (x, bias), order=2, atol=2e-2, rtol=2e-2)


def test_causal_check_grads_order_2():
  x, = random_inputs(9, [(2, 4, 6)])
  f = functools.partial(jaxops.causal_softmax, query_offset=1)
  check_grads(f, (x,), order=2, atol=2e-2, rtol=2e-2)


def _transformation_cases():
  """(name, fn, reference, args): a masked, biased softmax / log_softmax and causal_softmax."""
  x, bias = random_inputs(17, [(3, 7), (3, 1)])
  where = _mask(18, (1, 7)).at[:, 0].set(True)
  cases = [(name, lambda x, b, fn=fn: _finite(fn(x, where=where, bias=b)),
            lambda x, b, ref=ref: _finite(ref(x, where=where, bias=b)), [x, bias])
           for name, fn, ref in MASKED]
  cases.append(("causal_softmax", functools.partial(jaxops.causal_softmax, query_offset=1),
                functools.partial(reference.causal_softmax, query_offset=1), [x.reshape(3, 7)]))
  return cases


TRANSFORMATION_CASES = _transformation_cases()
TRANSFORMATION_IDS = [case[0] for case in TRANSFORMATION_CASES]


@pytest.mark.parametrize("name,fn,ref,args", TRANSFORMATION_CASES, ids=TRANSFORMATION_IDS)
def test_forward_mode_and_every_transformation(name, fn, ref, args):
  check_transformations(fn, ref, args, forward_kernel=f"jaxops_{name}_fwd",
                        checkpoint_name=f"jaxops.{name}", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,fn,ref,args", TRANSFORMATION_CASES, ids=TRANSFORMATION_IDS)
def test_each_mode_runs_the_fused_kernels(name, fn, ref, args):
  """grad: the forward and backward kernels; jvp: the forward and JVP kernels."""
  grad = jax.grad(scalarize(fn), argnums=tuple(range(len(args))))
  assert custom_call_targets(grad, *args) == [f"jaxops_{name}_fwd", f"jaxops_{name}_bwd"]
  assert custom_call_targets(lambda *p: jax.jvp(fn, p, p), *args) == [
      f"jaxops_{name}_fwd", f"jaxops_{name}_jvp"]


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_grad_of_grad_matches_reference(name, fn, ref):
  x, bias = random_inputs(10, [(4, 16), (16,)])
  where = _mask(11, (4, 16))

  def grad_norm(g):
    loss = lambda x, b: jnp.sum(jnp.tanh(_finite(g(x, where=where, bias=b))) ** 2)
    return lambda x, b: jnp.sum(jax.grad(loss)(x, b) ** 2)

  assert_tree_close(jax.grad(grad_norm(fn), (0, 1))(x, bias),
                    jax.grad(grad_norm(ref), (0, 1))(x, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_vmap_in_axes(name, fn, ref, backend):
  xs, biases = random_inputs(12, [(3, 4, 19), (3, 19)])
  wheres = _mask(13, (3, 4, 19))
  f = lambda x, w, b: _finite(fn(x, where=w, bias=b))
  # Everything batched on axis 0; x on an inner axis; mask and bias shared.
  vmap_against_loop(f, [xs, wheres, biases], (0, 0, 0))
  vmap_against_loop(f, [jnp.moveaxis(xs, 0, 1), wheres, biases], (1, 0, 0))
  vmap_against_loop(f, [xs, wheres[0], biases[0]], (0, None, None))
  # Only the mask or only the bias batched (x broadcast).
  vmap_against_loop(f, [xs[0], wheres, biases[0]], (None, 0, None))
  vmap_against_loop(f, [xs[0], wheres[0], biases], (None, None, 0))
  # Nested vmap, and vmap over the softmax axis of the outer array.
  nested = jax.vmap(jax.vmap(f, in_axes=(0, None, None)), in_axes=(0, None, None))
  nested_ref = jax.vmap(jax.vmap(lambda x, w, b: _finite(ref(x, where=w, bias=b)),
                                 in_axes=(0, None, None)), in_axes=(0, None, None))
  xx = jnp.stack([xs, 2 * xs])
  assert_tree_close(nested(xx, wheres[0], biases[0]), nested_ref(xx, wheres[0], biases[0]))
  over_axis = jax.vmap(lambda x: fn(x, axis=0), in_axes=1)(xs)
  assert_close(over_axis, jax.vmap(lambda x: ref(x, axis=0), in_axes=1)(xs))


def test_causal_vmap_in_axes():
  xs, = random_inputs(14, [(3, 2, 5, 7)])
  f = functools.partial(jaxops.causal_softmax, query_offset=1)
  vmap_against_loop(f, [xs], (0,))
  vmap_against_loop(f, [jnp.moveaxis(xs, 0, 3)], (3,))


@pytest.mark.parametrize("name,fn,ref", MASKED + [
    ("causal_softmax", lambda x, where=None, bias=None: jaxops.causal_softmax(x, query_offset=1),
     lambda x, where=None, bias=None: reference.causal_softmax(x, query_offset=1))],
    ids=MASKED_IDS + ["causal_softmax"])
def test_vmap_of_grad_and_grad_of_vmap(name, fn, ref):
  xs, bias = random_inputs(15, [(4, 5, 23), (23,)])
  where = _mask(16, (5, 23))

  def loss(g):
    return lambda x, b: jnp.sum(jnp.sin(_finite(g(x, where=where, bias=b))))

  per_example = jax.vmap(jax.grad(loss(fn), (0, 1)), in_axes=(0, None))(xs, bias)
  per_example_ref = jax.vmap(jax.grad(loss(ref), (0, 1)), in_axes=(0, None))(xs, bias)
  assert_tree_close(per_example, per_example_ref, atol=5e-5, rtol=5e-5)

  def summed(g):
    return lambda x, b: jnp.sum(jax.vmap(loss(g), in_axes=(0, None))(x, b))

  assert_tree_close(jax.grad(summed(fn), (0, 1))(xs, bias),
                    jax.grad(summed(ref), (0, 1))(xs, bias), atol=5e-5, rtol=5e-5)


def test_implementations_agree():
  x, = random_inputs(17, [(9, 31)])
  where = _mask(18, (31,))
  cases = [("softmax", functools.partial(jaxops.softmax, where=where)),
           ("log_softmax", functools.partial(jaxops.log_softmax, where=where)),
           ("causal_softmax", functools.partial(jaxops.causal_softmax, query_offset=3))]
  for name, fn in cases:
    assert_close(fn(x, implementation="ffi"), fn(x, implementation="xla"))
    assert f"jaxops_{name}_fwd" in str(jax.make_jaxpr(functools.partial(fn, implementation="ffi"))(x))
    assert "jaxops_" not in str(jax.make_jaxpr(functools.partial(fn, implementation="xla"))(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_fully_masked_rows_are_zero_not_nan(backend, dtype):
  x, = random_inputs(19, [(4, 10)], dtype)
  where = jnp.ones((4, 10), bool).at[1].set(False)
  bias = jnp.zeros((4, 10), dtype).at[2].set(-jnp.inf)  # masked through the bias
  grad = lambda fn: jax.grad(lambda x: jnp.sum(_finite(fn(x, where=where, bias=bias)) * x))(x)
  p = jaxops.softmax(x, where=where, bias=bias)
  logp = jaxops.log_softmax(x, where=where, bias=bias)
  assert not jnp.isnan(p).any() and not jnp.isnan(logp).any()
  assert (p[1:3] == 0).all() and jnp.isneginf(logp[1:3]).all()
  assert_close(jnp.sum(p[np.array([0, 3])].astype(jnp.float32), -1), jnp.ones(2), atol=1e-2)
  for fn in (jaxops.softmax, jaxops.log_softmax):
    g = grad(fn)
    assert not jnp.isnan(g).any() and (g[1:3] == 0).all()
  # Every key of some rows is in the future of their query.
  c = jaxops.causal_softmax(x.reshape(2, 2, 10), query_offset=-1)
  assert (c[:, 0] == 0).all() and not jnp.isnan(c).any()


def test_causal_offsets_beyond_the_keys(backend):
  x, = random_inputs(20, [(3, 6)])
  assert_close(jaxops.causal_softmax(x, query_offset=100), jaxops.softmax(x))
  assert (jaxops.causal_softmax(x, query_offset=-100) == 0).all()


def test_nan_in_a_visible_column_poisons_the_row(backend):
  x = jnp.array([[1.0, jnp.nan, 2.0], [1.0, 2.0, 3.0], [jnp.nan, -jnp.inf, -jnp.inf]])
  for fn in (jaxops.softmax, jaxops.log_softmax):
    y = fn(x)
    assert jnp.isnan(y[0]).all() and jnp.isnan(y[2, 0]) and not jnp.isnan(y[1]).any()


def _derivative_float64(name, mode, x, g):
  """softmax's and log_softmax's vjp or jvp in float64 (NumPy), over the last
  axis: softmax's Jacobian is symmetric, p * (g - sum(p * g)) both ways;
  log_softmax's vjp is g - p * sum(g) and its jvp g - sum(p * g)."""
  x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if name == "softmax":
    return p * (g - (p * g).sum(-1, keepdims=True))
  if mode == "vjp":
    return g - p * g.sum(-1, keepdims=True)
  return g - (p * g).sum(-1, keepdims=True)


def _worst_row_error(actual, exact):
  """The largest over rows of |actual - exact| / |exact| (2-norms of each row)."""
  actual = np.asarray(actual, np.float64)
  return float(np.max(np.linalg.norm(actual - exact, axis=-1)
                      / np.maximum(np.linalg.norm(exact, axis=-1), 1e-30)))


def _derivative(fn, mode):
  if mode == "vjp":
    return jax.jit(lambda x, g: jax.vjp(fn, x)[1](g)[0])
  return jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,))[1])


@pytest.mark.parametrize("mode", ["vjp", "jvp"])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype,cols", [(jnp.bfloat16, 16), (jnp.float16, 65)],
                         ids=["bfloat16-16", "float16-65"])
def test_low_precision_backward_error_against_float64(backend, dtype, cols, name, mode):
  """The kernel's gradient (and tangent) is no more than 2x as far from
  float64's as the reference's run in that dtype (which computes in float32
  and rounds once): the kernels recompute the probabilities in float32 from x,
  where differentiating through the rounded output cost 40x (issue 43, item
  3). Peaked rows (logits of scale 10) are where that costs most."""
  x, g = random_inputs(23, [(64, cols), (64, cols)], dtype, scale=10.0)
  exact = _derivative_float64(name, mode, x, g)
  kernel_fn = functools.partial(getattr(jaxops, name), implementation="ffi")
  kernel = _worst_row_error(_derivative(kernel_fn, mode)(x, g), exact)
  ours = _worst_row_error(_derivative(getattr(reference, name), mode)(x, g), exact)
  assert kernel <= 2 * ours, f"kernel {kernel:.3g}, reference {ours:.3g}"


@pytest.mark.parametrize("mode", ["vjp", "jvp"])
def test_causal_low_precision_derivatives_against_float64(backend, mode):
  """causal_softmax's backward and tangent, likewise (queries 8, keys 16,
  offset 8: every row sees 9 to 16 keys)."""
  x, g = random_inputs(24, [(8, 16), (8, 16)], jnp.bfloat16, scale=10.0)
  visible = np.asarray(reference.causal_mask(8, 16, 8))
  masked = np.where(visible, np.asarray(x, np.float64), -np.inf)
  exact = np.where(visible, _derivative_float64("softmax", mode, masked, np.where(visible, g, 0)),
                   0.0)
  kernel_fn = functools.partial(jaxops.causal_softmax, query_offset=8, implementation="ffi")
  kernel = _worst_row_error(_derivative(kernel_fn, mode)(x, g), exact)
  ref_fn = functools.partial(reference.causal_softmax, query_offset=8)
  ours = _worst_row_error(_derivative(ref_fn, mode)(x, g), exact)
  assert kernel <= 2 * ours, f"kernel {kernel:.3g}, reference {ours:.3g}"


def test_matches_jax_nn_where_defined():
  x, = random_inputs(21, [(5, 33)], scale=4.0)
  where = _mask(22, (5, 33)).at[:, 0].set(True)
  assert_close(jaxops.softmax(x, where=where), jax.nn.softmax(x, where=where))
  assert_close(jaxops.log_softmax(x, where=where), jax.nn.log_softmax(x, where=where))
  assert_close(jaxops.softmax(x, axis=0), jax.nn.softmax(x, axis=0))


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name,fn,ref", MASKED, ids=MASKED_IDS)
def test_random_thread_order(harness, name, fn, ref, seed):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  with harness.scheduled("fibers", seed=seed):
    check_derivatives(fn, ref, "vjp", (6, 700), jnp.float32)


@pytest.mark.backends(backends.HARNESS)
def test_os_thread_mode(harness):
  with harness.scheduled("threads"):
    for name, fn, ref in MASKED:
      check_derivatives(fn, ref, "vjp", (3, 96), jnp.float16)


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.softmax(jnp.float32(1.0)), ValueError, "x must have rank >= 1"),
    (lambda: jaxops.softmax(jnp.ones((2, 4), jnp.int32)), TypeError, "x must have a floating or complex dtype"),
    (lambda: jaxops.log_softmax([[1.0, 2.0]]), TypeError, "x must be an array, got list"),
    (lambda: jaxops.softmax(jnp.ones((2, 4)), axis=2), ValueError, r"axis must be an axis of a rank-2 array, in \[-2, 1\], got 2"),
    (lambda: jaxops.softmax(jnp.ones((2, 4)), axis=1.0), TypeError, "axis must be a Python int, got float 1.0"),
    (lambda: jaxops.softmax(jnp.ones((2, 4)), where=jnp.ones((2, 4))), TypeError,
     "where must have dtype bool, got float32"),
    (lambda: jaxops.softmax(jnp.ones((2, 4)), where=jnp.ones((3, 4), bool)), ValueError,
     r"where must be broadcastable to the shape of x \(2, 4\), got shape \(3, 4\)"),
    (lambda: jaxops.log_softmax(jnp.ones((2, 4)), where=jnp.ones((1, 2, 4), bool)), ValueError,
     r"where must be broadcastable .* got shape \(1, 2, 4\)"),
    (lambda: jaxops.log_softmax(jnp.ones((2, 4)), bias=jnp.ones(5)), ValueError,
     r"bias must be broadcastable to the shape of x \(2, 4\), got shape \(5,\)"),
    (lambda: jaxops.softmax(jnp.ones((2, 4)), bias=jnp.ones(4, jnp.int32)), TypeError,
     "bias must have a floating dtype"),
    (lambda: jaxops.causal_softmax(jnp.ones(4)), ValueError, "x must have rank >= 2"),
    (lambda: jaxops.causal_softmax(jnp.ones((2, 4)), query_offset=1.5), TypeError,
     "query_offset must be a Python int"),
    (lambda: jaxops.causal_softmax(jnp.ones((2, 4)), query_offset=jnp.int32(1)), TypeError,
     "query_offset must be a Python int"),
    (lambda: jaxops.softmax(jnp.ones((2, 4)), implementation="cuda"), ValueError,
     "implementation must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_empty_inputs_take_the_reference():
  assert jaxops.softmax(jnp.ones((0, 4))).shape == (0, 4)
  assert jaxops.log_softmax(jnp.ones((3, 0))).shape == (3, 0)
  assert jaxops.causal_softmax(jnp.ones((2, 0, 3))).shape == (2, 0, 3)


_F32 = np.float32
_NO_MASK, _NO_BIAS = np.ones((0,), bool), np.ones((0,), _F32)
_X24, _STATS = np.ones((2, 4), _F32), np.ones((2, 2), _F32)
_FWD_RESULTS = [((2, 4), _F32), ((2, 2), _F32)]


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    ("jaxops_softmax_fwd", [_X24, _NO_MASK, _NO_BIAS], [((2, 5), _F32), ((2, 2), _F32)], {},
     "y has shape"),
    ("jaxops_softmax_fwd", [_X24, np.ones((3, 4), bool), _NO_BIAS], _FWD_RESULTS, {},
     "where has shape"),
    ("jaxops_log_softmax_fwd", [_X24, np.ones((4,), bool), _NO_BIAS], _FWD_RESULTS, {},
     "where has shape"),
    ("jaxops_softmax_fwd", [_X24, np.ones((2, 4), np.int8), _NO_BIAS], _FWD_RESULTS, {},
     "where must have dtype bool"),
    ("jaxops_softmax_fwd", [_X24, _NO_MASK, np.ones((1, 4), np.float16)], _FWD_RESULTS, {},
     "bias must have dtype"),
    ("jaxops_softmax_fwd", [np.ones((2, 4), np.int32), _NO_MASK, np.ones((0,), np.int32)],
     [((2, 4), np.int32), ((2, 2), _F32)], {}, "unsupported dtype"),
    # The statistics: float32, two a row.
    ("jaxops_softmax_fwd", [_X24, _NO_MASK, _NO_BIAS], [((2, 4), _F32), ((2, 1), _F32)], {},
     r"stats has shape \[2, 1\], expected \[2, 2\]"),
    ("jaxops_log_softmax_fwd", [_X24, _NO_MASK, _NO_BIAS], [((2, 4), _F32), ((2, 2), np.float16)],
     {}, "stats must have dtype float32"),
    ("jaxops_causal_softmax_fwd", [np.ones((4,), _F32)], [((4,), _F32), ((2,), _F32)],
     {"query_offset": np.int64(0)}, "rank >= 2"),
    ("jaxops_softmax_bwd", [_X24, np.ones((2, 3), _F32), _NO_MASK, _NO_BIAS, _STATS],
     [((2, 3), _F32)], {}, "dy has shape"),
    ("jaxops_softmax_bwd", [_X24, _X24, _NO_MASK, _NO_BIAS, np.ones((2,), _F32)],
     [((2, 4), _F32)], {}, "stats has shape"),
    ("jaxops_log_softmax_bwd", [_X24, _X24, np.ones((2, 4), bool), _NO_BIAS,
                                _STATS.astype(np.float16)], [((2, 4), _F32)], {},
     "stats must have dtype float32"),
    ("jaxops_log_softmax_bwd", [_X24, _X24, np.ones((2, 3), bool), _NO_BIAS, _STATS],
     [((2, 4), _F32)], {}, "where has shape"),
    ("jaxops_causal_softmax_bwd", [_X24, _X24, np.ones((3, 2), _F32)], [((2, 4), _F32)],
     {"query_offset": np.int64(0)}, "stats has shape"),
    ("jaxops_softmax_jvp", [_X24, _NO_MASK, np.ones((2, 4), np.float16), _STATS, _X24, _NO_BIAS],
     [((2, 4), _F32)], {}, "bias must have dtype"),
    ("jaxops_log_softmax_jvp", [_X24, _NO_MASK, _NO_BIAS, _STATS, np.ones((2, 5), _F32),
                                _NO_BIAS], [((2, 4), _F32)], {}, "dx"),
    ("jaxops_causal_softmax_jvp", [np.ones((4,), _F32), np.ones((2,), _F32), np.ones((4,), _F32)],
     [((4,), _F32)], {"query_offset": np.int64(0)}, "rank >= 2"),
    ("jaxops_causal_softmax_jvp", [_X24, np.ones((2, 2, 1), _F32), _X24], [((2, 4), _F32)],
     {"query_offset": np.int64(0)}, "stats has shape"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  """Calls a handler directly with buffers the public API would never pass: the
  handler must return an error (raised in Python), not crash the process."""
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
