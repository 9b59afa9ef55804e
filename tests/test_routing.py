"""topk_router and moe_aux_loss against their jnp references.

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/routing.cu) in the harness (tests/support/backends.py), which runs every
CUDA thread on the CPU, so its shapes stay small. The rest (rules, kernel
selection, validation, the jnp-only moe_aux_loss) are backend-independent.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from jaxops.testing import (
    FLOAT_DTYPES,
    assert_close,
    assert_tree_close,
    check_transformations,
    custom_call_targets,
    jvp_against_reference,
    random_inputs,
    vjp_against_reference,
    vmap_against_loop,
)
from support import backends, meshes

# score, renormalize, with expert_bias, (num_groups, group_topk) or None.
CONFIGS = list(itertools.product(("softmax", "sigmoid"), (True, False), (False, True),
                                 (None, "groups")))


def _config_id(config):
  score, renormalize, bias, groups = config
  return f"{score}-{'renorm' if renormalize else 'raw'}-{'bias' if bias else 'nobias'}-{groups or 'flat'}"


def _router_args(seed, tokens, experts, dtype=jnp.float32, with_bias=False):
  logits, = random_inputs(seed, [(tokens, experts)], dtype, scale=2.0)
  bias = None
  if with_bias:
    bias = 0.05 * jax.random.normal(jax.random.key(seed + 100), (experts,), jnp.float32)
  return logits, bias


def _groups(experts, k, groups):
  """A group limit that divides `experts` and keeps at least k experts (None: none)."""
  if groups is None:
    return {}
  num_groups = next(g for g in (8, 4, 2, 1) if experts % g == 0)
  size = experts // num_groups
  group_topk = min(num_groups, max(1, -(-k // size) + (num_groups > 2)))
  return {"num_groups": num_groups, "group_topk": group_topk}


def _check_forward(logits, k, config, **close):
  score, renormalize, with_bias, groups = config
  experts_count = logits.shape[-1]
  bias = None
  if with_bias:
    bias = 0.05 * jax.random.normal(jax.random.key(experts_count), (experts_count,))
  kwargs = dict(score=score, renormalize=renormalize, expert_bias=bias,
                **_groups(experts_count, k, groups))
  weights, experts = jax.jit(lambda l: jaxops.topk_router(l, k, **kwargs))(logits)
  ref_weights, ref_experts = jax.jit(
      lambda l: reference.topk_router(l.astype(jnp.float32), k, **kwargs))(logits)
  assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
  assert weights.shape == experts.shape == (*logits.shape[:-1], k)
  np.testing.assert_array_equal(experts, ref_experts, err_msg=f"experts {kwargs}")
  assert_close(weights, ref_weights, name=f"weights {kwargs}", **close)


# Shapes (tokens, experts, k): one expert, k = experts, primes, 128 experts.
CPU_SHAPES = [(1, 1, 1), (5, 7, 3), (3, 7, 7), (37, 128, 8), (11, 64, 6)]
HARNESS_SHAPES = [(1, 1, 1), (3, 7, 7), (5, 40, 5), (2, 128, 8)]


# Every configuration in float32; the low-precision inputs (only the score
# computation's input differs) on the configurations that take each code path:
# plain softmax, grouped sigmoid with a bias, grouped renormalised softmax with a bias.
KEY_CONFIGS = [c for c in CONFIGS if c[1:] in [(True, False, None), (False, True, "groups"),
                                              (True, True, "groups")]]
_FORWARD_CASES = {
    backends.CPU: [(c, jnp.float32) for c in CONFIGS]
    + [(c, d) for c in KEY_CONFIGS for d in (jnp.bfloat16, jnp.float16)],
    backends.HARNESS: [(c, jnp.float32) for c in CONFIGS] + [(c, jnp.bfloat16) for c in KEY_CONFIGS],
}


@backends.parametrize("config,dtype", _FORWARD_CASES,
                      ids=lambda case: f"{_config_id(case[0])}-{jnp.dtype(case[1]).name}")
def test_forward_matches_reference(backend, config, dtype):
  shapes = CPU_SHAPES if backend == backends.CPU else HARNESS_SHAPES
  if backend != backends.CPU and config not in KEY_CONFIGS:
    shapes = shapes[:2]
  for seed, (tokens, experts, k) in enumerate(shapes):
    logits, _ = _router_args(seed, tokens, experts, dtype)
    # Weights are float32 from float32 scores: the float32 tolerance for every dtype.
    _check_forward(logits, k, config, atol=1e-5, rtol=1e-5)


def test_leading_axes_are_tokens(backend):
  logits, = random_inputs(1, [(2, 3, 5, 16)])
  weights, experts = jaxops.topk_router(logits, 4, num_groups=4, group_topk=2)
  ref = reference.topk_router(logits, 4, num_groups=4, group_topk=2)
  np.testing.assert_array_equal(experts, ref[1])
  assert_close(weights, ref[0])


def test_ties_go_to_the_lower_index(backend):
  # Quantised logits: many exact ties, in the scores and in the group scores.
  logits = jnp.round(random_inputs(2, [(24, 32)])[0]) / 2
  logits = logits.at[0].set(0.0).at[1].set(jnp.where(jnp.arange(32) % 3 == 0, 1.0, 0.0))
  for kwargs in ({}, {"score": "sigmoid"}, {"num_groups": 8, "group_topk": 3},
                 {"num_groups": 4, "group_topk": 2, "expert_bias": jnp.zeros(32)}):
    weights, experts = jaxops.topk_router(logits, 6, **kwargs)
    ref_weights, ref_experts = reference.topk_router(logits, 6, **kwargs)
    np.testing.assert_array_equal(experts, ref_experts, err_msg=str(kwargs))
    assert_close(weights, ref_weights)
  np.testing.assert_array_equal(jaxops.topk_router(logits, 6)[1][0], np.arange(6))


def test_nan_scores_rank_last(backend):
  logits = random_inputs(3, [(4, 9)])[0].at[:, 2].set(jnp.nan)
  weights, experts = jaxops.topk_router(logits, 8, score="sigmoid")
  ref_weights, ref_experts = reference.topk_router(logits, 8, score="sigmoid")
  np.testing.assert_array_equal(experts, ref_experts)
  assert not np.any(np.asarray(experts) == 2)
  assert_close(weights, ref_weights)


@pytest.mark.parametrize("special", [jnp.nan, jnp.inf, -jnp.inf], ids=str)
def test_unselected_non_finite_logit_has_no_gradient(backend, special):
  """Sigmoid scores: a NaN or -inf logit is never selected and inf always is;
  an unselected expert's logit does not reach the weights, so its gradient is
  0, as in the reference (which gathers the logits before the sigmoid: issue
  43's sweep found it giving NaN there). Every other gradient is finite."""
  logits = random_inputs(5, [(3, 12)])[0].at[1, 4].set(special)
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x, 3, score="sigmoid")[0]))
  grad = jax.grad(loss(jaxops.topk_router))(logits)
  ref_grad = jax.grad(loss(reference.topk_router))(logits)
  assert np.isfinite(np.asarray(grad)).all() and np.isfinite(np.asarray(ref_grad)).all()
  assert_close(grad, ref_grad)
  if not special > 0:
    assert np.asarray(grad)[1, 4] == 0.0


