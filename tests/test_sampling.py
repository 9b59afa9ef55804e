"""jaxops.sample against its jnp reference and an independent NumPy oracle.

Tests taking `backend` run on the CPU kernel and on the CUDA kernel
(cuda/sampling.cu) in the harness (tests/support/backends.py), the harness on
small rows (one warp, several warps, a vocabulary longer than the block). The
rest (the distribution, rules, validation) are backend-independent.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jaxops
from jaxops import reference
from jaxops.testing import FLOAT_DTYPES, custom_call_targets
from support import backends, meshes

FFI = {"implementation": "ffi"}
XLA = {"implementation": "xla"}

# (batch, vocab): a vocabulary of 1, primes, rows longer than the CUDA block.
SHAPES = {backends.CPU: [(3, 1), (257, 97), (33, 1000)],
          backends.HARNESS: [(5, 1), (24, 37), (6, 600)]}


def _logits(seed, shape, dtype, *, ties=False):
  x = np.random.default_rng(seed).normal(size=shape) * 2.0
  if ties:  # few distinct values: ties at every boundary
    x = np.round(x)
  return jnp.asarray(x, dtype)


def _row_params(seed, batch, vocab):
  """Per-row parameters that exercise every filter and the disabled values."""
  rng = np.random.default_rng(seed)
  temperature = rng.uniform(0.3, 2.0, batch).astype(np.float32)
  temperature[rng.random(batch) < 0.1] = 0.0
  top_k = rng.integers(-1, vocab + 2, batch).astype(np.int32)
  top_p = rng.uniform(0.05, 1.0, batch).astype(np.float32)
  top_p[rng.random(batch) < 0.3] = 1.0
  min_p = rng.uniform(0.0, 0.5, batch).astype(np.float32)
  min_p[rng.random(batch) < 0.4] = 0.0
  return dict(temperature=jnp.asarray(temperature), top_k=jnp.asarray(top_k),
              top_p=jnp.asarray(top_p), min_p=jnp.asarray(min_p))


def _kept_sets(logits, temperature, top_k, top_p, min_p):
  """The tokens each row may return, computed in float64 NumPy with a full sort
  (an oracle independent of the reference's code); None for greedy rows."""
  x = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
  batch, vocab = x.shape
  out = []
  for r in range(batch):
    t = float(temperature[r])
    if not t > 0:
      out.append(None)
      continue
    z = np.asarray(np.float32(x[r]) / np.float32(t), np.float64)
    order = np.lexsort((np.arange(vocab), -z))  # z descending, lower index first
    k = int(top_k[r])
    k = vocab if k <= 0 or k >= vocab else k
    w = np.exp(z[order] - z.max())
    in_k = np.arange(vocab) < k
    p = float(top_p[r])
    mass = np.where(in_k, w, 0.0)
    before = np.cumsum(mass) - mass
    in_p = (p >= 1) | (before < p * mass.sum()) | (np.arange(vocab) == 0)
    in_m = w >= float(min_p[r]) * w.max()
    out.append(set(order[in_k & in_p & in_m].tolist()))
  return out


def _assert_in_kept_sets(tokens, logits, params, slack=1e-5):
  """Every token is in its row's kept set; a token outside it is tolerated only
  where the oracle's float64 mass puts it within `slack` of the top-p boundary
  (the kernels decide that boundary in float32)."""
  loose = dict(params, top_p=jnp.minimum(params["top_p"] + slack, 1.0))
  kept = _kept_sets(logits, **params)
  kept_loose = _kept_sets(logits, **loose)
  x = np.asarray(jnp.asarray(logits, jnp.float32))
  for r, token in enumerate(np.asarray(tokens)):
    if kept[r] is None:
      assert token == np.argmax(x[r]), (r, token)
    else:
      assert token in kept_loose[r], (r, token, sorted(kept[r]))


@backends.parametrize("shape,dtype", {
    backend: backends.with_dtypes([(s,) for s in shapes], [(shapes[1],)])
    for backend, shapes in SHAPES.items()})
def test_kernel_matches_reference_and_keeps_to_the_kept_set(backend, shape, dtype):
  batch, vocab = shape
  kernel, reference_fn = (jax.jit(lambda k, x, p, impl=impl: jaxops.sample(k, x, **p, **impl))
                          for impl in (FFI, XLA))
  mismatches = 0
  for seed in range(3):
    logits = _logits(seed, shape, dtype, ties=seed == 2)
    params = _row_params(seed, batch, vocab)
    key = jax.random.key(seed)
    tokens = kernel(key, logits, params)
    expected = reference_fn(key, logits, params)
    assert tokens.dtype == jnp.int32 and tokens.shape == (batch,)
    mismatches += int(jnp.sum(tokens != expected))
    _assert_in_kept_sets(tokens, logits, params)
  # Measure-zero boundary cases only (a uniform within a rounding error of a
  # boundary between two tokens): none is expected in these few rows.
  assert mismatches == 0


@backends.parametrize("dtype", {backends.CPU: list(FLOAT_DTYPES),
                                backends.HARNESS: list(FLOAT_DTYPES)})
def test_greedy_is_argmax_lowest_index_on_ties(backend, dtype):
  x = jnp.asarray([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -5.0, 2.0, 2.0]], dtype)
  tokens = jaxops.sample(jax.random.key(0), x, temperature=0.0, top_k=2, top_p=0.5, **FFI)
  np.testing.assert_array_equal(tokens, [1, 0, 2])
  big = _logits(4, (33, 301), dtype)
  np.testing.assert_array_equal(jaxops.sample(jax.random.key(1), big, temperature=0.0, **FFI),
                                jnp.argmax(big, axis=-1))


