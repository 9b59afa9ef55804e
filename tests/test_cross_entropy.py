"""cross_entropy and linear_cross_entropy against their jnp references.

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/cross_entropy.cu: through cross_entropy, and through linear_cross_entropy,
whose blocks use the in-place forward-grad and backward kernels) in the harness
(tests/support/backends.py); the harness's shapes are chosen for the CUDA block
sizes. The rest (rules, kernel selection, validation) are backend-independent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from jaxops._src import cross_entropy as cross_entropy_src
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

# (logits shape): size-1 axes, primes, a vocabulary longer than any vector tile.
SHAPES = [(1,), (1, 1), (7, 13), (2, 3, 5), (13, 127), (3, 4099)]
# CUDA: one-warp rows, block rows, vocab = 1, primes, vocabularies longer than
# a block's registers hold (512 threads of 8 elements on the scalar path: 4099;
# of 16 on the 16-byte path: 8200).
HARNESS_SHAPES = [(1,), (1, 1), (7, 13), (13, 127), (3, 4099), (2, 8200)]
REDUCTIONS = ["mean", "sum", "none"]
# "sum" is "mean"'s code but for the final scale: the costlier checks
# (check_grads, every transformation) take these two.
DISTINCT_REDUCTIONS = ["mean", "none"]
OPTIONS = [dict(), dict(label_smoothing=0.1), dict(z_loss=1e-3),
           dict(label_smoothing=0.2, z_loss=1e-2, ignore_index=0)]
dtype_id = lambda d: jnp.dtype(d).name


def _labels(seed, shape, vocab, ignore_index=-100, ignored=0.2):
  """Random labels in range, about ``ignored`` of them ignore_index."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  labels = jax.random.randint(k1, shape, 0, vocab)
  return jnp.where(jax.random.bernoulli(k2, ignored, shape), ignore_index, labels)


def _weighted_sum(loss):
  """A scalar with a different weight per token, so 'none' gradients are checked."""
  return jnp.sum(loss.astype(jnp.float32) * jnp.linspace(0.5, 1.5, loss.size).reshape(loss.shape))


@pytest.fixture
def small_blocks(monkeypatch):
  """linear_cross_entropy with blocks of a few tokens, so tests cross block
  boundaries and pad the last block."""
  def use(tokens_per_block, vocab):
    monkeypatch.setattr(cross_entropy_src, "_LOGITS_BLOCK_BYTES", 4 * vocab * tokens_per_block)
  return use


# -- cross_entropy -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@backends.parametrize("shape", {backends.CPU: SHAPES, backends.HARNESS: HARNESS_SHAPES})
def test_forward_matches_reference(backend, shape, dtype):
  logits, = random_inputs(0, [shape], dtype, scale=3.0)
  labels = _labels(1, shape[:-1], shape[-1])
  # "sum" is the jnp sum of the same per-token kernel losses as "mean".
  for reduction in ("mean", "none"):
    f = jax.jit(functools.partial(jaxops.cross_entropy, reduction=reduction))
    out = f(logits, labels)
    assert out.dtype == logits.dtype
    expected = reference.cross_entropy(upcast(logits), labels, reduction=reduction)
    assert_close(out, expected, dtype=dtype, reduce_size=shape[-1] * max(1, labels.size),
                 name=reduction)


@backends.parametrize("reduction", {backends.CPU: REDUCTIONS, backends.HARNESS: ["mean", "none"]})
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_options_vjp_matches_reference(options, backend, reduction):
  logits, = random_inputs(2, [(2, 9, 37)], scale=3.0)
  labels = _labels(3, (2, 9), 37, options.get("ignore_index", -100))
  f = jax.jit(lambda x: jaxops.cross_entropy(x, labels, reduction=reduction, **options))
  r = lambda x: reference.cross_entropy(x, labels, reduction=reduction, **options)
  vjp_against_reference(f, r, [logits], reduce_size=37 * 18)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@backends.parametrize("shape,reduction", {
    backends.CPU: [((1, 1), "mean"), ((5, 3), "none"), ((11, 257), "mean"), ((3, 4099), "none")],
    backends.HARNESS: [((5, 3), "none"), ((11, 257), "mean"), ((2, 1030), "none"),
                       ((2, 8200), "none")]})
def test_vjp_matches_reference(backend, shape, reduction, dtype):
  check_vjp(shape, reduction, dtype)


