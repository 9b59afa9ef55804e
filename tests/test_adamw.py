"""jaxops.optim.adamw against optax.adamw.

Tests taking `backend` run on the CPU kernel and on the CUDA kernel
(cuda/adamw.cu) in the harness (tests/support/backends.py). The rest (rules,
kernel selection, validation) are backend-independent.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxops
from support import backends
from jaxops._src import ffi_targets
from jaxops.testing import assert_close, assert_tree_close, random_inputs


def _params(dtype=jnp.float32):
  """A small model's parameters: nested containers, a scalar, a size-1 leaf,
  prime and multi-thread-sized shapes, and an empty leaf."""
  w1, b1, w2, big = random_inputs(0, [(7, 13), (13,), (13, 3), (257, 131)], dtype, scale=0.5)
  return {"dense": [{"w": w1, "b": b1}, {"w": w2, "b": jnp.zeros((3,), dtype)}],
          "scale": jnp.asarray(0.7, dtype), "bias1": jnp.ones((1,), dtype), "big": big,
          "empty": jnp.zeros((0, 4), dtype)}


def _loss(params, x):
  h = jnp.tanh(x @ params["dense"][0]["w"] + params["dense"][0]["b"])
  y = h @ params["dense"][1]["w"] + params["dense"][1]["b"]
  extra = jnp.mean(jnp.sin(params["big"])) + params["empty"].sum()
  return jnp.mean((y * params["scale"] + params["bias1"]) ** 2) + extra


def _train(tx, params, steps, fused=False):
  """Runs `steps` jitted steps; returns the parameters after each."""
  xs = random_inputs(1, [(steps, 16, 7)])[0]

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    if fused:
      return tx.step(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  history = []
  for i in range(steps):
    params, state = step(params, state, xs[i])
    history.append(params)
  return history, state


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=10, decay_steps=100)


def _objective(params):
  """A parabola plus the Rosenbrock function (on the real and imaginary parts
  for complex parameters), and a small tree the mask cases select from."""
  q, r, misc = params["parabola"], params["rosenbrock"], params["misc"]
  d = q - 0.5 * jnp.arange(q.shape[0])
  parabola = jnp.sum((d * jnp.conj(d)).real)
  x, y = (r.real, r.imag) if jnp.iscomplexobj(r) else (r[0], r[1])
  rosenbrock = jnp.sum((1 - x) ** 2 + 100 * (y - x ** 2) ** 2)
  tied = misc["scale"] * misc["bias"]
  return parabola + rosenbrock + jnp.sum((tied * jnp.conj(tied)).real)


def _objective_params(dtype):
  rng = np.random.default_rng(0)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    draw = lambda *shape: rng.normal(size=shape) + 1j * rng.normal(size=shape)
    rosenbrock = draw(3) * 0.5
  else:
    draw = lambda *shape: rng.normal(size=shape)
    rosenbrock = draw(2, 3) * 0.5
  tree = {"parabola": draw(5), "rosenbrock": rosenbrock,
          "misc": {"scale": draw(2, 2), "bias": draw(2)}}
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def _descend(pairs, params, steps=100):
  """For each (ours, theirs) pair of transformations, ``steps`` steps of
  gradient descent on _objective from ``params``, all under one jit (a scan
  each); returns [(our params after each step, theirs), ...]."""

  def run(tx):
    def body(carry, _):
      p, state = carry
      updates, state = tx.update(jax.grad(_objective)(p), state, p)
      p = optax.apply_updates(p, updates)
      return (p, state), p

    return jax.lax.scan(body, (params, tx.init(params)), None, length=steps)[1]

  return jax.jit(lambda: [(run(ours), run(theirs)) for ours, theirs in pairs])()


def _is_matrix(tree):
  return jax.tree.map(lambda x: jnp.ndim(x) > 1, tree)


WEIGHT_DECAY_SCHEDULE = optax.linear_schedule(0.1, 0.01, 100)
# Every option of optax.adamw, grouped: (learning rate, keyword arguments).
OPTION_GROUPS = [
    (1e-2, {}),  # the defaults, weight_decay=1e-4 included
    (SCHEDULE, dict(nesterov=True, eps_root=1e-8, weight_decay=0.1, b1=0.8, b2=0.99)),
    (1e-2, dict(mask={"parabola": True, "rosenbrock": False, "misc": True}, weight_decay=0.05,
                eps=1e-7)),
    (SCHEDULE, dict(mask=_is_matrix, weight_decay=WEIGHT_DECAY_SCHEDULE, eps=1e-6)),
    (1e-2, dict(mu_dtype=jnp.bfloat16, nesterov=True, weight_decay=0.01)),
    (3e-2, dict(weight_decay=0.0, eps_root=1e-6, b2=0.95)),
]


def _at_step(tree, step):
  """The parameters after step + 1, complex ones as (real, imaginary) pairs."""
  def leaf(x):
    x = x[step]
    return jnp.stack([x.real, x.imag]) if jnp.iscomplexobj(x) else x
  return jax.tree.map(leaf, tree)


def _assert_descents_match(results, groups, **tolerances):
  for (ours, theirs), (_, kwargs) in zip(results, groups):
    for step in (0, 9, 99):
      assert_tree_close(_at_step(ours, step), _at_step(theirs, step),
                        name=f"{sorted(kwargs)} step {step + 1}", **tolerances)


def _distance(tree, exact) -> float:
  """The largest |x - exact| / (1e-2 + |exact|) over the leaves."""
  return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float64) - e) / (1e-2 + jnp.abs(e))))
             for x, e in zip(jax.tree.leaves(tree), jax.tree.leaves(exact)))


def test_matches_optax_for_every_option_over_100_steps(backend):
  """float32 parameters on the kernel (CPU, and the CUDA kernel in the
  harness and on a GPU): nesterov, eps_root, masks (pytree prefix and
  callable), bfloat16 first moment, constant and scheduled learning rate and
  weight decay, 100 steps against optax.adamw.

  Both are float32 computations of one trajectory, which rounds differently
  on each backend (FMA contraction, XLA:GPU's excess precision for the
  bfloat16 moment's products) and which the Rosenbrock valley amplifies: so
  each is measured against optax in float64 (the same program under x64),
  and the kernel must be no further from it than a few times float32
  optax is, plus a few float32 ulps. The first GPU run compared the two
  float32 runs directly and missed by 7.1e-5 against 6e-5 at step 10."""
  pairs = [(jaxops.optim.adamw(lr, **kwargs, implementation="ffi"), optax.adamw(lr, **kwargs))
           for lr, kwargs in OPTION_GROUPS]
  params = _objective_params(jnp.float32)
  jaxpr = str(jax.make_jaxpr(pairs[4][0].update)(params, pairs[4][0].init(params), params))
  assert "jaxops_adamw_update" in jaxpr and "bf16" in jaxpr  # the bfloat16 moment is the kernel's
  results = _descend(pairs, params)
  with jax.enable_x64(True):
    exact = _descend([(optax.adamw(lr, **kwargs),) * 2 for lr, kwargs in OPTION_GROUPS],
                     _objective_params(jnp.float64))
    for (ours, theirs), (exact_path, _), (_, kwargs) in zip(results, exact, OPTION_GROUPS):
      for step in (0, 9, 99):
        reference = _at_step(exact_path, step)
        ours_error = _distance(_at_step(ours, step), reference)
        optax_error = _distance(_at_step(theirs, step), reference)
        assert ours_error <= 4 * optax_error + 2e-6, (
            f"{sorted(kwargs)} step {step + 1}: jaxops is {ours_error:.2e} from float64 optax, "
            f"float32 optax {optax_error:.2e}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_low_precision_parameters_keep_optax_first_moment(backend, dtype):
  """With mu_dtype=None the first moment has the parameters' dtype, as in
  optax.adamw: the kernel reads and writes it, and 20 steps track optax's to
  the dtype's precision. (optax also keeps v in that dtype, where b2 = 0.999
  rounds to 1.0 in bfloat16; jaxops' v is float32, which over 20 steps moves
  the denominators by less than the dtype's resolution.)"""
  pairs = [(jaxops.optim.adamw(1e-2, **kwargs, implementation="ffi"), optax.adamw(1e-2, **kwargs))
           for kwargs in ({}, dict(nesterov=True, weight_decay=0.05))]
  params = _objective_params(dtype)
  ours, theirs = pairs[0]
  theirs_mu = optax.tree_utils.tree_get(theirs.init(params), "mu")
  assert jax.tree.map(lambda m: m.dtype, ours.init(params).mu) == jax.tree.map(
      lambda m: m.dtype, theirs_mu) == jax.tree.map(lambda _: jnp.dtype(dtype), params)
  kernels = [e for e in jax.make_jaxpr(ours.update)(params, ours.init(params), params).jaxpr.eqns
             if e.primitive.name.startswith("jaxops_adamw")]
  # The kernel's m: operand 3 of every leaf's four after the scalars.
  assert kernels and all(m.aval.dtype == dtype for e in kernels for m in e.invars[3::4])
  for (ours_path, theirs_path), (_, kwargs) in zip(_descend(pairs, params, steps=20), [
      (None, {}), (None, dict(nesterov=True))]):
    for step in (0, 4, 19):
      assert_tree_close(_at_step(ours_path, step), _at_step(theirs_path, step), dtype=dtype,
                        name=f"{sorted(kwargs)} step {step + 1}")


def test_complex_parameters_match_optax_on_the_reference():
  groups = [(1e-2, {}), (SCHEDULE, dict(nesterov=True, eps_root=1e-8, weight_decay=0.1,
                                        mask={"parabola": False, "rosenbrock": True,
                                              "misc": True}))]
  pairs = [(jaxops.optim.adamw(lr, **kwargs), optax.adamw(lr, **kwargs)) for lr, kwargs in groups]
  params = _objective_params(jnp.complex64)
  assert "jaxops_adamw" not in str(jax.make_jaxpr(pairs[0][0].update)(
      params, pairs[0][0].init(params), params))
  _assert_descents_match(_descend(pairs, params), groups, atol=2e-6, rtol=2e-5)
  with pytest.raises(TypeError, match="implementation='ffi' has no kernel for params.* of dtype complex64"):
    tx = jaxops.optim.adamw(1e-2, implementation="ffi")
    tx.update(params, tx.init(params), params)


def test_float64_parameters_match_optax_on_the_reference():
  with jax.enable_x64(True):
    params = _objective_params(jnp.float64)
    ((ours, theirs),) = _descend([(jaxops.optim.adamw(1e-2, nesterov=True),
                                   optax.adamw(1e-2, nesterov=True))], params, steps=20)
    assert jax.tree.leaves(ours)[0].dtype == jnp.float64
    assert_tree_close(ours, theirs, atol=1e-12, rtol=1e-10)
    with pytest.raises(TypeError, match="float64"):
      tx = jaxops.optim.adamw(1e-2, implementation="ffi")
      tx.update(params, tx.init(params), params)


def test_inject_hyperparams_chain_and_multisteps_match_optax():
  """optax's wrappers around jaxops' adamw: hyper-parameters injected (and
  changed every step: traced kernel operands), a chain, gradient accumulation."""

  def wrapped(adamw):
    inject = optax.inject_hyperparams(adamw)(learning_rate=1e-2, b1=0.8, weight_decay=0.1,
                                             eps_root=1e-8)
    return [inject,
            # Clipped to 10: at 1, Rosenbrock's valley turns float32 rounding
            # differences chaotic after ~70 steps (our jnp reference stays
            # bit-identical to optax there; the kernel differs by an ulp).
            optax.chain(optax.clip_by_global_norm(10.0), adamw(1e-2, nesterov=True)),
            optax.MultiSteps(adamw(SCHEDULE, weight_decay=0.05), every_k_schedule=3)]

  kernel_adamw = functools.partial(jaxops.optim.adamw, implementation="ffi")
  pairs = list(zip(wrapped(kernel_adamw), wrapped(optax.adamw)))
  params = _objective_params(jnp.float32)

  def varying_learning_rate(tx):
    # inject_hyperparams' state holds the learning rate: change it every step.
    def update(updates, state, params):
      lr = 1e-2 * (1.5 + jnp.sin(state.count.astype(jnp.float32)))
      state = state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})
      return tx.update(updates, state, params)
    return optax.GradientTransformation(tx.init, update)

  pairs[0] = tuple(varying_learning_rate(tx) for tx in pairs[0])
  ours = pairs[0][0]
  assert "jaxops_adamw_update" in str(jax.make_jaxpr(ours.update)(
      params, ours.init(params), params))
  _assert_descents_match(_descend(pairs, params), [(None, {"inject": 1}), (None, {"chain": 1}),
                                                   (None, {"multisteps": 1})],
                         atol=2e-6, rtol=2e-5)


