"""The Flax attention wrappers against Flax's own attention, argument by
argument: ``jaxops.flax.{linen,nnx}.dot_product_attention`` as the
``attention_fn`` of Flax's modules (sown weights, mixed precision, dropout) and
the jaxops modules against Flax's (parameter trees, outputs, caches); with
``context_parallel_axis``, the modules inside ``jax.shard_map`` on 4 host
devices (ring attention, RoPE and the causal mask on global positions) against
the same module on the whole sequence."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import meshes
from support.flax_twins import (assert_same_dtypes_and_close, assert_same_tree, linen_twins,
                                nnx_twins, perturbed)

import jaxops
from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.testing import assert_tree_close, custom_call_targets, random_inputs

_x, _kv = random_inputs(0, [(2, 5, 8), (2, 7, 8)])
_mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 5, 7)).at[..., 0].set(True)
_init = nn.initializers.normal(0.3)
_bf16 = jnp.bfloat16
_DROPOUT = {"dropout": jax.random.key(4)}

# (constructor arguments, inputs, call arguments, apply arguments, whether the kernel runs)
LINEN_CASES = [
    ({}, (_x,), {}, {}, True),
    ({}, (_x,), dict(sow_weights=True), dict(mutable=["intermediates"]), False),
    ({}, (_x, _kv), dict(mask=_mask), {}, True),
    ({}, (_x, _kv, _kv * 2), dict(mask=_mask[0, 0]), {}, True),
    ({}, (_x,), dict(mask=nn.make_causal_mask(_x[..., 0])), {}, True),  # float32 mask
    (dict(dtype=_bf16), (_x,), {}, {}, True),
    (dict(dtype=_bf16, force_fp32_for_softmax=True), (_x,), {}, {}, True),
    (dict(dtype=_bf16, force_fp32_for_softmax=True), (_x,), dict(sow_weights=True),
     dict(mutable=["intermediates"]), False),
    (dict(param_dtype=_bf16), (_x.astype(_bf16),), {}, {}, True),
    (dict(dropout_rate=0.5), (_x,), dict(deterministic=False), dict(rngs=_DROPOUT), False),
    (dict(dropout_rate=0.5, broadcast_dropout=False, deterministic=False), (_x,), {},
     dict(rngs=_DROPOUT), False),
    (dict(dropout_rate=0.5), (_x,), dict(deterministic=True), {}, True),
    (dict(num_heads=4, qkv_features=16, out_features=6, precision="highest"), (_x,), {}, {},
     True),
    (dict(normalize_qk=True, use_bias=False), (_x,), {}, {}, True),
    (dict(kernel_init=_init, out_kernel_init=_init, bias_init=_init, out_bias_init=_init),
     (_x,), {}, {}, True),
]


def _close(kwargs):
  return dict(dtype=kwargs.get("dtype") or kwargs.get("param_dtype"), reduce_size=8)


@pytest.mark.parametrize("kwargs,args,call,apply,kernel", LINEN_CASES)
def test_linen_attention_matches_flax(kwargs, args, call, apply, kernel):
  kwargs = {"num_heads": 2, **kwargs}
  theirs = nn.MultiHeadDotProductAttention(**kwargs)
  apply = {**apply, "rngs": apply.get("rngs", {})}
  rngs = apply.pop("rngs")
  params = linen_twins(jlinen.MultiHeadDotProductAttention(**kwargs), theirs, args, call=call,
                       apply=apply, rngs=rngs, **_close(kwargs))
  # The attention_fn alone, in Flax's own module: sown weights land in `intermediates`.
  with_fn = nn.MultiHeadDotProductAttention(**kwargs, attention_fn=jlinen.dot_product_attention)
  run = lambda m: m.apply(params, *args, **call, **apply, rngs=rngs)
  assert_same_dtypes_and_close(run(with_fn), run(theirs), **_close(kwargs))
  assert bool(custom_call_targets(lambda *a: with_fn.apply(params, *a, **call, **apply,
                                                           rngs=rngs), *args)) == kernel


# (constructor arguments, inputs, call arguments, whether the kernel runs); decode=False
# everywhere, since Flax's module wants it said.
NNX_CASES = [
    ({}, (_x,), {}, True),
    ({}, (_x,), dict(sow_weights=True), False),
    ({}, (_x, _kv), dict(mask=_mask), True),
    ({}, (_x,), dict(is_causal=True), True),
    (dict(num_kv_heads=1), (_x,), {}, True),
    (dict(dtype=_bf16), (_x,), {}, True),
    (dict(dropout_rate=0.5, broadcast_dropout=False), (_x,), dict(deterministic=False), False),
    (dict(dropout_rate=0.5, keep_rngs=False), (_x,),
     dict(deterministic=False, rngs=nnx.Rngs(dropout=5)), False),
    (dict(dropout_rate=0.5, deterministic=True), (_x,), {}, True),
    (dict(normalize_qk=True, precision="highest"), (_x,), {}, True),
    (dict(qkv_features=16, out_features=6, in_kv_features=4, kernel_init=_init,
          bias_init=_init), (_x, _kv[..., :4]), {}, True),
]


@pytest.mark.parametrize("kwargs,args,call,kernel", NNX_CASES)
@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")  # Flax's own sow
def test_nnx_attention_matches_flax(kwargs, args, call, kernel):
  make = lambda cls, **extra: cls(2, 8, **kwargs, **extra, decode=False, rngs=nnx.Rngs(0))
  call_again = lambda: {k: (nnx.Rngs(dropout=5) if k == "rngs" else v) for k, v in call.items()}
  theirs, ours = make(nnx.MultiHeadAttention), make(jnnx.MultiHeadAttention)
  nnx_twins(ours, theirs, args, call=call_again, **_close(kwargs))
  assert_same_tree(nnx.state(ours, nnx.Intermediate), nnx.state(theirs, nnx.Intermediate))
  # The attention_fn alone, in Flax's own module: sown weights are nnx.Intermediate.
  twin = make(nnx.MultiHeadAttention)
  with_fn = make(nnx.MultiHeadAttention, attention_fn=jnnx.dot_product_attention)
  nnx.update(twin, nnx.state(theirs, nnx.Param))
  nnx.update(with_fn, nnx.state(theirs, nnx.Param))
  assert_same_dtypes_and_close(with_fn(*args, **call_again()), twin(*args, **call_again()),
                               **_close(kwargs))
  assert_same_dtypes_and_close(nnx.state(with_fn, nnx.Intermediate),
                               nnx.state(twin, nnx.Intermediate), **_close(kwargs))
  graph, state = nnx.split(with_fn)
  targets = custom_call_targets(lambda s, *a: nnx.merge(graph, s)(*a, **call_again()), state,
                                *args)
  assert bool(targets) == kernel


def test_linen_decode_and_self_attention_match_flax():
  """Flax's ``decode`` (the ``cache`` collection, one token a call) and SelfAttention."""
  kwargs = dict(num_heads=2, decode=True)
  ours, theirs = jlinen.MultiHeadDotProductAttention(**kwargs), nn.MultiHeadDotProductAttention(
      **kwargs)
  variables = theirs.init(jax.random.key(1), _x)
  assert_same_tree(ours.init(jax.random.key(1), _x), variables)
  variables = {**variables, "params": perturbed(variables["params"])}
  cache = cache_ref = variables["cache"]
  for t in range(_x.shape[1]):
    step = lambda m, c: m.apply({**variables, "cache": c}, _x[:, t:t + 1], mutable=["cache"])
    (out, cache), (out_ref, cache_ref) = step(ours, cache), step(theirs, cache_ref)
    assert_tree_close(out, out_ref, reduce_size=8)
    assert_tree_close(cache, cache_ref)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Flax's SelfAttention warns
    linen_twins(jlinen.SelfAttention(num_heads=2), nn.SelfAttention(num_heads=2), (_x,),
                call=dict(mask=_mask[..., :5]), reduce_size=8)


