"""jaxops.attention's arguments for current models against the jnp reference:
the logit soft cap (Gemma), segment ids (packed sequences), sinks (gpt-oss)
and a value head dim of its own (MLA), alone and with every other argument.

These run on the CPU kernels (forward, backward, the fused forward-mode
kernel, the decode path); tests/test_attention_features_harness.py runs the
CUDA kernels on the same features in the harness.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from jaxops._src import attention as attention_src
from jaxops.testing import (
    FLOAT_DTYPES,
    assert_close,
    assert_tree_close,
    check_transformations,
    custom_call_targets,
    derivative_against_reference,
    random_inputs,
    vjp_against_reference,
    vmap_against_loop,
)


def qkv(seed, B, T, S, N, K, H, Hv=None, dtype=jnp.float32):
  return random_inputs(seed, [(B, T, N, H), (B, S, K, H), (B, S, K, H if Hv is None else Hv)],
                       dtype)


def documents(lengths, batch=1):
  """Segment ids [batch, sum(lengths)] of packed documents of these lengths."""
  ids = np.concatenate([np.full(n, d, np.int32) for d, n in enumerate(lengths)])
  return np.stack([ids] * batch)


B, T, S, N, K = 2, 13, 21, 4, 2
Q_IDS = np.array([[0] * 5 + [1] * 6 + [2] * 2, [3] * 13], np.int32)
KV_IDS = np.array([[0] * 7 + [1] * 9 + [2] * 5, [3] * 10 + [4] * 11], np.int32)
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
SEGMENTS = dict(query_segment_ids=Q_IDS, key_value_segment_ids=KV_IDS)

# The features alone and with the other arguments; "all" has a query row whose
# document has no key it may attend (row 12 of batch 0: causal and document 2).
CASES = {
    "soft_cap": dict(logits_soft_cap=2.0),
    "soft_cap_causal_bias": dict(logits_soft_cap=1.5, is_causal=True, bias="heads"),
    "segments": SEGMENTS,
    "segments_causal_window": dict(SEGMENTS, is_causal=True, local_window_size=(4, 0),
                                   query_offset=3),
    "sinks": dict(sinks=SINKS),
    "sinks_causal": dict(sinks=SINKS, is_causal=True, query_offset=-3),
    "value_head_dim": dict(Hv=24),
    "all": dict(SEGMENTS, logits_soft_cap=3.0, sinks=SINKS, Hv=8, is_causal=True, bias="heads",
                key_value_seq_lengths=np.array([20, 21], np.int32),
                query_seq_lengths=np.array([13, 11], np.int32)),
}


def case_call(name, H=16, dtype=jnp.float32, seed=2):
  """(args, kernel fn, reference fn) of CASES[name]; args are q, k, v (and bias)."""
  kwargs = dict(CASES[name])
  Hv = kwargs.pop("Hv", None)
  q, k, v = qkv(seed, B, T, S, N, K, H, Hv, dtype)
  args = [q, k, v]
  if kwargs.pop("bias", None) == "heads":
    args.append(random_inputs(seed + 1, [(1, N, T, S)], dtype)[0])
  f = lambda *a: jaxops.attention(*a, return_residual=True, **kwargs)
  r = lambda *a: reference.attention(*a, return_residual=True, **kwargs)
  return args, f, r


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients(case):
  args, f, r = case_call(case)
  out, lse = jax.jit(f)(*args)
  out_ref, lse_ref = jax.jit(r)(*args)
  assert out.shape == args[0].shape[:3] + args[2].shape[3:]
  assert_close(out, out_ref, reduce_size=2 * S, name="out")
  finite = np.isfinite(np.asarray(lse_ref))
  assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
  assert_close(np.where(finite, lse, 0), np.where(finite, lse_ref, 0), name="lse")
  vjp_against_reference(jax.jit(f), r, args, reduce_size=2 * S)


@pytest.mark.parametrize("case", ["soft_cap_causal_bias", "segments_causal_window", "sinks",
                                  "all"])
def test_forward_mode_runs_the_fused_kernel(case):
  args, f, r = case_call(case)
  tangents = tuple(random_inputs(5, [a.shape for a in args]))
  args = tuple(args)
  got = jax.jit(lambda a, t: jax.jvp(f, a, t))(args, tangents)
  want = jax.jit(lambda a, t: jax.jvp(r, a, t))(args, tangents)
  assert_tree_close(jax.tree.map(lambda x: jnp.nan_to_num(x, neginf=0.0), got),
                    jax.tree.map(lambda x: jnp.nan_to_num(x, neginf=0.0), want),
                    reduce_size=2 * S)
  assert custom_call_targets(lambda *a: jax.jvp(f, a, tangents), *args) == [
      "jaxops_attention_fwd_jvp"]


@pytest.mark.parametrize("mode,dtype", [(m, d) for m in ("vjp", "jvp") for d in FLOAT_DTYPES])
def test_dtypes(mode, dtype):
  args, f, r = case_call("all", H=32, dtype=dtype)
  out_only = lambda fn: lambda *a: fn(*a)[0]
  out, derivatives = derivative_against_reference(mode, out_only(f), out_only(r), args,
                                                  dtype=dtype, reduce_size=2 * S)
  assert out.dtype == dtype and all(d.dtype == dtype for d in jax.tree.leaves(derivatives))


def test_check_grads_order_2():
  kwargs = dict(query_segment_ids=np.array([[0, 0, 1]]), key_value_segment_ids=np.array(
      [[0, 1, 1, 1, 0]]), logits_soft_cap=1.0, is_causal=True, query_offset=2)
  q, k, v = qkv(10, 1, 3, 5, 2, 1, 4, Hv=3)
  bias = random_inputs(11, [(1, 2, 3, 5)])[0]
  sinks = jnp.array([0.3, -0.2])
  f = lambda q, k, v, b, s: jaxops.attention(q, k, v, b, sinks=s, **kwargs)
  check_grads(f, (q, k, v, bias, sinks), order=2, atol=2e-2, rtol=2e-2)


def test_every_transformation():
  kwargs = dict(query_segment_ids=np.array([[0, 1, 1]]), key_value_segment_ids=np.array(
      [[1, 0, 1, 1, 0]]), logits_soft_cap=2.0, is_causal=True, query_offset=2)
  q, k, v = qkv(47, 1, 3, 5, 2, 1, 4, Hv=6)
  sinks = jnp.array([0.1, 0.7])
  f = lambda q, k, v, s: jaxops.attention(q, k, v, sinks=s, return_residual=True, **kwargs)
  r = lambda q, k, v, s: reference.attention(q, k, v, sinks=s, return_residual=True, **kwargs)
  check_transformations(f, r, [q, k, v, sinks], forward_kernel="jaxops_attention_fwd",
                        checkpoint_name="jaxops.attention", atol=1e-5, rtol=1e-4)


def test_sink_gradient_and_tangent():
  """dsinks against the reference, and the sink's tangent alone."""
  q, k, v = qkv(20, 2, 9, 12, 4, 2, 8)
  loss = lambda fn: lambda s: jnp.sum(jnp.sin(fn(q, k, v, sinks=s, is_causal=True)))
  g = jax.jit(jax.grad(loss(jaxops.attention)))(SINKS)
  assert_close(g, jax.jit(jax.grad(loss(reference.attention)))(SINKS))
  tangent = jnp.array([1.0, -0.5, 0.25, 2.0])
  jvp = lambda fn: jax.jit(lambda s, t: jax.jvp(
      lambda s: fn(q, k, v, sinks=s, return_residual=True), (s,), (t,)))(SINKS, tangent)
  assert_tree_close(jvp(jaxops.attention), jvp(reference.attention))