def test_traced_hyperparameters_run_the_kernel_without_recompiling():
  params = _objective_params(jnp.float32)
  grads = jax.grad(_objective)(params)
  names = ("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")

  @jax.jit
  def update(hyper):
    tx = jaxops.optim.adamw(**hyper, implementation="ffi")
    return tx.update(grads, tx.init(params), params)[0]

  for values in [(1e-2, 0.9, 0.999, 1e-8, 0.0, 1e-4), (3e-3, 0.5, 0.9, 1e-3, 1e-6, 0.2)]:
    hyper = {k: jnp.float32(v) for k, v in zip(names, values)}
    theirs = optax.adamw(**dict(zip(names, values)))
    expected = theirs.update(grads, theirs.init(params), params)[0]
    assert_tree_close(update(hyper), expected, atol=1e-7, rtol=1e-5)
  assert update._cache_size() == 1
  assert "jaxops_adamw_update" in str(jax.make_jaxpr(update)(hyper))


def test_signature_extra_args_and_class_are_optax_adamw_s():
  ours = inspect.signature(jaxops.optim.adamw).parameters
  theirs = inspect.signature(optax.adamw).parameters
  assert list(ours)[:-1] == list(theirs) and list(ours)[-1] == "implementation"
  for name, parameter in theirs.items():
    assert (ours[name].kind, ours[name].default) == (parameter.kind, parameter.default), name
  tx = jaxops.optim.adamw(1e-2)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  params = _objective_params(jnp.float32)
  grads = jax.grad(_objective)(params)
  state = tx.init(params)
  plain = tx.update(grads, state, params)
  assert_tree_close(tx.update(grads, state, params, value=jnp.float32(3.0), key=None), plain,
                    atol=0, rtol=0)
  stepped, _ = tx.step(grads, state, params, value=1.0)
  assert_tree_close(stepped, optax.apply_updates(params, plain[0]), atol=1e-7, rtol=1e-6)