def test_nnx_decode_matches_flax():
  ours = jnnx.MultiHeadAttention(2, 8, num_kv_heads=1, decode=True, rngs=nnx.Rngs(0))
  theirs = nnx.MultiHeadAttention(2, 8, num_kv_heads=1, decode=True, rngs=nnx.Rngs(0))
  nnx.update(theirs, perturbed(nnx.state(theirs, nnx.Param)))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  for module in (ours, theirs):
    module.init_cache(_x.shape)
  for t in range(_x.shape[1]):
    assert_tree_close(ours(_x[:, t:t + 1]), theirs(_x[:, t:t + 1]), reduce_size=8)
  assert_tree_close(nnx.state(ours, nnx.Cache), nnx.state(theirs, nnx.Cache))


def test_linen_causal_and_its_gradients_match_flax_mask():
  theirs = nn.MultiHeadDotProductAttention(num_heads=2)
  causal = jlinen.MultiHeadDotProductAttention(num_heads=2, is_causal=True)
  params = perturbed(theirs.init(jax.random.key(1), _x))
  loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p)))
  grads = jax.grad(loss(lambda p: causal.apply(p, _x)))(params)
  grads_ref = jax.grad(loss(lambda p: theirs.apply(p, _x, mask=nn.make_causal_mask(_x[..., 0]))))(
      params)
  assert_tree_close(grads, grads_ref, atol=1e-4, rtol=1e-4)
  # jaxops.attention itself as attention_fn, with a boolean mask as jax.nn wants
  module = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=jaxops.attention)
  mask = nn.make_causal_mask(_x[..., 0])
  assert_tree_close(module.apply(params, _x, mask=mask.astype(bool)),
                    theirs.apply(params, _x, mask=mask), reduce_size=5)