def check_vjp(shape, reduction, dtype):
  logits, = random_inputs(4, [shape], dtype, scale=2.0)
  labels = _labels(5, shape[:-1], shape[-1])
  f = jax.jit(lambda x: jaxops.cross_entropy(x, labels, reduction=reduction, label_smoothing=0.1))
  r = lambda x: reference.cross_entropy(x, labels, reduction=reduction, label_smoothing=0.1)
  vjp_against_reference(f, r, [logits], dtype=dtype, reduce_size=shape[-1])


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_jvp_matches_reference(options, dtype, backend):
  logits, = random_inputs(26, [(3, 7, 37)], dtype, scale=3.0)
  labels = _labels(27, (3, 7), 37, options.get("ignore_index", -100))
  f = jax.jit(lambda x: jaxops.cross_entropy(x, labels, reduction="none", **options))
  r = lambda x: reference.cross_entropy(x, labels, reduction="none", **options)
  jvp_against_reference(f, r, [logits], dtype=dtype, reduce_size=37)


def test_check_grads_order_2():
  logits, = random_inputs(6, [(4, 7)])
  labels = jnp.array([1, -100, 6, 0])
  for reduction in DISTINCT_REDUCTIONS:
    f = lambda x: jaxops.cross_entropy(x, labels, reduction=reduction, label_smoothing=0.1,
                                       z_loss=0.01)
    check_grads(f, (logits,), order=2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("reduction", DISTINCT_REDUCTIONS)
def test_forward_mode_and_every_transformation(reduction):
  logits, = random_inputs(28, [(4, 7)])
  labels = jnp.array([1, -100, 6, 0])
  options = dict(reduction=reduction, label_smoothing=0.1, z_loss=0.01)
  check_transformations(lambda x: jaxops.cross_entropy(x, labels, **options),
                        lambda x: reference.cross_entropy(x, labels, **options), [logits],
                        forward_kernel="jaxops_cross_entropy_fwd",
                        checkpoint_name="jaxops.cross_entropy", atol=1e-5, rtol=1e-4)


def test_each_mode_runs_the_fused_kernels():
  """grad: the forward and backward kernels; jvp: the forward and JVP kernels."""
  logits, = random_inputs(29, [(4, 7)])
  labels = jnp.array([1, -100, 6, 0])
  f = lambda x: jaxops.cross_entropy(x, labels, reduction="none")
  assert custom_call_targets(jax.grad(scalarize(f)), logits) == [
      "jaxops_cross_entropy_fwd", "jaxops_cross_entropy_bwd"]
  assert custom_call_targets(lambda x: jax.jvp(f, (x,), (x,)), logits) == [
      "jaxops_cross_entropy_fwd", "jaxops_cross_entropy_jvp"]


def test_grad_of_grad_matches_reference():
  logits, = random_inputs(7, [(5, 16)])
  labels = _labels(8, (5,), 16)

  def grad_norm(ce):
    loss = lambda x: _weighted_sum(ce(x, labels, reduction="none", z_loss=0.01))
    return lambda x: jnp.sum(jax.grad(loss)(x) ** 2)

  assert_close(jax.jit(jax.grad(grad_norm(jaxops.cross_entropy)))(logits),
               jax.jit(jax.grad(grad_norm(reference.cross_entropy)))(logits), atol=1e-5, rtol=1e-4)


def test_vmap_in_axes(backend):
  logits, = random_inputs(9, [(3, 4, 19)])
  labels = _labels(10, (3, 4), 19)
  for reduction in REDUCTIONS:
    f = lambda x, l: jaxops.cross_entropy(x, l, reduction=reduction)
    vmap_against_loop(f, [logits, labels], (0, 0))
    vmap_against_loop(f, [jnp.moveaxis(logits, 0, 1), labels], (1, 0))
    vmap_against_loop(f, [logits, labels[0]], (0, None))
    vmap_against_loop(f, [logits[0], labels], (None, 0))
  nested = jax.vmap(jax.vmap(lambda x, l: jaxops.cross_entropy(x, l, reduction="none")))
  nested_ref = jax.vmap(jax.vmap(lambda x, l: reference.cross_entropy(x, l, reduction="none")))
  assert_close(nested(logits[:, :, None], labels[:, :, None]),
               nested_ref(logits[:, :, None], labels[:, :, None]))


def test_vmap_of_grad_and_grad_of_vmap():
  logits, = random_inputs(11, [(4, 5, 23)])
  labels = _labels(12, (4, 5), 23)
  for reduction in REDUCTIONS:
    loss = lambda ce: lambda x, l: _weighted_sum(ce(x, l, reduction=reduction, z_loss=1e-3))
    per_example = jax.jit(jax.vmap(jax.grad(loss(jaxops.cross_entropy))))(logits, labels)
    assert_close(per_example,
                 jax.jit(jax.vmap(jax.grad(loss(reference.cross_entropy))))(logits, labels),
                 atol=1e-6, rtol=1e-5)
    summed = lambda ce: lambda x, l: jnp.sum(jax.vmap(loss(ce))(x, l))
    assert_close(jax.jit(jax.grad(summed(jaxops.cross_entropy)))(logits, labels),
                 jax.jit(jax.grad(summed(reference.cross_entropy)))(logits, labels),
                 atol=1e-6, rtol=1e-5)


def test_implementations_agree():
  logits, = random_inputs(13, [(9, 31)])
  labels = _labels(14, (9,), 31)
  for impl in ("ffi", "xla"):
    assert_close(jaxops.cross_entropy(logits, labels, implementation=impl),
                 reference.cross_entropy(logits, labels))
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jaxops.cross_entropy(x, labels)))(logits))
  assert "jaxops_cross_entropy_fwd" in jaxpr and "jaxops_cross_entropy_bwd" in jaxpr
  assert "jaxops_" not in str(jax.make_jaxpr(
      lambda x: jaxops.cross_entropy(x, labels, implementation="xla"))(logits))