def test_nan_and_inf_propagate_as_in_the_reference(backend):
  """NaN, +inf and -inf in each of grads, params, m and v, for every kernel
  option and both first-moment dtypes: the kernel gives NaN and inf exactly
  where the jnp reference does (and the same finite values elsewhere)."""
  special = [np.nan, np.inf, -np.inf]
  rng = np.random.default_rng(1)
  g, p, m = (rng.normal(size=24).astype(np.float32) for _ in range(3))
  v = np.abs(rng.normal(size=24)).astype(np.float32) * 0.1
  for k, array in enumerate((g, p, m, v)):
    array[6 * k:6 * k + 3] = special
  g[15], m[16], p[17] = np.inf, np.inf, -np.inf  # inf meeting finite and special values

  def all_options(implementation):
    out = []
    for mu_dtype in (None, jnp.bfloat16):
      for nesterov in (False, True):
        for weight_decay in (0.0, 0.1):
          tx = jaxops.optim.adamw(1e-2, weight_decay=weight_decay, nesterov=nesterov,
                                  mu_dtype=mu_dtype, implementation=implementation)
          state = jaxops.optim.AdamWState(jnp.int32(3), m.astype(mu_dtype or np.float32), v)
          out.append((tx.update(g, state, p), tx.step(g, state, p)))
    return out

  kernel = jax.jit(lambda: all_options("ffi"))()
  expected = jax.jit(lambda: all_options("xla"))()
  assert_tree_close(kernel, expected, atol=1e-6, rtol=1e-5)
  assert any(np.isnan(np.asarray(leaf, np.float32)).any() for leaf in jax.tree.leaves(expected))