def test_sinks_of_the_query_dtype_and_nan():
  q, k, v = qkv(21, 1, 5, 7, 4, 4, 8, dtype=jnp.bfloat16)
  sinks = jnp.asarray(SINKS, jnp.bfloat16)
  out = jaxops.attention(q, k, v, sinks=sinks)
  assert out.dtype == jnp.bfloat16
  assert_close(out, reference.attention(q, k, v, sinks=sinks), dtype=jnp.bfloat16, reduce_size=7)
  nan_sink = jnp.asarray(SINKS).at[2].set(jnp.nan)
  q, k, v = qkv(21, 1, 5, 7, 4, 4, 8)
  out = np.asarray(jaxops.attention(q, k, v, sinks=nan_sink))
  expected = np.asarray(reference.attention(q, k, v, sinks=nan_sink))
  assert np.all(np.isnan(out[:, :, 2])) and np.all(np.isnan(expected[:, :, 2]))
  assert np.all(np.isfinite(np.delete(out, 2, axis=2)))


def test_packed_documents_at_tile_edges():
  """Documents of 1 token, documents ending on either side of the CPU kernels'
  64-key (forward) and 128-key (backward) tiles, T = S prime: causal packed
  attention equals each document's own causal attention."""
  lengths = [1, 62, 2, 1, 63, 1, 2, 70, 1]  # 203 tokens; ids change at 63, 64, 128, 129 ...
  ids = documents(lengths)
  q, k, v = qkv(30, 1, 203, 203, 2, 1, 16)
  packed = lambda q, k, v: jaxops.attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                            key_value_segment_ids=ids)

  def separate(q, k, v):
    outs, start = [], 0
    for n in lengths:
      part = slice(start, start + n)
      outs.append(jaxops.attention(q[:, part], k[:, part], v[:, part], is_causal=True))
      start += n
    return jnp.concatenate(outs, axis=1)

  assert_close(jax.jit(packed)(q, k, v), jax.jit(separate)(q, k, v), reduce_size=70)
  vjp_against_reference(jax.jit(packed), jax.jit(separate), [q, k, v], reduce_size=70)