def test_backward_materialises_no_one_hot():
  logits, = random_inputs(15, [(6, 50)])
  labels = _labels(16, (6,), 50)
  hlo = jax.jit(jax.grad(lambda x: jaxops.cross_entropy(x, labels))).lower(logits).compile()
  # Nothing of the logits' shape is computed outside the kernels (a one-hot, a
  # softmax, a scaled copy): dlogits comes straight out of the backward kernel.
  logits_shaped = [line for line in hlo.as_text().splitlines()
                   if "[6,50]" in line.split("=", 1)[-1].split("(")[0]
                   and "parameter(" not in line and "custom-call(" not in line]
  assert not logits_shaped, logits_shaped


def test_out_of_range_labels_give_nan_loss_and_no_gradient(backend):
  logits, = random_inputs(17, [(5, 11)])
  labels = jnp.array([3, 11, -1, 2**30, -100])
  per_token = jaxops.cross_entropy(logits, labels, reduction="none")
  assert_close(per_token, reference.cross_entropy(logits, labels, reduction="none"))
  assert jnp.isnan(per_token[1:4]).all() and per_token[4] == 0 and jnp.isfinite(per_token[0])
  assert jnp.isnan(jaxops.cross_entropy(logits, labels))
  grad = jax.grad(lambda x: jnp.sum(jnp.nan_to_num(
      jaxops.cross_entropy(x, labels, reduction="none"))))(logits)
  assert (grad[1:] == 0).all() and (grad[0] != 0).any()


def test_all_ignored_mean_is_zero_not_nan(backend):
  logits, = random_inputs(18, [(4, 9)])
  labels = jnp.full((4,), -100)
  assert jaxops.cross_entropy(logits, labels) == 0
  assert (jax.grad(lambda x: jaxops.cross_entropy(x, labels))(logits) == 0).all()