def test_step_equals_update_then_apply_updates():
  """The kernel's step against its own update then apply_updates (to an ulp),
  and against implementation=None's update (the jnp form: float32 rounding)."""
  tx = jaxops.optim.adamw(SCHEDULE, weight_decay=0.05, implementation="ffi")
  via_update, state_u = _train(tx, _params(), 20)
  fused, state_f = _train(tx, _params(), 20, fused=True)
  assert_tree_close(fused[-1], via_update[-1], atol=1e-7, rtol=1e-6)
  assert_tree_close(state_f, state_u, atol=1e-7, rtol=1e-6)
  assert int(state_f.count) == 20
  # implementation=None: update on the jnp form, step on the same kernel as above.
  via_jnp_update, state_j = _train(jaxops.optim.adamw(SCHEDULE, weight_decay=0.05), _params(), 20)
  assert_tree_close(fused[-1], via_jnp_update[-1], atol=1e-6, rtol=1e-5)
  assert_tree_close(state_j, state_u, atol=1e-6, rtol=1e-5)


def test_state_layout():
  params = _params(jnp.bfloat16)
  state = jaxops.optim.adamw(1e-3).init(params)
  assert state.count.dtype == jnp.int32 and state.count.shape == ()
  for p, m, v in zip(jax.tree.leaves(params), jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)):
    assert m.shape == v.shape == p.shape
    assert m.dtype == jnp.bfloat16 and v.dtype == jnp.float32  # optax's mu dtype; v see adamw()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_low_precision_parameters(backend, dtype):
  """bfloat16/float16 parameters (first moment in their dtype, v float32): the
  kernel agrees with the jnp path."""
  steps = 10
  kernel, _ = _train(jaxops.optim.adamw(1e-2, implementation="ffi"), _params(dtype), steps)
  jnp_path, _ = _train(jaxops.optim.adamw(1e-2, implementation="xla"), _params(dtype), steps)
  assert_tree_close(kernel[-1], jnp_path[-1], dtype=dtype)
  fused, _ = _train(jaxops.optim.adamw(1e-2), _params(dtype), steps, fused=True)
  for leaf in jax.tree.leaves(fused[-1]):
    assert leaf.dtype == dtype