def test_rows_with_no_key_of_their_document():
  """Every key of a row in another document: output 0, log-sum-exp -inf (its
  sink with sinks), zero gradients for that row, finite elsewhere."""
  q, k, v = qkv(31, 1, 6, 8, 2, 2, 8)
  q_ids = np.array([[0, 0, 5, 1, 1, 5]], np.int32)  # document 5 has no keys
  kv_ids = np.array([[0, 0, 0, 1, 1, 1, 1, 1]], np.int32)
  f = lambda q, k, v, s: jaxops.attention(q, k, v, query_segment_ids=q_ids,
                                          key_value_segment_ids=kv_ids, sinks=s,
                                          return_residual=True)
  out, lse = f(q, k, v, None)
  assert np.all(np.asarray(out)[0, [2, 5]] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[0, [2, 5]]))
  out, lse = f(q, k, v, jnp.array([0.25, -0.5]))
  assert np.all(np.asarray(out)[0, [2, 5]] == 0)
  assert_close(np.asarray(lse)[0, [2, 5]], np.array([[0.25, -0.5]] * 2))
  dq = jax.grad(lambda q: jnp.sum(f(q, k, v, None)[0] ** 2))(q)
  assert np.all(np.asarray(dq)[0, [2, 5]] == 0) and np.all(np.isfinite(np.asarray(dq)))


@pytest.mark.parametrize("case", [
    dict(logits_soft_cap=2.5, is_causal=True),  # the decode core
    dict(query_segment_ids=np.array([[1, 2], [0, 0]]), key_value_segment_ids=np.array(
        [[1] * 9 + [2] * 8 + [3] * 2, [0] * 19])),  # the rows-in-place decode pass
    dict(Hv=40, is_causal=True),  # few rows with Hv != H: the row tiles
    dict(sinks=np.linspace(-1, 1, 8).astype(np.float32)),
], ids=["soft_cap", "segments", "value_head_dim", "sinks"])
def test_decoding_shapes(case):
  """T * G below the vector lanes: the CPU forward's decode paths."""
  case = dict(case)
  q, k, v = qkv(32, 2, 2, 19, 8, 2, 32, case.pop("Hv", None))
  f = lambda *a: jaxops.attention(*a, query_offset=17, **case)
  r = lambda *a: reference.attention(*a, query_offset=17, **case)
  assert_close(jax.jit(f)(q, k, v), jax.jit(r)(q, k, v), reduce_size=19)
  vjp_against_reference(jax.jit(f), r, [q, k, v], reduce_size=19)


def test_mla_head_dims():
  """DeepSeek-V3's prefill: H = 192 for queries and keys, Hv = 128, causal, GQA."""
  q, k, v = qkv(33, 1, 37, 37, 4, 2, 192, 128)
  f = functools.partial(jaxops.attention, is_causal=True)
  r = functools.partial(reference.attention, is_causal=True)
  assert f(q, k, v).shape == (1, 37, 4, 128)
  vjp_against_reference(jax.jit(f), r, [q, k, v], reduce_size=192)


def test_absorbed_mla_decode_head_dims():
  """DeepSeek's absorbed decode: H = 576 (512 latent + 64 rope) for queries and
  keys, the value the keys' first 512 features, one query token, 16 heads on
  one latent head (MQA)."""
  q, k = random_inputs(38, [(2, 1, 16, 576), (2, 40, 1, 576)])
  v = k[..., :512]
  lengths = np.array([40, 23], np.int32)
  f = lambda q, k, v: jaxops.attention(q, k, v, key_value_seq_lengths=lengths, scale=0.05)
  r = lambda q, k, v: reference.attention(q, k, v, key_value_seq_lengths=lengths, scale=0.05)
  out = jax.jit(f)(q, k, v)
  assert out.shape == (2, 1, 16, 512)
  assert_close(out, jax.jit(r)(q, k, v), reduce_size=576)