@pytest.mark.parametrize("label_dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.uint32, jnp.int32])
def test_label_dtypes(label_dtype):
  logits, = random_inputs(19, [(6, 100)])
  labels = jnp.array([0, 5, 99, 42, 7, 100]).astype(label_dtype)
  assert_close(jaxops.cross_entropy(logits, labels, reduction="none", ignore_index=7),
               reference.cross_entropy(logits, labels.astype(jnp.int32), reduction="none",
                                       ignore_index=7))


# -- linear_cross_entropy ---------------------------------------------------------------


def _linear_args(seed, tokens_shape, hidden, vocab, dtype=jnp.float32, bias=True):
  x, weight, b = random_inputs(seed, [(*tokens_shape, hidden), (hidden, vocab), (vocab,)], dtype)
  weight = (weight / np.sqrt(hidden)).astype(dtype)
  labels = _labels(seed + 1, tokens_shape, vocab)
  return x, weight, (b if bias else None), labels


# "sum" shares the code of "mean" but for the final scale (covered elsewhere).
@pytest.mark.parametrize("reduction", ["mean", "none"])
@backends.parametrize("tokens,hidden,vocab,per_block,bias", {
    backends.CPU: [((1,), 1, 1, 4, True), ((13,), 8, 37, 4, False), ((2, 7), 16, 101, 5, True),
                   ((29,), 5, 13, 64, False)],
    backends.HARNESS: [((13,), 8, 37, 4, False), ((2, 7), 16, 101, 5, True)]})
def test_linear_vjp_matches_reference(small_blocks, backend, tokens, hidden, vocab, per_block,
                                      bias, reduction):
  check_linear_vjp(small_blocks, reduction, tokens, hidden, vocab, per_block, bias)


def check_linear_vjp(small_blocks, reduction, tokens, hidden, vocab, per_block, bias):
  small_blocks(per_block, vocab)
  x, weight, b, labels = _linear_args(20, tokens, hidden, vocab, bias=bias)
  options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
  if bias:
    f = lambda x, w, b: _weighted_sum(jaxops.linear_cross_entropy(x, w, labels, bias=b, **options))
    r = lambda x, w, b: _weighted_sum(
        reference.linear_cross_entropy(x, w, labels, bias=b, **options))
    args = [x, weight, b]
  else:
    f = lambda x, w: _weighted_sum(jaxops.linear_cross_entropy(x, w, labels, **options))
    r = lambda x, w: _weighted_sum(reference.linear_cross_entropy(x, w, labels, **options))
    args = [x, weight]
  vjp_against_reference(jax.jit(f), r, args, reduce_size=max(vocab, int(np.prod(tokens))))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_linear_dtypes(small_blocks, dtype, backend):
  small_blocks(8, 67)
  x, weight, b, labels = _linear_args(22, (19,), 24, 67, dtype)
  for reduction in ("mean", "none") if dtype == jnp.float32 else ("mean",):
    f = lambda x, w, b: jaxops.linear_cross_entropy(x, w, labels, bias=b, reduction=reduction)
    r = lambda x, w, b: reference.linear_cross_entropy(x, w, labels, bias=b, reduction=reduction)
    out, grads = vjp_against_reference(jax.jit(f), r, [x, weight, b], dtype=dtype,
                                       reduce_size=67 * 19)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


def test_linear_check_grads_order_2(small_blocks):
  small_blocks(3, 7)
  x, weight, b, _ = _linear_args(23, (5,), 4, 7)
  labels = jnp.array([1, -100, 6, 0, 3])
  for reduction in ("mean", "none"):
    f = lambda x, w, b: jaxops.linear_cross_entropy(x, w, labels, bias=b, reduction=reduction,
                                                    label_smoothing=0.1)
    check_grads(f, (x, weight, b), order=2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("reduction", DISTINCT_REDUCTIONS)
def test_linear_forward_mode_and_every_transformation(small_blocks, reduction):
  small_blocks(2, 7)
  x, weight, b, _ = _linear_args(30, (5,), 4, 7)
  labels = jnp.array([1, -100, 6, 0, 3])
  options = dict(reduction=reduction, label_smoothing=0.1)
  check_transformations(
      lambda x, w, b: jaxops.linear_cross_entropy(x, w, labels, bias=b, **options),
      lambda x, w, b: reference.linear_cross_entropy(x, w, labels, bias=b, **options),
      [x, weight, b], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_linear_jvp_matches_reference(small_blocks, reduction, dtype):
  small_blocks(8, 67)
  x, weight, b, labels = _linear_args(31, (19,), 24, 67, dtype)
  f = jax.jit(lambda x, w, b: jaxops.linear_cross_entropy(x, w, labels, bias=b,
                                                          reduction=reduction))
  r = lambda x, w, b: reference.linear_cross_entropy(x, w, labels, bias=b, reduction=reduction)
  jvp_against_reference(f, r, [x, weight, b], dtype=dtype, reduce_size=67 * 19)


def test_linear_modes_sweep_the_blocks_with_the_kernels(small_blocks):
  """Reverse mode of a mean: one sweep computing the gradient with the forward
  (the in-place forward-grad kernel), none after. Forward mode of per-token
  losses: the forward sweep and a tangent sweep with the JVP kernel."""
  small_blocks(4, 11)
  x, weight, b, labels = _linear_args(32, (9,), 5, 11)
  mean = lambda x, w: jaxops.linear_cross_entropy(x, w, labels, bias=b)
  assert custom_call_targets(jax.grad(mean, (0, 1)), x, weight) == [
      "jaxops_cross_entropy_fwd_grad"]
  rows = lambda x, w: jaxops.linear_cross_entropy(x, w, labels, bias=b, reduction="none")
  assert custom_call_targets(lambda x, w: jax.jvp(rows, (x, w), (x, w)), x, weight) == [
      "jaxops_cross_entropy_fwd", "jaxops_cross_entropy_jvp"]
  assert custom_call_targets(jax.grad(lambda x, w: jnp.sum(rows(x, w) ** 2), (0, 1)), x,
                             weight) == ["jaxops_cross_entropy_fwd", "jaxops_cross_entropy_bwd"]


def test_linear_vmap(small_blocks):
  small_blocks(4, 11)
  x, weight, b, labels = _linear_args(24, (3, 6), 5, 11)
  for reduction in ("mean", "none"):
    f = lambda x, w, b, l: jaxops.linear_cross_entropy(x, w, l, bias=b, reduction=reduction)
    vmap_against_loop(f, [jnp.moveaxis(x, 0, 1), weight, b, labels], (1, None, None, 0))
    if reduction == "mean":
      vmap_against_loop(f, [x[0], weight, b, labels], (None, None, None, 0))
      vmap_against_loop(f, [x, jnp.stack([weight, 2 * weight, -weight]), b, labels],
                        (0, 0, None, 0))
    # Per-example gradients (weight shared) and the gradient of a vmapped loss.
    loss = lambda ce: lambda x, w, b, l: _weighted_sum(ce(x, w, l, bias=b, reduction=reduction))
    in_axes = (0, None, None, 0)
    per_example = jax.vmap(jax.grad(loss(jaxops.linear_cross_entropy), (0, 1, 2)), in_axes)
    per_example_ref = jax.vmap(jax.grad(loss(reference.linear_cross_entropy), (0, 1, 2)), in_axes)
    assert_tree_close(per_example(x, weight, b, labels), per_example_ref(x, weight, b, labels),
                      atol=1e-5, rtol=1e-4)
    summed = lambda ce: lambda *a: jnp.sum(jax.vmap(loss(ce), in_axes)(*a))
    assert_tree_close(jax.grad(summed(jaxops.linear_cross_entropy), (0, 1, 2))(x, weight, b, labels),
                      jax.grad(summed(reference.linear_cross_entropy), (0, 1, 2))(
                          x, weight, b, labels), atol=1e-5, rtol=1e-4)


def test_linear_out_of_range_and_ignored_labels(small_blocks):
  small_blocks(2, 9)
  x, weight, b, _ = _linear_args(25, (5,), 3, 9)
  labels = jnp.array([3, 9, -1, 4, -100])
  per_token = jaxops.linear_cross_entropy(x, weight, labels, bias=b, reduction="none")
  assert_close(per_token, reference.linear_cross_entropy(x, weight, labels, bias=b,
                                                         reduction="none"))
  assert jnp.isnan(per_token[1:3]).all() and per_token[4] == 0
  all_ignored = jnp.full((5,), -100)
  assert jaxops.linear_cross_entropy(x, weight, all_ignored) == 0
  grads = jax.grad(lambda x, w: jaxops.linear_cross_entropy(x, w, all_ignored), (0, 1))(x, weight)
  assert all((g == 0).all() for g in grads)


def test_linear_does_not_materialise_the_logits():
  """The spec's shape: tokens=8192, hidden=1024, vocab=32000 in float32. The
  compiled forward+backward keeps its temporaries under a quarter of the
  logits' size (compiled only, not run)."""
  tokens, hidden, vocab = 8192, 1024, 32000
  x = jax.ShapeDtypeStruct((tokens, hidden), jnp.float32)
  weight = jax.ShapeDtypeStruct((hidden, vocab), jnp.float32)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
  logits_bytes = tokens * vocab * 4
  for reduction in ("mean", "none"):
    f = jax.value_and_grad(
        lambda x, w, l: jnp.sum(jaxops.linear_cross_entropy(x, w, l, reduction=reduction)), (0, 1))
    temp = jax.jit(f).lower(x, weight, labels).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.25 * logits_bytes, f"{reduction}: {temp / logits_bytes:.1%} of the logits"


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("seed", [1, 2])
def test_random_thread_order(harness, seed):
  """Threads and blocks in a random order: a result that depends on it is a race."""
  with harness.scheduled("fibers", seed=seed):
    check_vjp((6, 700), "none", jnp.float32)


@pytest.mark.backends(backends.HARNESS)
def test_os_thread_mode(harness, small_blocks):
  with harness.scheduled("threads"):
    check_vjp((3, 96), "mean", jnp.float16)
    check_linear_vjp(small_blocks, "mean", (5,), 4, 40, 2, True)


# -- bad input -------------------------------------------------------------------------

_X, _W, _L = jnp.ones((4, 3)), jnp.ones((3, 5)), jnp.zeros((4,), jnp.int32)


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.cross_entropy(jnp.float32(1.0), jnp.int32(0)), ValueError,
     "logits must have rank >= 1"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 0)), jnp.zeros(2, jnp.int32)), ValueError,
     "logits must have a non-empty last axis"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4), jnp.int32), jnp.zeros(2, jnp.int32)), TypeError,
     "logits must have a floating dtype"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(2)), TypeError,
     "labels must have an integer dtype"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(3, jnp.int32)), ValueError,
     r"labels must have shape logits.shape\[:-1\] = \(2,\)"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), [0, 1]), TypeError, "labels must be an array"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(2, jnp.int32), reduction="avg"),
     ValueError, "reduction must be one of"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(2, jnp.int32), label_smoothing=1.5),
     ValueError, r"label_smoothing must be in \[0.0, 1.0\]"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(2, jnp.int32), z_loss=-1.0),
     ValueError, r"z_loss must be >= 0.0, got -1.0"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(2, jnp.int32), z_loss=jnp.float32(1)),
     TypeError, "z_loss must be a Python float"),
    (lambda: jaxops.cross_entropy(jnp.ones((2, 4)), jnp.zeros(2, jnp.int32), ignore_index=0.5),
     TypeError, "ignore_index must be a Python int"),
    (lambda: jaxops.linear_cross_entropy(_X, jnp.ones((4, 5)), _L), ValueError,
     r"weight must have shape \(hidden, vocab\)"),
    (lambda: jaxops.linear_cross_entropy(_X, jnp.ones((3, 5, 1)), _L), ValueError,
     "weight must have shape"),
    (lambda: jaxops.linear_cross_entropy(_X, _W, _L, bias=jnp.ones(4)), ValueError,
     r"bias must have shape weight.shape\[1:\] = \(5,\), got \(4,\)"),
    (lambda: jaxops.linear_cross_entropy(_X, _W, jnp.zeros((4, 1), jnp.int32)), ValueError,
     r"labels must have shape x.shape\[:-1\]"),
    (lambda: jaxops.linear_cross_entropy(_X, _W.astype(jnp.int32), _L), TypeError,
     "weight must have a floating dtype"),
    (lambda: jaxops.linear_cross_entropy(_X, _W, _L, reduction=None), ValueError,
     "reduction must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("target,operands,results,match", [
    ("jaxops_cross_entropy_fwd", [np.ones((2, 4), np.float32), np.zeros((3,), np.int32)],
     [((3,), np.float32)] * 2, "labels has shape"),
    ("jaxops_cross_entropy_fwd", [np.ones((2, 4), np.float32), np.zeros((2,), np.int16)],
     [((2,), np.float32)] * 2, "labels must have dtype int32 or int64"),
    ("jaxops_cross_entropy_fwd", [np.ones((2, 4), np.float32), np.zeros((2,), np.int32)],
     [((2,), np.float32), ((3,), np.float32)], "lse has shape"),
    ("jaxops_cross_entropy_bwd", [np.ones((2, 4), np.float32), np.zeros((2,), np.int32),
                                  np.zeros((2,), np.float32), np.zeros((2,), np.float32)],
     [((2, 5), np.float32)], "dlogits has shape"),
    ("jaxops_cross_entropy_fwd_grad", [np.ones((2, 4), np.int32), np.zeros((2,), np.int32)],
     [((2,), np.float32), ((2, 4), np.int32)], "unsupported dtype"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, match):
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  attrs = dict(ignore_index=np.int64(-100), label_smoothing=np.float32(0), z_loss=np.float32(0))
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))


def test_handler_rejects_bad_options():
  call = jax.ffi.ffi_call("jaxops_cross_entropy_fwd", [jax.ShapeDtypeStruct((2,), np.float32)] * 2)
  with pytest.raises(Exception, match="label_smoothing must be in"):
    jax.block_until_ready(call(np.ones((2, 4), np.float32), np.zeros((2,), np.int32),
                               ignore_index=np.int64(-100), label_smoothing=np.float32(2),
                               z_loss=np.float32(0)))