def test_mixed_dtypes_and_mismatched_gradient_dtype():
  params = {"a": jnp.ones((5, 3), jnp.bfloat16), "b": jnp.ones((4,), jnp.float32),
            "c": jnp.ones((2,), jnp.float16)}
  grads = {"a": jnp.full((5, 3), 0.5, jnp.bfloat16), "b": jnp.full((4,), -0.25, jnp.float32),
           # A float32 gradient for a float16 parameter takes the jnp path.
           "c": jnp.full((2,), 2.0, jnp.float32)}
  tx = jaxops.optim.adamw(0.1, weight_decay=0.01)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  expected, _ = optax.adamw(0.1, weight_decay=0.01).update(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads),
      optax.adamw(0.1, weight_decay=0.01).init(jax.tree.map(lambda p: p.astype(jnp.float32),
                                                             params)),
      jax.tree.map(lambda p: p.astype(jnp.float32), params))
  for key in params:
    assert updates[key].dtype == params[key].dtype
    assert_close(updates[key], expected[key].astype(params[key].dtype), dtype=params[key].dtype)


@pytest.mark.parametrize("grad_dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("method", ["update", "step"])
def test_low_precision_gradients_of_float32_parameters_run_the_kernel(backend, method, grad_dtype):
  """float16/bfloat16 gradients of float32 parameters under implementation="ffi":
  converted exactly and run on the kernel, with the jnp path's result."""
  params = {"w": random_inputs(4, [(7, 33)])[0], "b": jnp.zeros(5)}
  grads = jax.tree.map(lambda p: (jnp.cos(p) * 0.1 + 0.05).astype(grad_dtype), params)
  results = {}
  for implementation in ("ffi", "xla"):
    tx = jaxops.optim.adamw(1e-2, weight_decay=0.01, implementation=implementation)
    call = jax.jit(getattr(tx, method))
    results[implementation] = call(grads, tx.init(params), params)
    if implementation == "ffi":
      assert "jaxops_adamw" in str(jax.make_jaxpr(getattr(tx, method))(grads, tx.init(params),
                                                                        params))
  out, state = results["ffi"]
  for leaf in jax.tree.leaves(out):
    assert leaf.dtype == jnp.float32
  assert_tree_close((out, state.mu, state.nu),
                    (results["xla"][0], results["xla"][1].mu, results["xla"][1].nu))


def _mixed_tree():
  """Leaves of every kernel dtype (so first moments of every dtype), sizes
  around the CUDA kernel's 2048-element tile (full tiles of 16-byte packs and
  a short last one), a scalar and an empty leaf."""
  w, u, b = random_inputs(3, [(67, 61), (4099,), (3, 5)], jnp.float32, scale=0.5)
  return {"w": w, "u": u.astype(jnp.bfloat16), "b": b.astype(jnp.float16),
          "scale": jnp.asarray(0.7, jnp.bfloat16), "empty": jnp.zeros((0, 3), jnp.float32)}


def test_one_call_updates_leaves_of_mixed_dtypes_and_masks(backend):
  """Every leaf in one kernel call, whatever its dtypes and whether the mask
  decays it (the decayed leaves need not come first in the tree): update and
  step against the jnp path."""
  params = _mixed_tree()
  grads = jax.tree.map(lambda p: (jnp.cos(p.astype(jnp.float32)) * 0.1).astype(p.dtype), params)
  mask = {"w": False, "u": True, "b": False, "scale": True, "empty": True}
  for nesterov in (False, True):
    ours = jaxops.optim.adamw(1e-2, weight_decay=0.1, mask=mask, nesterov=nesterov,
                              implementation="ffi")
    xla = jaxops.optim.adamw(1e-2, weight_decay=0.1, mask=mask, nesterov=nesterov,
                             implementation="xla")
    state = ours.init(params)
    state = state._replace(count=jnp.int32(2), mu=jax.tree.map(lambda m: m + 0.01, state.mu),
                           nu=jax.tree.map(lambda v: v + 1e-4, state.nu))
    for method in ("update", "step"):
      call = lambda tx: getattr(tx, method)(grads, state, params)
      eqns = jax.make_jaxpr(lambda: call(ours))().jaxpr.eqns
      assert sum(e.primitive.name.startswith("jaxops_adamw") for e in eqns) == 1, method
      got, expected = jax.jit(lambda: call(ours))(), jax.jit(lambda: call(xla))()
      for key, p in params.items():
        assert got[0][key].dtype == p.dtype and got[1].mu[key].dtype == p.dtype
        assert_close(got[0][key], expected[0][key], dtype=p.dtype, name=f"{method} out {key}")
        assert_close(got[1].mu[key], expected[1].mu[key], dtype=p.dtype, name=f"{method} mu {key}")
        assert_close(got[1].nu[key], expected[1].nu[key], dtype=jnp.float32,
                     name=f"{method} nu {key}")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_update_takes_the_fused_jnp_form_under_none(monkeypatch, platform):
  """On every backend, implementation=None runs ``update`` as jnp (XLA fuses
  it with optax.apply_updates: 7 array passes, where the kernel's update is
  10 and measured 0.64x optax on the CPU) and ``step`` on the kernel;
  implementation='ffi' keeps the kernel for both. The choice is made at
  trace time; "cuda" lowers for the GPU with the default backend set to it
  (needs jaxops built with nvcc)."""
  from jaxops._src import primitive
  from support.lowering import custom_calls
  if platform == "cuda":
    if not ffi_targets.available("cuda"):
      pytest.skip("jaxops was built without nvcc: no CUDA kernel to choose")
    monkeypatch.setattr(primitive, "current_platform", lambda: "cuda")
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}

  def targets(implementation, method):
    tx = jaxops.optim.adamw(1e-3, implementation=implementation)
    fn = {"update": tx.update, "step": lambda g, s, p: tx.step(g, s, p)}[method]
    return [call[0] for call in custom_calls(fn, params, tx.init(params), params,
                                             platform=platform)]

  assert targets(None, "update") == []
  assert targets(None, "step") == ["jaxops_adamw"]
  assert targets("ffi", "update") == ["jaxops_adamw"]