def _rope(t, positions):
  angle = positions[:, None, None] * (0.1 + jnp.arange(t.shape[-1] // 2))
  c, s = jnp.cos(angle), jnp.sin(angle)
  a, b = jnp.split(t, 2, axis=-1)
  return jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def test_linen_gqa_rope_and_batch_axes_match_the_reference_path():
  x, = random_inputs(7, [(2, 3, 8, 16)])  # two batch axes
  make = functools.partial(jlinen.MultiHeadAttention, num_heads=4, num_kv_heads=2,
                           qkv_features=32, is_causal=True, rope=_rope)
  params = make().init(jax.random.key(8), x)
  assert params["params"]["key"]["kernel"].shape == (16, 2, 8)
  out = make().apply(params, x, query_offset=jnp.int32(3))
  ref = make(implementation="xla").apply(params, x, query_offset=jnp.int32(3))
  assert out.shape == x.shape
  assert_tree_close(out, ref, reduce_size=8)
  # Flax's attention (sown weights) under the same GQA, rope and offset
  sown, state = make().apply(params, x, query_offset=jnp.int32(3), sow_weights=True,
                             mutable=["intermediates"])
  assert_tree_close(sown, out, reduce_size=8)
  assert state["intermediates"]["attention_weights"][0].shape == (2, 3, 4, 8, 8)


def test_jaxops_modules_with_another_attention_fn():
  """A custom attention_fn gets what Flax gives it: equal heads, causality as a mask."""
  module = jlinen.MultiHeadDotProductAttention(num_heads=2, num_kv_heads=1, is_causal=True,
                                               attention_fn=nn.dot_product_attention)
  params = module.init(jax.random.key(0), _x)
  expected = module.clone(attention_fn=jlinen.dot_product_attention).apply(params, _x)
  assert_tree_close(module.apply(params, _x), expected, reduce_size=5)
  ours = jnnx.MultiHeadAttention(2, 8, is_causal=True, attention_fn=nnx.dot_product_attention,
                                 rngs=nnx.Rngs(0))
  reference = jnnx.MultiHeadAttention(2, 8, is_causal=True, rngs=nnx.Rngs(0))
  assert_tree_close(ours(_x, query_offset=2), reference(_x, query_offset=2), reduce_size=5)


@pytest.mark.filterwarnings("ignore:Casting from complex:DeprecationWarning")  # in Flax's nnx
def test_attention_fns_run_flax_on_dtypes_the_kernel_lacks():
  keys = jax.random.split(jax.random.key(6), 2)
  q, k, v = (jax.random.normal(keys[0], (3, 2, 4, 2, 8))
             + 1j * jax.random.normal(keys[1], (3, 2, 4, 2, 8))).astype(jnp.complex64)
  for ours, theirs in ((jlinen.dot_product_attention, nn.dot_product_attention),
                       (jnnx.dot_product_attention, nnx.dot_product_attention)):
    assert_same_dtypes_and_close(ours(q, k, v), theirs(q, k, v), reduce_size=8)
    assert not custom_call_targets(ours, q, k, v)


def test_inputs_kv_and_the_two_caches():
  """linen's deprecated ``inputs_kv`` as Flax treats it; ``decode`` (Flax's
  cache) and ``kv_cache`` (jaxops') are one or the other."""
  module = jlinen.MultiHeadDotProductAttention(num_heads=2)
  params = module.init(jax.random.key(0), _x, _kv)
  with pytest.warns(DeprecationWarning, match="inputs_kv"):
    assert_tree_close(module.apply(params, _x, inputs_kv=_kv), module.apply(params, _x, _kv))
  with pytest.raises(ValueError, match="inputs_kv"):
    module.apply(params, _x, _kv, inputs_kv=_kv)
  cache = (jnp.zeros((2, 8, 2, 4)), jnp.zeros((2, 8, 2, 4)))
  with pytest.raises(ValueError, match=r"MultiHeadAttention: decode must be False with kv_cache"):
    module.clone(decode=True).apply(params, _x[:, :1], kv_cache=cache, mutable=["cache"])
  nnx_module = jnnx.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"MultiHeadAttention: decode must be False with kv_cache"):
    nnx_module(_x[:, :1], kv_cache=cache, decode=True)


# -- jaxops.attention's arguments for current models (soft cap, sinks, segment ids) --------


def _manual_attention(module_params, x, heads, **kwargs):
  """The module's projections by hand, then the jnp reference with ``kwargs``."""
  project = lambda name: jnp.einsum("btd,dnh->btnh", x, module_params[name]["kernel"]) + \
      module_params[name]["bias"]
  q, k, v = (project(name) for name in ("query", "key", "value"))
  out = jaxops.reference.attention(q, k, v, **kwargs)
  return jnp.einsum("btnh,nhd->btd", out, module_params["out"]["kernel"]) + \
      module_params["out"]["bias"]


def test_linen_soft_cap_sinks_and_segment_ids():
  ids = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]])
  module = jlinen.MultiHeadDotProductAttention(num_heads=2, logits_soft_cap=3.0,
                                               learnable_sinks=True, is_causal=True)
  params = module.init(jax.random.key(0), _x, query_segment_ids=ids)["params"]
  assert params["sinks"].shape == (2,) and not jnp.any(params["sinks"])
  params = {**params, "sinks": jnp.array([0.5, -1.0])}
  out = module.apply({"params": params}, _x, query_segment_ids=ids)
  expected = _manual_attention(params, _x, 2, logits_soft_cap=3.0, sinks=params["sinks"],
                               is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids)
  assert_tree_close(out, expected, reduce_size=8)
  grads = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, _x,
                                                  query_segment_ids=ids) ** 2))(params)
  assert jnp.all(jnp.isfinite(grads["sinks"])) and jnp.any(grads["sinks"])
  assert "jaxops_attention_fwd" in custom_call_targets(
      lambda x: module.apply({"params": params}, x, query_segment_ids=ids), _x)


