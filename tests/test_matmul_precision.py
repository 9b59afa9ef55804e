"""The float32 precision policy of the ops with products inside (docs/precision.md):
how a precision setting resolves, and what every op lowers to under it.

The policy is XLA's on a GPU: the default precision (and "high") lets float32
products run on TF32 tensor cores, "highest"/"float32" asks for full float32.
Each op resolves its ``precision`` argument (None: the context's
``jax_default_matmul_precision``) at trace time into the attribute
``allow_tf32`` of each of its custom calls, lowered alike for CUDA and the CPU
(whose kernels ignore it: full float32 at every setting). The test session runs
at "highest" (tests/conftest.py), so every test here sets its context
explicitly. What the kernels compute under each setting:
tests/test_matmul_precision_kernels.py.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxops
import jaxops.flax.linen as jaxops_linen
import jaxops.flax.nnx as jaxops_nnx
from jaxops._src import ffi_targets
from jaxops._src.matmul_precision import allow_tf32
from jaxops._src.primitive import ALL_PRIMITIVES
from jaxops.flax._serving_caches import BatchedKVCache
from jaxops.testing import assert_close, random_inputs
from support import backends
from support.lowering import custom_calls

# The config's values and the argument's names that XLA's GPU dots run in TF32.
TF32 = ("default", "high", "tensorfloat32", "bfloat16", "TF32_TF32_F32", "BF16_BF16_F32")
FULL = ("highest", "float32")


# -- resolving a precision ----------------------------------------------------------------


@pytest.mark.parametrize("setting", TF32)
def test_settings_xla_runs_in_tf32_allow_it(setting):
  with jax.default_matmul_precision(setting):
    assert allow_tf32("op")
  assert allow_tf32("op", setting)


@pytest.mark.parametrize("name", ["bfloat16_3x", "fastest", "DEFAULT"])
def test_argument_only_names_xla_runs_in_tf32_allow_it(name):
  """Names lax.dot's precision takes that the config does not."""
  assert allow_tf32("op", name)


@pytest.mark.parametrize("setting", FULL + ("F32_F32_F32", "TF32_TF32_F32_X3", "BF16_BF16_F32_X3",
                                            "BF16_BF16_F32_X6", "F64_F64_F64"))
def test_settings_more_precise_than_tf32_ask_for_float32(setting):
  with jax.default_matmul_precision(setting):
    assert not allow_tf32("op")
  assert not allow_tf32("op", setting)


def test_an_unset_config_is_xlas_default():
  with jax.default_matmul_precision(None):
    assert jax.config.jax_default_matmul_precision is None
    assert allow_tf32("op")


def test_the_argument_overrides_the_context():
  with jax.default_matmul_precision("highest"):
    assert allow_tf32("op", "default") and allow_tf32("op", lax.Precision.HIGH)
  with jax.default_matmul_precision("default"):
    assert not allow_tf32("op", lax.Precision.HIGHEST)
    assert not allow_tf32("op", lax.DotAlgorithmPreset.F32_F32_F32)
    assert not allow_tf32("op", lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32))


def test_a_pair_allows_tf32_only_if_both_operands_do():
  assert allow_tf32("op", ("default", lax.Precision.HIGH))
  assert not allow_tf32("op", (lax.Precision.DEFAULT, "highest"))


@pytest.mark.parametrize("bad,error,match", [
    ("fast", ValueError, "got str 'fast'"),
    (2, TypeError, "got int 2"),
    (("highest",), ValueError, "got a sequence of 1"),
    (("highest", 2), TypeError, "got int 2"),
])
def test_a_bad_precision_is_a_clear_error(bad, error, match):
  with pytest.raises(error, match=r"jaxops\.attention: precision must be None, a precision "
                     r"name .*" + re.escape(match)):
    allow_tf32("jaxops.attention", bad)


def test_each_public_op_checks_its_precision_at_trace_time():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="jaxops.attention: precision must"):
    jaxops.attention(q, q, q, precision="fast")
  with pytest.raises(TypeError, match="jaxops.patch_embed: precision must"):
    jaxops.patch_embed(jnp.ones((1, 4, 4, 3)), jnp.ones((2, 2, 3, 5)), patch_size=2,
                       precision=3)
  with pytest.raises(ValueError, match="jaxops.linear_cross_entropy: precision must"):
    jaxops.linear_cross_entropy(jnp.ones((3, 4)), jnp.ones((4, 5)), jnp.zeros(3, jnp.int32),
                                precision="fast")


# -- what each op lowers to ------------------------------------------------------------------

FFI = {"implementation": "ffi"}
Q = jnp.linspace(-1, 1, 2 * 5 * 4 * 16, dtype=jnp.float32).reshape(2, 5, 4, 16)
KV = Q[:, :, :2]
X = jnp.linspace(-2, 2, 6 * 40, dtype=jnp.float32).reshape(6, 40)
IMAGES = jnp.linspace(-1, 1, 2 * 4 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 4, 3)
KERNEL = jnp.linspace(-1, 1, 2 * 2 * 3 * 5, dtype=jnp.float32).reshape(2, 2, 3, 5)
TABLES = jnp.array([[0, 1], [1, 0]], jnp.int32)