def test_bias_moves_the_selection_not_the_weights(backend):
  logits, = random_inputs(4, [(6, 16)])
  bias = jnp.zeros(16).at[5].set(10.0)
  weights, experts = jaxops.topk_router(logits, 2, expert_bias=bias, renormalize=False)
  assert np.all(np.asarray(experts)[:, 0] == 5)
  assert_close(weights[:, 0], jax.nn.softmax(logits, axis=-1)[:, 5])


def test_softmax_without_renormalize_gives_probabilities(backend):
  logits, = random_inputs(5, [(3, 10)])
  weights, experts = jaxops.topk_router(logits, 10, renormalize=False)
  probs = jax.nn.softmax(logits, axis=-1)
  assert_close(weights, jnp.take_along_axis(probs, experts, axis=-1))
  assert_close(jnp.sum(weights, axis=-1), jnp.ones(3))
  assert np.all(np.diff(np.asarray(weights), axis=-1) <= 0)


# -- derivatives --------------------------------------------------------------------------

GRAD_CONFIGS = [("softmax", True, {}), ("softmax", False, {"num_groups": 4, "group_topk": 2}),
                ("sigmoid", True, {"num_groups": 4, "group_topk": 3})]


def _weights_fn(router, k, score, renormalize, extra):
  return lambda logits: router(logits, k, score=score, renormalize=renormalize, **extra)[0]