def test_kernel_matches_reference_on_many_rows_and_seeds():
  """Exact agreement over many rows, seeds and per-row parameters."""
  batch, vocab = 2048, 150
  kernel, reference_fn = (jax.jit(lambda k, x, p, impl=impl: jaxops.sample(k, x, **p, **impl))
                          for impl in (FFI, XLA))
  for seed in range(4):
    logits = _logits(10 + seed, (batch, vocab), jnp.float32, ties=seed % 2 == 1)
    params = _row_params(10 + seed, batch, vocab)
    key = jax.random.key(100 + seed)
    np.testing.assert_array_equal(kernel(key, logits, params), reference_fn(key, logits, params))


@backends.parametrize("case", {backends.CPU: ["topk", "topk_ties", "topp", "minp"],
                               backends.HARNESS: ["topk_ties", "topp"]})
def test_boundary_ties_keep_lower_indices(backend, case):
  """Ties at the top-k and top-p boundaries: exactly the lower indices are kept."""
  x = jnp.asarray([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -1.0, 2.0]] * 512, jnp.float32)
  kwargs, allowed = {
      "topk": ({"top_k": 2}, {1, 3}),
      "topk_ties": ({"top_k": 4}, {1, 3, 7, 2}),
      # p(2.0) = 0.2332 each: three reach 0.6995 < 0.7, so one token at 1.0 joins.
      "topp": ({"top_p": 0.7}, {1, 3, 7, 2}),
      "minp": ({"min_p": 0.5}, {1, 3, 7}),
  }[case]
  tokens = np.asarray(jaxops.sample(jax.random.key(3), x, **kwargs, **FFI))
  assert set(tokens.tolist()) == allowed


def test_distribution_matches_filtered_probabilities():
  """A chi-square test of 20000 draws (one batched call) against the
  renormalised probabilities left by temperature, top-k, top-p and min-p."""
  logits = jnp.asarray([1.0, 2.5, 0.3, 2.0, -1.0, 1.7, 0.9, 2.2, -0.5, 1.2], jnp.float32)
  draws = 20000
  batch = jnp.broadcast_to(logits, (draws, logits.shape[0]))
  tokens = jaxops.sample(jax.random.key(7), batch, temperature=0.8, top_k=7, top_p=0.9,
                         min_p=0.12, **FFI)
  z = np.asarray(logits, np.float64) / 0.8
  order = np.argsort(-z, kind="stable")
  p = np.exp(z[order] - z.max())
  p[7:] = 0.0
  p /= p.sum()
  keep = (np.cumsum(p) - p) < 0.9
  keep &= p >= 0.12 * p.max()
  expected = np.zeros_like(z)
  expected[order[keep]] = p[keep] / p[keep].sum()
  counts = np.bincount(np.asarray(tokens), minlength=z.size)
  assert counts[expected == 0].sum() == 0
  observed = counts[expected > 0]
  _, p_value = scipy.stats.chisquare(observed, expected[expected > 0] * draws)
  assert p_value > 1e-3, (observed, expected * draws)


@backends.parametrize("dtype", {backends.CPU: list(FLOAT_DTYPES),
                                backends.HARNESS: [jnp.float32, jnp.bfloat16]})