def test_donated_state_and_params_are_updated_in_place():
  tx = jaxops.optim.adamw(1e-3)
  params = {"w": jnp.ones((64, 64)), "b": jnp.zeros((64,))}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)

  # Donated arguments in the order of the results: each buffer pairs with its
  # own update, and the kernels write in place with no copy around them.
  def fused_step(grads, params, state):
    return tx.step(grads, state, params)

  step = jax.jit(fused_step, donate_argnums=(1, 2))
  compiled = step.lower(grads, params, tx.init(params)).compile().as_text()
  assert compiled.count("output_to_operand_aliasing") == 1  # one custom call for both leaves
  assert " copy(" not in compiled
  state = tx.init(params)
  new_params, new_state = step(grads, params, state)
  assert params["w"].is_deleted() and state.mu["w"].is_deleted()
  # optax.adamw's default weight decay, 1e-4, on top of the unit Adam step.
  np.testing.assert_allclose(new_params["w"], 1 - 1e-3 * (1 + 1e-4), rtol=1e-6)
  np.testing.assert_allclose(new_state.mu["w"], 0.1 * 0.1, rtol=1e-6)


def test_update_is_written_over_gradients_computed_in_the_same_jit():
  """The standard train step (grads from jax.grad, params and state donated):
  the update reuses the gradient buffer and nothing is copied; gradients
  passed in as arguments get a fresh output instead (no copy either).
  (implementation="ffi": under None, update is the jnp form, which XLA fuses
  with apply_updates.)"""
  tx = jaxops.optim.adamw(1e-3, implementation="ffi")
  params = {"w": jnp.ones((64, 64)), "b": jnp.zeros((64,))}
  x = jnp.ones((4, 64))

  def apply(grads, params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def train_step(params, state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])))(params)
    return apply(grads, params, state)

  def given_gradients(params, state, grads):
    return apply(grads, params, state)

  for fn, kernel in ((train_step, "jaxops_adamw_update_in_grads"),
                     (given_gradients, "jaxops_adamw_update[")):
    args = (params, tx.init(params), x if fn is train_step else params)
    assert str(jax.make_jaxpr(fn)(*args)).count(kernel) == 1, kernel  # both leaves
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    # (In the entry computation: a fusion's body may end in a copy of its own.)
    assert " copy(" not in compiled[compiled.index("ENTRY"):], kernel

  # Gradients still used after the update (returned here) are not overwritten.
  def also_returns_gradients(params, state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])))(params)
    return apply(grads, params, state), grads

  (new_params, _), grads = jax.jit(also_returns_gradients)(params, tx.init(params), x)
  expected = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])))(params)
  assert_tree_close(grads, expected, atol=0, rtol=0)
  assert_tree_close(new_params, apply(expected, params, tx.init(params))[0], atol=1e-7, rtol=1e-6)