def test_nnx_soft_cap_sinks_and_segment_ids():
  ids = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]])
  module = jnnx.MultiHeadAttention(num_heads=2, in_features=8, logits_soft_cap=3.0,
                                   learnable_sinks=True, is_causal=True, decode=False,
                                   rngs=nnx.Rngs(0))
  assert module.sinks[...].shape == (2,)
  module.sinks[...] = jnp.array([0.5, -1.0])
  out = module(_x, query_segment_ids=ids)
  params = {name: {"kernel": getattr(module, name).kernel[...],
                   "bias": getattr(module, name).bias[...]}
            for name in ("query", "key", "value", "out")}
  expected = _manual_attention(params, _x, 2, logits_soft_cap=3.0, sinks=module.sinks[...],
                               is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids)
  assert_tree_close(out, expected, reduce_size=8)
  grads = nnx.grad(lambda m: jnp.sum(m(_x, query_segment_ids=ids) ** 2))(module)
  assert jnp.any(grads.sinks[...])


def test_flax_paths_fold_segment_ids_and_refuse_the_rest():
  """Where Flax's own function runs (sown weights), segment ids become its mask;
  a soft cap or sinks are a clear error there."""
  ids = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]])
  module = jlinen.MultiHeadDotProductAttention(num_heads=2)
  params = module.init(jax.random.key(0), _x)
  sown, _ = module.apply(params, _x, query_segment_ids=ids, sow_weights=True,
                         mutable=["intermediates"])
  assert_tree_close(sown, module.apply(params, _x, query_segment_ids=ids), reduce_size=8)
  capped = jlinen.MultiHeadDotProductAttention(num_heads=2, logits_soft_cap=2.0)
  with pytest.raises(ValueError, match="logits_soft_cap runs on jaxops.attention only"):
    capped.apply(params, _x, sow_weights=True, mutable=["intermediates"])


# -- context parallelism: the modules inside jax.shard_map, on ring attention ---------------

_CP_AXIS, _CP_DEVICES = "seq", 4