def _every_mode(f):
  """f, its VJP and its JVP in one program: every target of the op."""
  def program(*args):
    y, vjp = jax.vjp(f, *args)
    return vjp(y), jax.jvp(f, args, args)

  return program


def _sparse(x, w, **kwargs):
  return jaxops.sparse.linear(x, jaxops.sparse.compress(jaxops.sparse.prune_2_4(w)[0]), **kwargs)


# name -> (function of precision, arguments, its targets): every target with
# products inside, each call taking the precision as its public op's argument.
PROGRAMS = {
    "attention": (lambda p: _every_mode(lambda q, k, v: jaxops.attention(
        q, k, v, is_causal=True, precision=p, **FFI)), (Q, KV, KV),
        {"jaxops_attention_fwd", "jaxops_attention_bwd", "jaxops_attention_fwd_jvp"}),
    "paged_attention": (lambda p: lambda q, pages: jaxops.paged_attention(
        q, pages, pages, TABLES, jnp.array([7, 3], jnp.int32), precision=p, **FFI), (Q[:, 0], Q),
        {"jaxops_paged_attention_fwd"}),
    "patch_embed": (lambda p: _every_mode(lambda i, k: jaxops.patch_embed(
        i, k, patch_size=2, precision=p, **FFI)), (IMAGES, KERNEL),
        {"jaxops_patch_embed_fwd", "jaxops_patch_embed_bwd"}),
    "sparse_linear": (lambda p: _every_mode(lambda x, w: _sparse(x, w, precision=p, **FFI)),
                      (X, X[:, :40]),
                      {"jaxops_sparse_linear_fwd", "jaxops_sparse_linear_dx",
                       "jaxops_sparse_linear_dvalues"}),
}
POLICY_TARGETS = sorted({t for _, _, targets in PROGRAMS.values() for t in targets})


def _allow_tf32(calls):
  """The values of the calls' allow_tf32 attributes."""
  return {re.search(r"allow_tf32 = (true|false)", call.text).group(1) == "true"
          for call in calls}


def test_exactly_the_targets_with_products_carry_the_policy():
  """Every kernel target with products inside declares allow_tf32 (a bool), and no other."""
  declared = sorted(p.target for p in ALL_PRIMITIVES if p.target is not None
                    and "allow_tf32" in ffi_targets.contract(p.target).attributes)
  assert declared == POLICY_TARGETS
  for target in POLICY_TARGETS:
    assert ffi_targets.contract(target).attributes["allow_tf32"] is np.bool_


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("program", list(PROGRAMS))
@pytest.mark.parametrize("setting,expected", [("default", True), ("highest", False),
                                              ("float32", False)])
def test_the_context_precision_is_each_calls_attribute(program, platform, setting, expected):
  make, args, targets = PROGRAMS[program]
  with jax.default_matmul_precision(setting):
    calls = custom_calls(make(None), *args, platform=platform)
  assert {call.target for call in calls} == targets
  assert _allow_tf32(calls) == {expected}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_argument_is_each_calls_attribute(program):
  make, args, _ = PROGRAMS[program]
  with jax.default_matmul_precision("highest"):
    assert _allow_tf32(custom_calls(make("default"), *args)) == {True}
  with jax.default_matmul_precision("default"):
    assert _allow_tf32(custom_calls(make("highest"), *args)) == {False}


def test_jit_retraces_under_another_setting():
  """One jitted function, lowered under each setting: the config is part of jit's
  cache key, so the second lowering is a new trace with the other attribute."""
  f = jax.jit(lambda q, k, v: jaxops.attention(q, k, v, **FFI))
  lowered = {}
  for setting in ("default", "highest"):
    with jax.default_matmul_precision(setting):
      lowered[setting] = f.lower(Q, KV, KV).as_text()
  assert "allow_tf32 = true" in lowered["default"]
  assert "allow_tf32 = false" in lowered["highest"]