def test_nan_and_infinite_logits(backend, dtype):
  inf, nan = np.inf, np.nan
  x = jnp.asarray([
      [0.0, nan, 1.0, 2.0, 0.5],        # a NaN: -1
      [-inf, -inf, -inf, -inf, -inf],   # nothing to sample: -1
      [0.0, inf, 5.0, inf, -inf],       # the +inf tokens share the mass
      [-inf, 1.0, -inf, 0.5, -inf],     # -inf tokens are never drawn
  ] * 64, dtype)
  key = jax.random.key(5)
  kernel, reference_fn = (jax.jit(lambda x, impl=impl: jaxops.sample(key, x, top_p=0.95, **impl))
                          for impl in (FFI, XLA))
  tokens = np.asarray(kernel(x)).reshape(64, 4)
  np.testing.assert_array_equal(tokens, np.asarray(reference_fn(x)).reshape(64, 4))
  assert (tokens[:, 0] == -1).all() and (tokens[:, 1] == -1).all()
  assert set(tokens[:, 2].tolist()) == {1, 3}
  assert set(tokens[:, 3].tolist()) <= {1, 3}
  greedy = jaxops.sample(key, x[:4], temperature=0.0, **FFI)
  np.testing.assert_array_equal(greedy, [-1, -1, 1, 1])


def test_traced_parameters_are_clamped_like_the_reference():
  x = _logits(6, (8, 20), jnp.float32)
  params = dict(temperature=jnp.asarray([-1.0, jnp.nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
                top_k=jnp.asarray([3, 3, -5, 1000, 3, 3, 3, 3], jnp.int32),
                top_p=jnp.asarray([1, 1, 1, 1, -0.5, jnp.nan, 7.0, 0.5], jnp.float32),
                min_p=jnp.asarray([0, 0, 0, 0, 0, 0, jnp.nan, 3.0], jnp.float32))
  kernel, reference_fn = (jax.jit(lambda k, impl=impl: jaxops.sample(k, x, **params, **impl))
                          for impl in (FFI, XLA))
  for seed in range(8):
    key = jax.random.key(seed)
    tokens = kernel(key)
    np.testing.assert_array_equal(tokens, reference_fn(key))
    assert tokens[0] == jnp.argmax(x[0]) and tokens[1] == jnp.argmax(x[1])
    assert tokens[4] == jnp.argmax(x[4]) and tokens[7] == jnp.argmax(x[7])


def test_float64_logits_run_the_reference():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 9)))
    tokens = jax.jit(lambda x: jaxops.sample(jax.random.key(0), x, top_k=3))(x)
    assert tokens.dtype == jnp.int32
    assert "sample" not in " ".join(custom_call_targets(
        lambda x: jaxops.sample(jax.random.key(0), x, top_k=3), x))


# -- transformations ----------------------------------------------------------------


def test_vmap_over_rows_params_and_keys(backend):
  x = _logits(8, (3, 5, 40), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 3)
  top_p = jnp.asarray([[0.5, 0.9, 1.0, 0.3, 0.8]] * 3)
  f = lambda k, x, p: jaxops.sample(k, x, top_k=10, top_p=p, **FFI)
  loop = jnp.stack([f(keys[i], x[i], top_p[i]) for i in range(3)])
  np.testing.assert_array_equal(jax.vmap(f)(keys, x, top_p), loop)
  # logits mapped along axis 1, one key and parameters shared.
  out = jax.vmap(lambda x: f(keys[0], x, 0.7), in_axes=1)(x)
  np.testing.assert_array_equal(out, jnp.stack([f(keys[0], x[:, j], 0.7) for j in range(5)]))
  # Only the parameters mapped: the primitive sees unbatched logits.
  out = jax.vmap(lambda p: f(keys[1], x[0], p))(top_p)
  np.testing.assert_array_equal(out, jnp.stack([f(keys[1], x[0], top_p[i]) for i in range(3)]))
  # One kernel call ("jaxops_sample", or the harness's build of it).
  assert [t for t in custom_call_targets(jax.vmap(f), keys, x, top_p) if "sample" in t]


def test_new_parameter_values_do_not_recompile():
  traces = []

  @jax.jit
  def f(key, x, temperature, top_k, top_p, min_p):
    traces.append(1)
    return jaxops.sample(key, x, temperature=temperature, top_k=top_k, top_p=top_p,
                         min_p=min_p, **FFI)

  x = _logits(9, (4, 30), jnp.float32)
  for t, k, p, m in [(1.0, 5, 0.9, 0.0), (0.5, 20, 0.3, 0.1), (0.0, 1, 1.0, 0.5)]:
    f(jax.random.key(0), x, jnp.float32(t), jnp.int32(k), jnp.float32(p), jnp.float32(m))
  assert len(traces) == 1