def _context_parallel(module_call, x, layout, collective=None):
  """``module_call(x_block)`` inside a shard_map over 4 devices, x's sequence
  split over "seq" in ``layout``; the output back in natural order. With
  ``collective``, the compiled program must hold it (the ring's
  collective-permute, the all-gather strategy's all-gather)."""
  mesh = meshes.make_mesh((_CP_DEVICES,), (_CP_AXIS,))
  if layout == "zigzag":
    x = jaxops.zigzag_permute(x, _CP_DEVICES, axis=1)
  program = jax.jit(jax.shard_map(module_call, mesh=mesh, in_specs=P(None, _CP_AXIS),
                                  out_specs=P(None, _CP_AXIS)))
  if collective is not None:
    assert collective in program.lower(x).compile().as_text()
  out = program(x)
  return jaxops.zigzag_unpermute(out, _CP_DEVICES, axis=1) if layout == "zigzag" else out


_CP_KWARGS = dict(num_heads=4, qkv_features=16, num_kv_heads=2, is_causal=True,
                  rope=lambda x, positions: jaxops.rope(x, positions))


@pytest.mark.parametrize("layout,strategy", [("contiguous", "ring"), ("zigzag", "ring"),
                                             ("zigzag", "all_gather")])
def test_linen_context_parallel_matches_the_whole_sequence(layout, strategy):
  """RoPE, the causal mask and query_offset on global positions: the module on
  each device's block equals it on the whole sequence, and so do the
  parameters' gradients."""
  x, = random_inputs(11, [(2, 32, 8)])
  whole = jlinen.MultiHeadDotProductAttention(**_CP_KWARGS)
  ring = jlinen.MultiHeadDotProductAttention(
      **_CP_KWARGS, context_parallel_axis=_CP_AXIS, context_parallel_layout=layout,
      context_parallel_strategy=strategy)
  params = whole.init(jax.random.key(0), x)
  loss = lambda out: jnp.sum(jnp.sin(out))
  expected = whole.apply(params, x, query_offset=3)
  grads = jax.grad(lambda p: loss(whole.apply(p, x, query_offset=3)))(params)

  def run(p):
    return _context_parallel(lambda block: ring.apply(p, block, query_offset=3), x, layout)

  collective = "collective-permute" if strategy == "ring" else "all-gather"
  out = _context_parallel(lambda block: ring.apply(params, block, query_offset=3), x, layout,
                          collective)
  assert_tree_close(out, expected, atol=2e-5, rtol=2e-5)
  assert_tree_close(jax.grad(lambda p: loss(run(p)))(params), grads, atol=1e-4, rtol=1e-4)


def test_nnx_context_parallel_matches_the_whole_sequence():
  x, = random_inputs(12, [(2, 32, 8)])
  kwargs = dict(num_heads=4, in_features=8, qkv_features=16, is_causal=True,
                rope=lambda x, positions: jaxops.rope(x, positions), decode=False)
  whole = jnnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
  ring = jnnx.MultiHeadAttention(**kwargs, context_parallel_axis=_CP_AXIS,
                                 context_parallel_layout="zigzag", rngs=nnx.Rngs(0))
  assert ring.context_parallel == dict(axis_name=_CP_AXIS, layout="zigzag", strategy="ring")
  assert_tree_close(_context_parallel(ring, x, "zigzag"), whole(x), atol=2e-5, rtol=2e-5)


def test_context_parallel_refuses_what_has_no_ring():
  x, = random_inputs(13, [(1, 8, 8)])
  ring = jlinen.MultiHeadDotProductAttention(num_heads=2, context_parallel_axis=_CP_AXIS)
  params = jlinen.MultiHeadDotProductAttention(num_heads=2).init(jax.random.key(0), x)
  cache = (jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2, 4)))
  with pytest.raises(ValueError, match="context_parallel_axis must be None with kv_cache"):
    ring.apply(params, x, kv_cache=cache, query_offset=0)
  with pytest.raises(ValueError, match="context_parallel_axis must be None with sow_weights"):
    ring.apply(params, x, sow_weights=True, mutable=["intermediates"])
  bad = jlinen.MultiHeadDotProductAttention(num_heads=2, context_parallel_axis=_CP_AXIS,
                                            context_parallel_layout="striped")
  with pytest.raises(ValueError, match="context_parallel_layout must be one of"):
    bad.apply(params, x)
  with pytest.raises(ValueError, match="context_parallel_strategy must be one of"):
    jnnx.MultiHeadAttention(num_heads=2, in_features=8, context_parallel_axis=_CP_AXIS,
                            context_parallel_strategy="tree", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="context_parallel_axis must be None, a mesh axis name"):
    jnnx.MultiHeadAttention(num_heads=2, in_features=8, context_parallel_axis=3,
                            rngs=nnx.Rngs(0))