@pytest.mark.parametrize("score,renormalize,extra", GRAD_CONFIGS, ids=lambda c: str(c))
def test_check_grads_order_2(score, renormalize, extra):
  logits, = random_inputs(6, [(3, 8)])
  fn = _weights_fn(jaxops.topk_router, 3, score, renormalize, extra)
  check_grads(fn, [logits], order=2, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", ["vjp", "jvp"])
@backends.parametrize("dtype", {backends.CPU: list(FLOAT_DTYPES),
                                backends.HARNESS: [jnp.float32, jnp.float16]})
def test_derivatives_match_reference(backend, dtype, mode):
  check = vjp_against_reference if mode == "vjp" else jvp_against_reference
  tokens, experts = (19, 32) if backend == backends.CPU else (3, 16)
  logits, bias = _router_args(7, tokens, experts, dtype, with_bias=True)
  for score, renormalize, extra in GRAD_CONFIGS:
    extra = dict(extra, expert_bias=bias)
    check(jax.jit(_weights_fn(jaxops.topk_router, 4, score, renormalize, extra)),
          _weights_fn(reference.topk_router, 4, score, renormalize, extra), [logits],
          dtype=dtype, reduce_size=experts)


def test_transformations():
  logits, = random_inputs(8, [(4, 12)])
  for score, renormalize, extra in GRAD_CONFIGS[1:2]:
    check_transformations(_weights_fn(jaxops.topk_router, 3, score, renormalize, extra),
                          _weights_fn(reference.topk_router, 3, score, renormalize, extra),
                          [logits], forward_kernel="jaxops_topk_router_fwd",
                          checkpoint_name="jaxops.topk_router", atol=2e-5, rtol=2e-5)


def test_expert_bias_has_no_gradient():
  logits, = random_inputs(9, [(5, 8)])
  bias = jnp.linspace(-0.1, 0.1, 8)
  grad = jax.grad(lambda b: jnp.sum(jnp.sin(jaxops.topk_router(logits, 3, expert_bias=b)[0])))
  np.testing.assert_array_equal(grad(bias), np.zeros(8))
  _, (_, experts_tangent) = jax.jvp(lambda l: jaxops.topk_router(l, 3), (logits,), (logits,))
  assert experts_tangent.dtype == jax.dtypes.float0


def test_grad_and_jvp_run_the_kernels():
  logits, = random_inputs(10, [(4, 16)])
  f = lambda l: jaxops.topk_router(l, 2)[0]
  assert custom_call_targets(jax.grad(lambda l: jnp.sum(jnp.sin(f(l)))), logits) == [
      "jaxops_topk_router_fwd", "jaxops_topk_router_bwd"]
  assert custom_call_targets(lambda l: jax.jvp(f, (l,), (l,)), logits) == [
      "jaxops_topk_router_fwd", "jaxops_topk_router_jvp"]


# -- vmap, sharding ----------------------------------------------------------------------


def test_vmap_in_axes(backend):
  logits, = random_inputs(11, [(3, 5, 16)])
  bias = jnp.linspace(-0.2, 0.2, 16)
  f = lambda l, b: jaxops.topk_router(l, 4, expert_bias=b, num_groups=4, group_topk=2)
  vmap_against_loop(f, [logits, bias], (0, None))
  vmap_against_loop(f, [jnp.moveaxis(logits, 0, 1), bias], (1, None))
  # A bias per batch element takes the reference's path.
  vmap_against_loop(f, [logits, jnp.stack([bias, -bias, 2 * bias])], (0, 0))
  nested = jax.vmap(jax.vmap(lambda l: f(l, bias)))
  assert_tree_close(nested(logits[..., None, :]),
                    jax.vmap(jax.vmap(lambda l: reference.topk_router(
                        l, 4, expert_bias=bias, num_groups=4, group_topk=2)))(logits[..., None, :]))


def test_vmap_of_grad(backend):
  logits, = random_inputs(12, [(3, 4, 16)])
  loss = lambda router: lambda l: jnp.sum(jnp.sin(router(l, 4, score="sigmoid")[0]))
  assert_close(jax.vmap(jax.grad(loss(jaxops.topk_router)))(logits),
               jax.vmap(jax.grad(loss(reference.topk_router)))(logits), atol=2e-5, rtol=2e-5)


def test_sharded_over_tokens_runs_locally():
  mesh = meshes.make_mesh((4,), ("data",))
  logits, = random_inputs(13, [(16, 32)])
  step = jax.jit(jax.value_and_grad(lambda l: jnp.sum(jnp.sin(jaxops.topk_router(l, 4)[0]))))
  placed = jax.device_put(logits, NamedSharding(mesh, P("data")))
  compiled = step.lower(placed).compile()
  assert_tree_close(compiled(placed), step(logits))
  hlo = compiled.as_text()
  assert "jaxops_topk_router_fwd" in hlo and "jaxops_topk_router_bwd" in hlo
  assert "all-gather" not in hlo
  weights, experts = jax.jit(lambda l: jaxops.topk_router(l, 4))(placed)
  assert weights.sharding.spec[0] == "data" and experts.sharding.spec[0] == "data"


# -- implementations, bad input ------------------------------------------------------------


def test_implementations_agree():
  logits, = random_inputs(14, [(9, 24)])
  ffi = jaxops.topk_router(logits, 5, score="sigmoid", implementation="ffi")
  xla = jaxops.topk_router(logits, 5, score="sigmoid", implementation="xla")
  assert_tree_close(ffi, xla)
  jaxpr = str(jax.make_jaxpr(lambda l: jaxops.topk_router(l, 5, implementation="xla"))(logits))
  assert "jaxops_" not in jaxpr


def test_float64_takes_the_reference():
  with jax.enable_x64(True):
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)))
    weights, experts = jaxops.topk_router(logits, 3)
    assert weights.dtype == jnp.float64
    np.testing.assert_array_equal(experts, reference.topk_router(logits, 3)[1])


