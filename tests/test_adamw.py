"""jaxops.optim.adamw against optax.adamw.

Tests taking `backend` run on the CPU kernel and on the CUDA kernel
(cuda/adamw.cu) in the harness (tests/support/backends.py). The rest (rules,
kernel selection, validation) are backend-independent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxops
from support import backends
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


@pytest.mark.parametrize("learning_rate", [1e-2, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_optax_over_100_steps(learning_rate, weight_decay):
  kwargs = dict(b1=0.8, b2=0.99, eps=1e-7, weight_decay=weight_decay)
  ours, _ = _train(jaxops.optim.adamw(learning_rate, **kwargs), _params(), 100)
  theirs, _ = _train(optax.adamw(learning_rate, **kwargs), _params(), 100)
  for step in (0, 9, 49, 99):
    assert_tree_close(ours[step], theirs[step], atol=1e-6, rtol=1e-5, name=f"step {step + 1}")


def test_step_equals_update_then_apply_updates():
  tx = jaxops.optim.adamw(SCHEDULE, weight_decay=0.05)
  via_update, state_u = _train(tx, _params(), 20)
  fused, state_f = _train(tx, _params(), 20, fused=True)
  assert_tree_close(fused[-1], via_update[-1], atol=1e-7, rtol=1e-6)
  assert_tree_close(state_f, state_u, atol=1e-7, rtol=1e-6)
  assert int(state_f.count) == 20


def test_state_layout():
  params = _params(jnp.bfloat16)
  state = jaxops.optim.adamw(1e-3).init(params)
  assert state.count.dtype == jnp.int32 and state.count.shape == ()
  for p, m, v in zip(jax.tree.leaves(params), jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)):
    assert m.shape == v.shape == p.shape and m.dtype == v.dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_low_precision_parameters(backend, dtype):
  """bfloat16/float16 parameters with float32 moments: the kernel agrees with
  the jnp path, and both track a float32 run to the dtype's precision."""
  steps = 10
  kernel, _ = _train(jaxops.optim.adamw(1e-2), _params(dtype), steps)
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
  assert compiled.count("output_to_operand_aliasing") == 2  # one custom call per leaf
  assert " copy(" not in compiled
  state = tx.init(params)
  new_params, new_state = step(grads, params, state)
  assert params["w"].is_deleted() and state.mu["w"].is_deleted()
  np.testing.assert_allclose(new_params["w"], 1 - 1e-3, rtol=1e-6)
  np.testing.assert_allclose(new_state.mu["w"], 0.1 * 0.1, rtol=1e-6)


def test_works_inside_optax_chain():
  tx = optax.chain(optax.clip_by_global_norm(0.5), jaxops.optim.adamw(1e-2, weight_decay=0.1))
  reference = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
  ours, _ = _train(tx, _params(), 15)
  theirs, _ = _train(reference, _params(), 15)
  assert_tree_close(ours[-1], theirs[-1], atol=1e-6, rtol=1e-5)


def test_implementations_agree_and_kernel_is_used():
  params = _params()
  grads = jax.tree.map(lambda p: jnp.cos(p) * 0.1, params)
  for implementation in ("ffi", "xla"):
    tx = jaxops.optim.adamw(1e-2, weight_decay=0.1, implementation=implementation)
    out = jax.jit(tx.update)(grads, tx.init(params), params)
    if implementation == "ffi":
      kernel_out = out
      jaxpr = str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
      # One kernel per non-empty leaf and per empty one too (a no-op).
      assert jaxpr.count("jaxops_adamw_update") == len(jax.tree.leaves(params))
  assert_tree_close(kernel_out, out, atol=1e-7, rtol=1e-6)


def test_vmap_over_an_ensemble():
  tx = jaxops.optim.adamw(1e-2, weight_decay=0.1)
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
  ours, _ = _train(jaxops.optim.adamw(SCHEDULE, **kwargs), _params(), 12)
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
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


_SCALARS = np.ones(12, np.float32)


@pytest.mark.parametrize("operands,match", [
    ([np.ones(4, np.float32)] + [np.ones(3, np.float32)] * 3 + [_SCALARS], "grads has shape"),
    ([np.ones(3, np.float16)] + [np.ones(3, np.float32)] * 3 + [_SCALARS],
     "grads must have the dtype of params"),
    ([np.ones(3, np.float32)] * 2 + [np.ones(3, np.float16), np.ones(3, np.float32), _SCALARS],
     "m must be float32 or bfloat16"),
    ([np.ones(3, np.float32)] * 4 + [np.ones(11, np.float32)], "scalars has 11 elements"),
])
def test_handler_rejects_inconsistent_buffers(operands, match):
  attrs = dict(apply_updates=False, nesterov=False, decay=True)
  shape = operands[1].shape
  call = jax.ffi.ffi_call("jaxops_adamw", [jax.ShapeDtypeStruct(shape, operands[1].dtype),
                                           jax.ShapeDtypeStruct(shape, operands[2].dtype),
                                           jax.ShapeDtypeStruct(shape, np.float32)])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