@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0, 0), (None, None, None, 0, 0),
                                     (2, None, None, None, 0)])
def test_vmap(in_axes):
  q, k, v = qkv(12, 2, 7, 9, 4, 2, 8, 5)
  q_ids = np.array([[0, 0, 0, 1, 1, 2, 2], [4, 4, 4, 4, 4, 4, 4]], np.int32)
  kv_ids = np.array([[0, 0, 1, 1, 1, 1, 2, 2, 2], [4, 4, 4, 4, 5, 5, 5, 5, 5]], np.int32)
  batched = [jnp.stack([x * (1 + 0.3 * i) for i in range(3)], axis=ax) if ax is not None
             else x for x, ax in zip((q, k, v), in_axes[:3])]
  batched += [np.stack([ids, np.roll(ids, 1, axis=1), ids[::-1]], axis=0) if ax is not None
              else ids for ids, ax in zip((q_ids, kv_ids), in_axes[3:])]
  f = lambda q, k, v, qs, ks: jaxops.attention(
      q, k, v, is_causal=True, logits_soft_cap=3.0, query_segment_ids=qs,
      key_value_segment_ids=ks, sinks=jnp.asarray(SINKS))
  vmap_against_loop(f, batched, in_axes)


def test_vmap_of_grad():
  q, k, v = qkv(17, 2, 6, 10, 4, 2, 8, 4)
  qs = jnp.stack([q * (1 + 0.2 * i) for i in range(3)])
  ids = documents([2, 4], 2), documents([3, 3, 4], 2)
  loss = lambda fn: lambda q, k, v, s: jnp.sum(jnp.sin(fn(
      q, k, v, sinks=s, logits_soft_cap=2.0, query_segment_ids=ids[0],
      key_value_segment_ids=ids[1])))
  argnums = (0, 1, 2, 3)
  got = jax.jit(jax.vmap(jax.grad(loss(jaxops.attention), argnums),
                         in_axes=(0, None, None, None)))(qs, k, v, jnp.asarray(SINKS))
  want = [jax.grad(loss(reference.attention), argnums)(x, k, v, jnp.asarray(SINKS)) for x in qs]
  assert_tree_close(got, jax.tree.map(lambda *x: jnp.stack(x), *want), reduce_size=10)


def test_traced_segment_ids_do_not_recompile():
  q, k, v = qkv(34, 1, 8, 8, 2, 2, 8)
  f = jax.jit(lambda q, k, v, ids: jaxops.attention(q, k, v, query_segment_ids=ids,
                                                    key_value_segment_ids=ids))
  for ids in (documents([3, 5]), documents([8]), documents([1, 1, 6])):
    assert_close(f(q, k, v, ids), reference.attention(q, k, v, query_segment_ids=ids,
                                                      key_value_segment_ids=ids))
  assert f._cache_size() == 1