L = jnp.ones((4, 8))


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.topk_router(L, 0), ValueError, r"k must be in \[1, 8\], got 0"),
    (lambda: jaxops.topk_router(L, 9), ValueError, r"k must be in \[1, 8\], got 9"),
    (lambda: jaxops.topk_router(L, 2.0), TypeError, "k must be a Python int"),
    (lambda: jaxops.topk_router(L.astype(jnp.int32), 2), TypeError, "logits must have a floating dtype"),
    (lambda: jaxops.topk_router(jnp.float32(1.0), 1), ValueError, "logits must have rank >= 1"),
    (lambda: jaxops.topk_router(jnp.ones((4, 0)), 1), ValueError, "logits must have a non-empty last axis"),
    (lambda: jaxops.topk_router(L, 2, score="relu"), ValueError, "score must be one of"),
    (lambda: jaxops.topk_router(L, 2, renormalize=1), TypeError, "renormalize must be a Python bool"),
    (lambda: jaxops.topk_router(L, 2, expert_bias=jnp.ones(7)), ValueError, "expert_bias must have shape"),
    (lambda: jaxops.topk_router(L, 2, expert_bias=jnp.ones(8, jnp.int32)), TypeError, "expert_bias must have a floating dtype"),
    (lambda: jaxops.topk_router(L, 2, num_groups=3, group_topk=1), ValueError, "num_groups must divide num_experts=8, got 3"),
    (lambda: jaxops.topk_router(L, 2, num_groups=4), ValueError, "group_topk must be given with num_groups"),
    (lambda: jaxops.topk_router(L, 2, group_topk=1), ValueError, "num_groups must be given with group_topk"),
    (lambda: jaxops.topk_router(L, 2, num_groups=4, group_topk=5), ValueError, r"group_topk must be in \[1, 4\]"),
    (lambda: jaxops.topk_router(L, 5, num_groups=4, group_topk=2), ValueError, "group_topk must keep at least k=5 experts"),
    (lambda: jaxops.topk_router(L, 2, implementation="cuda"), ValueError, "implementation must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


_F32 = np.float32
_FWD_ATTRS = {"k": np.int64(2), "score": np.int64(0), "renormalize": True,
              "num_groups": np.int64(1), "group_topk": np.int64(1)}


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    ("jaxops_topk_router_fwd", [np.ones((3, 8), _F32), np.ones((0,), _F32)],
     [((3, 3), _F32), ((3, 2), np.int32)], _FWD_ATTRS, "weights has shape"),
    ("jaxops_topk_router_fwd", [np.ones((3, 8), _F32), np.ones((7,), _F32)],
     [((3, 2), _F32), ((3, 2), np.int32)], _FWD_ATTRS, "expert_bias has shape"),
    ("jaxops_topk_router_fwd", [np.ones((3, 8), _F32), np.ones((0,), _F32)],
     [((3, 2), _F32), ((3, 2), np.int32)], dict(_FWD_ATTRS, num_groups=np.int64(3)),
     "num_groups=3 must divide"),
    ("jaxops_topk_router_fwd", [np.ones((3, 8), _F32), np.ones((0,), _F32)],
     [((3, 2), _F32), ((3, 2), np.int32)], dict(_FWD_ATTRS, score=np.int64(7)), "score must be"),
    ("jaxops_topk_router_fwd", [np.ones((3, 8), _F32), np.ones((0,), _F32)],
     [((3, 9), _F32), ((3, 9), np.int32)], dict(_FWD_ATTRS, k=np.int64(9)), "k=9 must be"),
    ("jaxops_topk_router_bwd", [np.ones((3, 2), _F32), np.ones((3, 8), _F32),
                                np.ones((3, 2), np.float32)],
     [((3, 8), _F32)], {"score": np.int64(0), "renormalize": True}, "experts must have dtype int32"),
    ("jaxops_topk_router_jvp", [np.ones((3, 8), _F32), np.ones((3, 2), np.int32),
                                np.ones((3, 7), _F32)],
     [((3, 2), _F32)], {"score": np.int64(1), "renormalize": False}, "dlogits has shape"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))