def _dot_precisions(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return {m for m in re.findall(r"stablehlo\.dot_general.*precision = \[(\w+), \w+\]", text)}


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_dots_take_the_policys_precision(reduction):
  """linear_cross_entropy's matmuls are XLA dots: forward, gradient and tangent
  alike at DEFAULT (TF32 on a GPU) or HIGHEST, from the context or the argument."""
  labels = jnp.arange(6) % 5

  def program(precision):
    loss = lambda x, w: jaxops.linear_cross_entropy(x, w, labels, reduction=reduction,
                                                    precision=precision, **FFI).sum()
    return lambda x, w: (jax.grad(loss, (0, 1))(x, w), jax.jvp(loss, (x, w), (x, w)))

  args = (X[:, :8], X.T[:8, :5])
  with jax.default_matmul_precision("default"):
    assert _dot_precisions(program(None), *args) == {"DEFAULT"}
    assert _dot_precisions(program("float32"), *args) == {"HIGHEST"}
  with jax.default_matmul_precision("highest"):
    assert _dot_precisions(program(None), *args) == {"HIGHEST"}


# -- Flax: a module's precision sets its fused products' --------------------------------------


def _allow_tf32_of(fn, *args):
  return _allow_tf32(custom_calls(fn, *args))


@pytest.mark.parametrize("module_precision,setting,expected", [
    (None, "default", True), (None, "highest", False), ("highest", "default", False),
    ("default", "highest", True), (lax.Precision.HIGHEST, "default", False)])
def test_flax_modules_precision_decides_the_kernels(module_precision, setting, expected):
  """As Flax hands its modules' precision to every dot (projections and both
  attention products), jaxops' modules hand it to the fused op; None follows
  the context, as Flax's dots do."""
  x, rows = random_inputs(0, [(2, 4, 4, 3), (2, 16, 4)])
  tokens = x.reshape(2, 16, 3)
  linen_modules = [
      (jaxops_linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=16,
                                                 precision=module_precision,
                                                 implementation="ffi"), tokens),
      (jaxops_linen.PatchEmbed(features=5, patch_size=2, precision=module_precision,
                               implementation="ffi"), x),
      (jaxops_linen.SparseDense(features=6, precision=module_precision,
                                implementation="ffi"), rows),
  ]
  rngs = nnx.Rngs(0)
  nnx_modules = [
      (jaxops_nnx.MultiHeadAttention(num_heads=2, in_features=3, qkv_features=16, decode=False,
                                     precision=module_precision, implementation="ffi",
                                     rngs=rngs), tokens),
      (jaxops_nnx.PatchEmbed(3, 5, 2, precision=module_precision, implementation="ffi",
                             rngs=rngs), x),
      (jaxops_nnx.SparseDense(4, 6, precision=module_precision, implementation="ffi",
                              rngs=rngs), rows),
  ]
  with jax.default_matmul_precision(setting):
    for module, inputs in linen_modules:
      variables = module.init(jax.random.key(0), inputs)
      assert _allow_tf32_of(lambda v, i: module.apply(v, i), variables, inputs) == {expected}
    for module, inputs in nnx_modules:
      graph, state = nnx.split(module)
      apply = lambda s, i: nnx.merge(graph, s)(i)
      assert _allow_tf32_of(apply, state, inputs) == {expected}


def test_flax_attention_fn_takes_the_precision_flax_passes():
  """``attention_fn`` as Flax's own modules call it, with their precision."""
  q = random_inputs(1, [(1, 4, 2, 8)])[0]
  for fn in (jaxops_linen.dot_product_attention, jaxops_nnx.dot_product_attention):
    with jax.default_matmul_precision("default"):
      assert _allow_tf32_of(lambda q: fn(q, q, q, precision="highest"), q) == {False}
      assert _allow_tf32_of(lambda q: fn(q, q, q), q) == {True}


def test_flax_kv_cache_steps_take_the_modules_precision():
  """The ``kv_cache`` call of the attention modules: the dense cache and a
  serving cache (one row per sequence) attend at the module's precision."""
  tokens = random_inputs(2, [(2, 3, 8)])[0]
  module = jaxops_linen.MultiHeadDotProductAttention(num_heads=2, precision="highest",
                                                     implementation="ffi")
  variables = module.init(jax.random.key(0), tokens)
  dense = (jnp.zeros((2, 6, 2, 4)), jnp.zeros((2, 6, 2, 4)))
  rows = BatchedKVCache(*dense, jnp.full((2,), 3, jnp.int32),
                                    jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3)))
  with jax.default_matmul_precision("default"):
    for cache in (dense, rows):
      step = lambda v, x, c: module.apply(v, x, kv_cache=c, query_offset=0)
      assert _allow_tf32_of(step, variables, tokens, cache) == {False}


# -- the CPU kernels: full float32 at every setting --------------------------------------------


@pytest.mark.backends(backends.CPU)
def test_cpu_kernels_compute_alike_at_every_setting(backend):
  q, k, v = random_inputs(2, [(1, 24, 2, 32), (1, 40, 1, 32), (1, 40, 1, 32)])
  images, kernel = random_inputs(3, [(2, 8, 8, 3), (4, 4, 3, 16)])

  def run():
    attention = jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: jaxops.attention(q, k, v, **FFI), q, k, v)[1](q))
    embed = jax.jit(lambda i, w: jaxops.patch_embed(i, w, patch_size=4, **FFI))
    return attention(q, k, v), embed(images, kernel)

  with jax.default_matmul_precision("default"):
    default = run()
  with jax.default_matmul_precision("highest"):
    highest = run()
  jax.tree.map(lambda a, b: assert_close(a, b, atol=0, rtol=0), default, highest)