def test_derivatives_of_code_around_it():
  """Integer output: float0 tangents, and grad flows around the sample."""
  x = _logits(11, (4, 12), jnp.float32)
  key = jax.random.key(2)
  f = lambda x: jaxops.sample(key, x, top_k=4, **FFI)
  tokens, tangent = jax.jvp(f, (x,), (jnp.ones_like(x),))
  assert tangent.dtype == jax.dtypes.float0 and tangent.shape == (4,)
  np.testing.assert_array_equal(tokens, f(x))
  chosen = lambda x: jnp.sum(x * jax.nn.one_hot(f(x), 12))
  grad = jax.grad(chosen)(x)
  np.testing.assert_array_equal(grad, jax.nn.one_hot(f(x), 12))
  assert "jaxops_sample" in custom_call_targets(jax.grad(chosen), x)


def test_rows_shard_without_gathering_the_vocabulary():
  mesh = meshes.make_mesh((2,), ("rows",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
  x = jax.device_put(_logits(12, (8, 50), jnp.float32), rows)
  key = jax.random.key(4)
  f = jax.jit(lambda x: jaxops.sample(key, x, top_k=7, top_p=0.8, **FFI))
  np.testing.assert_array_equal(f(x), jaxops.sample(key, x, top_k=7, top_p=0.8, **XLA))
  hlo = f.lower(x).compile().as_text()
  assert "jaxops_sample" in hlo and "all-gather" not in hlo


# -- bad input --------------------------------------------------------------------


KEY = jax.random.key(0)
X = jnp.zeros((2, 5))


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.sample(0, X), TypeError, "key must be a PRNG key"),
    (lambda: jaxops.sample(jnp.zeros(2), X), TypeError, "key must be a PRNG key"),
    (lambda: jaxops.sample(KEY, jnp.zeros(5)), ValueError, r"logits must have rank 2: \[batch, vocab\]"),
    (lambda: jaxops.sample(KEY, jnp.zeros((2, 0))), ValueError, "logits must have a non-empty last axis"),
    (lambda: jaxops.sample(KEY, jnp.zeros((2, 5), jnp.int32)), TypeError, "logits must have a floating dtype"),
    (lambda: jaxops.sample(KEY, [[1.0]]), TypeError, "logits must be an array"),
    (lambda: jaxops.sample(KEY, X, temperature=-0.5), ValueError, "temperature must be >= 0"),
    (lambda: jaxops.sample(KEY, X, temperature=float("inf")), ValueError, "temperature must be finite"),
    (lambda: jaxops.sample(KEY, X, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (lambda: jaxops.sample(KEY, X, top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (lambda: jaxops.sample(KEY, X, min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
    (lambda: jaxops.sample(KEY, X, top_k=2.5), TypeError, "top_k must be a Python int"),
    (lambda: jaxops.sample(KEY, X, top_k=jnp.ones(2)), TypeError, "top_k must have an integer dtype"),
    (lambda: jaxops.sample(KEY, X, top_p=jnp.ones(3)), ValueError, r"top_p must have shape \(\) or \(2,\), got \(3,\)"),
    (lambda: jaxops.sample(KEY, X, temperature=jnp.ones(2, jnp.int32)), TypeError, "temperature must have a floating dtype"),
    (lambda: jaxops.sample(KEY, X, implementation="cuda"), ValueError, "implementation must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


def _f32(*shape):
  return np.zeros(shape, np.float32)


@pytest.mark.parametrize("operands,results,match", [
    ([_f32(2, 5), _f32(3, 4), np.zeros(2, np.int32)], [((2,), np.int32)], "row_floats has shape"),
    ([_f32(2, 5), _f32(2, 3), np.zeros(2, np.int32)], [((2,), np.int32)], "row_floats has shape"),
    ([_f32(2, 5), _f32(2, 4), np.zeros(3, np.int32)], [((2,), np.int32)], "top_k has shape"),
    ([_f32(2, 5), _f32(2, 4), np.zeros(2, np.int32)], [((4,), np.int32)], "tokens has shape"),
    ([_f32(10), _f32(2, 4), np.zeros(2, np.int32)], [((2,), np.int32)], "logits must be"),
    ([np.zeros((2, 5), np.int32), _f32(2, 4), np.zeros(2, np.int32)], [((2,), np.int32)],
     "unsupported dtype"),
])
def test_handler_rejects_inconsistent_buffers(operands, results, match):
  call = jax.ffi.ffi_call("jaxops_sample", [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands))