def test_implementations_agree_and_kernel_is_used():
  params = _params()
  grads = jax.tree.map(lambda p: jnp.cos(p) * 0.1, params)
  for implementation in ("ffi", "xla"):
    tx = jaxops.optim.adamw(1e-2, weight_decay=0.1, implementation=implementation)
    out = jax.jit(tx.update)(grads, tx.init(params), params)
    if implementation == "ffi":
      kernel_out = out
      jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params).jaxpr
      # One kernel call for every leaf, the empty one included (a no-op).
      (call,) = [e for e in jaxpr.eqns if e.primitive.name.startswith("jaxops_adamw")]
      assert len(call.invars) == 1 + 4 * len(jax.tree.leaves(params))
  assert_tree_close(kernel_out, out, atol=1e-7, rtol=1e-6)


def test_vmap_over_an_ensemble():
  tx = jaxops.optim.adamw(1e-2, weight_decay=0.1, implementation="ffi")
  params = {"w": random_inputs(2, [(3, 5, 4)])[0], "b": jnp.zeros((3, 4))}
  grads = jax.tree.map(lambda p: jnp.sin(p) + 0.1, params)
  state = jax.vmap(tx.init)(params)
  batched = jax.vmap(tx.update)(grads, state, params)
  for i in range(3):
    one = jax.tree.map(lambda t: t[i], (grads, state, params))
    looped = tx.update(*one)
    assert_tree_close(jax.tree.map(lambda t: t[i], batched), looped, atol=1e-7, rtol=1e-6)


def test_handles_none_leaves_like_optax():
  params = {"a": jnp.ones(3), "b": None}
  tx = jaxops.optim.adamw(0.1)
  updates, state = tx.update({"a": jnp.ones(3), "b": None}, tx.init(params), params)
  assert updates["b"] is None and state.mu["b"] is None