def test_out_of_range_expert_ids_are_clamped(backend):
  """The backward kernel reads the ids it is given: out-of-range ones are
  clamped, as the reference clips them."""
  from jaxops._src.routing import topk_router_bwd_p
  logits, = random_inputs(15, [(3, 8)])
  experts = jnp.array([[0, 9], [-4, 3], [7, 100]], jnp.int32)
  dweights, = random_inputs(16, [(3, 2)])
  for score in (0, 1):
    out = topk_router_bwd_p(dweights, logits, experts, score=score, renormalize=True)[0]
    expected = topk_router_bwd_p.reference(dweights, logits, experts, score=score,
                                           renormalize=True)[0]
    assert_close(out, expected)


# -- moe_aux_loss --------------------------------------------------------------------------


def _aux_loss_numpy(probs, counts, k, coeff):
  probs = np.asarray(probs, np.float64).reshape(-1, probs.shape[-1])
  tokens, experts = probs.shape
  return coeff * experts * np.sum(np.asarray(counts, np.float64) / (tokens * k) * probs.mean(0))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_moe_aux_loss_values_and_gradient(dtype):
  logits, = random_inputs(17, [(2, 13, 7)])
  probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
  _, experts = jaxops.topk_router(logits, 2)
  counts = jnp.bincount(experts.reshape(-1), length=7)
  for c in (counts, counts.astype(jnp.float32)):
    loss = jaxops.moe_aux_loss(probs, c, 2, 0.01)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert_close(loss, _aux_loss_numpy(probs.astype(jnp.float32), counts, 2, 0.01), atol=1e-7,
                 rtol=1e-5)
  grad = jax.grad(lambda p: jaxops.moe_aux_loss(p, counts, 2, 0.01))(probs)
  expected = np.broadcast_to(0.01 * 7 * np.asarray(counts) / (26 * 2) / 26, probs.shape)
  assert_close(grad, expected.astype(np.float32), dtype=dtype)
  check_grads(lambda p: jaxops.moe_aux_loss(p, counts, 2, 0.01),
              [probs.astype(jnp.float32)], order=2)


def test_moe_aux_loss_is_coeff_for_a_balanced_router():
  probs = jnp.full((12, 4), 0.25)
  assert_close(jaxops.moe_aux_loss(probs, jnp.full(4, 6), 2, 0.5), 0.5)


def test_moe_aux_loss_over_no_tokens_is_zero():
  """As cross_entropy's mean over no tokens: 0 with a zero gradient, not 0 / 0."""
  counts = jnp.zeros(4, jnp.int32)
  for probs in (jnp.zeros((0, 4)), jnp.zeros((3, 0, 4), jnp.bfloat16)):
    loss, grad = jax.value_and_grad(lambda p: jaxops.moe_aux_loss(p, counts, 2, 0.01))(probs)
    assert loss.dtype == jnp.float32 and float(loss) == 0.0
    assert grad.shape == probs.shape


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.moe_aux_loss(jnp.ones((4, 3)), jnp.ones(4), 1, 1.0), ValueError, "expert_counts must have shape"),
    (lambda: jaxops.moe_aux_loss(jnp.ones((4, 3)), jnp.ones(3, bool), 1, 1.0), TypeError, "expert_counts must have an integer or floating dtype"),
    (lambda: jaxops.moe_aux_loss(jnp.ones((4, 3), jnp.int32), jnp.ones(3), 1, 1.0), TypeError, "probs must have a floating dtype"),
    (lambda: jaxops.moe_aux_loss(jnp.ones((4, 3)), jnp.ones(3), 0, 1.0), ValueError, "k must be"),
    (lambda: jaxops.moe_aux_loss(jnp.ones((4, 3)), jnp.ones(3), 1, "a"), TypeError, "coeff must be"),
    (lambda: jaxops.moe_aux_loss(jnp.ones((4, 3)), jnp.ones(3), 1, 1.0, implementation="ffi"), ValueError, "has no kernel"),
])
def test_moe_aux_loss_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call()