def test_export_and_checkpoint():
  ids = documents([3, 5])
  q, k, v = qkv(35, 1, 8, 8, 2, 1, 8, 4)
  f = lambda q, k, v: jaxops.attention(q, k, v, is_causal=True, logits_soft_cap=5.0,
                                       query_segment_ids=ids, key_value_segment_ids=ids,
                                       sinks=jnp.array([0.5, -0.5]))
  loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
  exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                               disabled_checks=jaxops.export_checks())(q, k, v)
  assert "jaxops_attention_bwd" in exported.mlir_module()
  restored = jax.export.deserialize(exported.serialize())
  assert_tree_close(restored.call(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
  remat = jax.grad(lambda *a: jnp.sum(jax.checkpoint(f)(*a) ** 2), argnums=(0, 1, 2))
  assert_tree_close(jax.jit(remat)(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


def test_the_unbatched_form():
  x, kv, vv = random_inputs(36, [(11, 4, 16), (17, 2, 16), (17, 2, 12)])
  q_ids, kv_ids = documents([5, 6])[0], documents([8, 9])[0]
  kwargs = dict(query_segment_ids=q_ids, key_value_segment_ids=kv_ids, sinks=jnp.asarray(SINKS),
                logits_soft_cap=4.0)
  out = jaxops.attention(x, kv, vv, **kwargs)
  assert out.shape == (11, 4, 12)
  assert_close(out, reference.attention(x, kv, vv, **kwargs), reduce_size=17)


def test_kernel_selection_on_cuda(monkeypatch):
  """The CUDA kernels take the soft cap, segment ids and Hv != H (their harness
  tests are tests/test_attention_features_harness.py): only head dims past
  their shared-memory limit take the reference (None) or raise ("ffi"), and an
  empty head dim on one side only takes the reference on every platform."""
  monkeypatch.setattr(attention_src.primitive, "current_platform", lambda: "cuda")
  monkeypatch.setattr(attention_src.ffi_targets, "targets",
                      lambda platform: {attention_src.attention_fwd_p.target})
  use = functools.partial(attention_src._use_kernel, "jaxops.attention")
  assert use(None, jnp.float32, 64, 64) and use(None, jnp.bfloat16, 192, 128)
  assert not use(None, jnp.float32, 576, 512)
  with pytest.raises(ValueError, match="head dims up to 256, got 576"):
    use("ffi", jnp.float32, 576, 512)
  assert not use(None, jnp.float32, 0, 8)
  with pytest.raises(ValueError, match="both > 0"):
    use("ffi", jnp.float32, 0, 8)


def test_kernel_lowering_carries_the_features():
  ids = documents([3, 5])
  q, k, v = qkv(37, 1, 8, 8, 2, 1, 8, 4)
  text = jax.jit(lambda q, k, v: jaxops.attention(
      q, k, v, logits_soft_cap=7.0, query_segment_ids=ids, key_value_segment_ids=ids,
      implementation="ffi")).lower(q, k, v).as_text()
  assert "jaxops_attention_fwd" in text and "logits_soft_cap = 7.0" in text


BAD_CALLS = {
    "only query ids": (dict(query_segment_ids=Q_IDS), ValueError, "key_value_segment_ids"),
    "only key ids": (dict(key_value_segment_ids=KV_IDS), ValueError, "query_segment_ids"),
    "ids shape": (dict(query_segment_ids=Q_IDS[:, :5], key_value_segment_ids=KV_IDS),
                  ValueError, "query_segment_ids must have shape"),
    "ids rank": (dict(query_segment_ids=Q_IDS, key_value_segment_ids=KV_IDS[0]), ValueError,
                 "key_value_segment_ids must have shape"),
    "ids dtype": (dict(query_segment_ids=Q_IDS.astype(np.float32), key_value_segment_ids=KV_IDS),
                  TypeError, "query_segment_ids must have an integer dtype"),
    "sinks length": (dict(sinks=SINKS[:3]), ValueError, "sinks must have shape"),
    "sinks dtype": (dict(sinks=np.arange(4, dtype=np.int32)), TypeError, "sinks must have"),
    "sinks other float": (dict(sinks=SINKS.astype(jnp.float16)), TypeError,
                           "sinks must have dtype float32 or the query's"),
    "cap zero": (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    "cap negative": (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    "cap nan": (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    "cap array": (dict(logits_soft_cap=jnp.float32(2.0)), TypeError, "logits_soft_cap"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments(case):
  kwargs, error, message = BAD_CALLS[case]
  q, k, v = qkv(40, B, T, S, N, K, 8)
  with pytest.raises(error, match=message):
    jaxops.attention(q, k, v, **kwargs)


def test_traced_soft_cap_is_refused():
  q, k, v = qkv(41, 1, 4, 4, 2, 2, 8)
  with pytest.raises(TypeError, match="logits_soft_cap"):
    jax.jit(lambda c: jaxops.attention(q, k, v, logits_soft_cap=c))(2.0)


@pytest.mark.parametrize("value_shape", [(B, S, 1, 8), (B, S - 1, K, 8), (1, S, K, 8)])
def test_value_axes_must_match_the_key(value_shape):
  q, k, _ = qkv(42, B, T, S, N, K, 8)
  with pytest.raises(ValueError, match="value must share key's batch, sequence and heads"):
    jaxops.attention(q, k, jnp.ones(value_shape))


def test_empty_query_and_key_head_dim_with_the_default_scale():
  """H = 0 (no scale to default to): every logit is 0, so each row averages
  its attended values; no ZeroDivisionError."""
  q, k = jnp.ones((1, 3, 2, 0)), jnp.ones((1, 4, 2, 0))
  v = random_inputs(43, [(1, 4, 2, 5)])[0]
  out = jaxops.attention(q, k, v, is_causal=True)
  assert_close(out, reference.attention(q, k, v, is_causal=True, scale=1.0))
  assert_close(out[0, 0], v[0, 0])