@pytest.mark.backends(backends.HARNESS)
def test_update_and_fused_step_match_optax(backend):
  """12 steps with a schedule (the 100-step comparisons above are the CPU's)."""
  kwargs = dict(b1=0.8, b2=0.99, eps=1e-7, weight_decay=0.1)
  ours, _ = _train(jaxops.optim.adamw(SCHEDULE, **kwargs, implementation="ffi"), _params(), 12)
  theirs, _ = _train(optax.adamw(SCHEDULE, **kwargs), _params(), 12)
  assert_tree_close(ours[-1], theirs[-1], atol=1e-6, rtol=1e-5)
  fused, _ = _train(jaxops.optim.adamw(SCHEDULE, **kwargs), _params(), 12, fused=True)
  assert_tree_close(fused[-1], ours[-1], atol=1e-7, rtol=1e-6)


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.optim.adamw("1e-3"), TypeError, "learning_rate must be a Python float"),
    (lambda: jaxops.optim.adamw(1e-3, b1=1.0), ValueError, r"b1 must be in \[0.0, 1.0\)"),
    (lambda: jaxops.optim.adamw(1e-3, b2=-0.1), ValueError, "b2 must be in"),
    (lambda: jaxops.optim.adamw(1e-3, eps=-1.0), ValueError, "eps must be >= 0.0, got -1.0"),
    (lambda: jaxops.optim.adamw(1e-3, weight_decay=jnp.ones(2)), TypeError,
     "weight_decay must be a Python float"),
    (lambda: jaxops.optim.adamw(1e-3, implementation="cuda"), ValueError,
     "implementation must be one of"),
    (lambda: jaxops.optim.adamw(jnp.ones(2)), TypeError,
     "learning_rate must be a Python float, a real scalar array or a schedule, got an array"),
    (lambda: jaxops.optim.adamw(1e-3, eps_root=-1.0), ValueError, "eps_root must be >= 0.0"),
    (lambda: jaxops.optim.adamw(1e-3, mu_dtype=jnp.int32), TypeError,
     "mu_dtype must be None or a floating or complex dtype"),
    (lambda: jaxops.optim.adamw(1e-3, nesterov="yes"), TypeError, "nesterov must be"),
    (lambda: jaxops.optim.adamw(1e-3, mask={"w": "yes"}).update(
        {"w": jnp.ones(3)}, jaxops.optim.adamw(1e-3).init({"w": jnp.ones(3)}), {"w": jnp.ones(3)}),
     TypeError, "mask must have Python bools as leaves"),
    (lambda: jaxops.optim.adamw(1e-3, mu_dtype=jnp.complex64, implementation="ffi").update(
        {"w": jnp.ones(3)}, jaxops.optim.adamw(1e-3, mu_dtype=jnp.complex64).init(
            {"w": jnp.ones(3)}), {"w": jnp.ones(3)}),
     TypeError,
     r"state.mu\['w'\] must be float32, bfloat16 or float16 for implementation='ffi'"),
    (lambda: jaxops.optim.adamw(1e-3).init({"step": jnp.zeros((), jnp.int32)}), TypeError,
     r"params\['step'\] must have a floating dtype, got int32"),
    (lambda: jaxops.optim.adamw(1e-3).update({"w": jnp.ones(3)},
                                             jaxops.optim.adamw(1e-3).init({"w": jnp.ones(3)})),
     ValueError, "params must be given to update"),
    (lambda: jaxops.optim.adamw(1e-3).update({"w": jnp.ones(3)}, optax.adamw(1e-3).init(
        {"w": jnp.ones(3)}), {"w": jnp.ones(3)}), TypeError, "state must be the AdamWState"),
    (lambda: jaxops.optim.adamw(1e-3).update({"w": jnp.ones(4)}, jaxops.optim.adamw(1e-3).init(
        {"w": jnp.ones(3)}), {"w": jnp.ones(3)}), ValueError,
     r"grads\['w'\] must have shape params\['w'\].shape = \(3,\), got \(4,\)"),
    # A gradient tree unlike the parameters': named, with the leaves that differ.
    (lambda: jaxops.optim.adamw(1e-3).step(
        {"w": jnp.ones(3), "x": jnp.ones(2)},
        jaxops.optim.adamw(1e-3).init({"w": jnp.ones(3), "b": jnp.ones(2)}),
        {"w": jnp.ones(3), "b": jnp.ones(2)}), ValueError,
     r"jaxops.optim.adamw: grads must have the tree structure of params \(2 leaves\), "
     r"got lacks \['b'\]; has \['x'\]"),
    (lambda: jaxops.optim.adamw(1e-3).update(
        [jnp.ones(3)], jaxops.optim.adamw(1e-3).init((jnp.ones(3),)), (jnp.ones(3),)),
     ValueError, r"jaxops.optim.adamw: grads must have the tree structure of params"),
    (lambda: jaxops.optim.adamw(1e-3).step(
        {"w": jnp.ones(3)}, jaxops.optim.adamw(1e-3).init({"v": jnp.ones(3)}),
        {"w": jnp.ones(3)}), ValueError,
     r"state.mu must have the tree structure of params \(1 leaves\), got lacks \['w'\]"),
    # Under "ffi" the kernel reads gradients of the parameter's dtype: a wider
    # one is refused (rounding it would change the step).
    (lambda: jaxops.optim.adamw(1e-3, implementation="ffi").step(
        {"w": jnp.ones(3, jnp.float32)}, jaxops.optim.adamw(1e-3).init(
            {"w": jnp.ones(3, jnp.bfloat16)}), {"w": jnp.ones(3, jnp.bfloat16)}), TypeError,
     r"grads\['w'\] must have params\['w'\]'s dtype bfloat16 \(or one that converts to it "
     r"exactly\) for implementation='ffi', got float32"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


_SCALARS = np.ones(14, np.float32)
_LEAF = [np.ones(3, np.float32)] * 4


@pytest.mark.parametrize("operands,decayed,match", [
    ([_SCALARS, np.ones(4, np.float32)] + [np.ones(3, np.float32)] * 3, 1,
     r"grads\[0\] has shape"),
    ([_SCALARS] + _LEAF + [np.ones(3, np.float16)] + [np.ones(3, np.float32)] * 3, 2,
     r"grads\[1\] must have the dtype of params\[1\]"),
    ([_SCALARS] + [np.ones(3, np.float32)] * 2 + [np.ones(3, np.int32), np.ones(3, np.float32)],
     0, r"m\[0\] must be float32, bfloat16 or float16"),
    ([np.ones(12, np.float32)] + _LEAF, 1, "scalars has 12 elements, expected 14"),
    ([_SCALARS] + _LEAF, 2, "decayed_leaves is 2, expected 0..1"),
    ([_SCALARS] + _LEAF[:3], 0, "expected 4 operands"),
])
def test_handler_rejects_inconsistent_buffers(operands, decayed, match):
  attrs = dict(apply_updates=False, nesterov=False, decayed_leaves=np.int64(decayed))
  leaves = max(1, (len(operands) - 1) // 4)
  shape = operands[2].shape
  results = [jax.ShapeDtypeStruct(shape, np.float32)] * (3 * leaves)
  call = jax.ffi.ffi_call("jaxops_adamw", results)
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
