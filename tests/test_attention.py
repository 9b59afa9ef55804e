"""jaxops.attention against jax.nn.dot_product_attention and the jnp reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from jaxops.testing import (
    FLOAT_DTYPES,
    assert_close,
    assert_tree_close,
    check_transformations,
    custom_call_targets,
    derivative_against_reference,
    jvp_against_reference,
    random_inputs,
    scalarize,
    upcast,
    vjp_against_reference,
    vmap_against_loop,
)


def qkv(seed, B, T, S, N, K, H, dtype=jnp.float32):
  return random_inputs(seed, [(B, T, N, H), (B, S, K, H), (B, S, K, H)], dtype)


def random_mask(seed, shape, keep=0.75):
  return jax.random.bernoulli(jax.random.key(seed), keep, shape)


# Every mask kind and combinations, at B=2, T=13, S=21, N=4, K=2. None gives a
# row with no attended key (where jax.nn's semantics differ from jaxops').
B, T, S, N, K = 2, 13, 21, 4, 2
MASK_CASES = {
    "none": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(3, 2)),
    "window_int_causal": dict(local_window_size=4, is_causal=True),
    "seq_lengths": dict(query_seq_lengths=np.array([13, 6], np.int32),
                        key_value_seq_lengths=np.array([9, 21], np.int32)),
    "mask_full": dict(mask=random_mask(1, (B, N, T, S))),
    "mask_keys": dict(mask=random_mask(2, (B, 1, 1, S)).at[:, :, :, 0].set(True)),
    "mask_rank2": dict(mask=random_mask(3, (T, S)).at[:, 0].set(True)),
    "bias_heads": dict(bias=random_inputs(4, [(1, N, T, S)])[0]),
    "bias_keys": dict(bias=random_inputs(5, [(B, 1, 1, S)])[0]),
    "bias_rank2": dict(bias=random_inputs(6, [(T, S)])[0]),
    "all": dict(is_causal=True, local_window_size=(5, 1), bias=random_inputs(7, [(1, N, T, S)])[0],
                mask=random_mask(8, (B, N, T, S)).at[:, :, jnp.arange(T), jnp.arange(T)].set(True),
                query_seq_lengths=np.array([11, 13], np.int32),
                key_value_seq_lengths=np.array([21, 12], np.int32)),
}


def _split_arrays(kwargs):
  """(bias, mask) positional arrays and the remaining keyword arguments."""
  kwargs = dict(kwargs)
  return kwargs.pop("bias", None), kwargs.pop("mask", None), kwargs


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_matches_jax_nn(case):
  q, k, v = qkv(0, B, T, S, N, K, 16)
  bias, mask, kwargs = _split_arrays(MASK_CASES[case])
  out, lse = jax.jit(functools.partial(jaxops.attention, return_residual=True, **kwargs))(
      q, k, v, bias, mask)
  expected, expected_lse = jax.nn.dot_product_attention(
      q, k, v, bias, mask, implementation="xla", return_residual=True, **kwargs)
  assert_close(out, expected, reduce_size=S, name=case)
  # jax.nn's log-sum-exp of a row past query_seq_lengths is its fill value; ours is -inf.
  rows = np.ones((B, T, N), bool)
  if "query_seq_lengths" in kwargs:
    rows = np.broadcast_to(
        np.arange(T)[None, :, None] < kwargs["query_seq_lengths"][:, None, None], (B, T, N))
  assert_close(jnp.where(rows, lse, 0), jnp.where(rows, expected_lse, 0), name=case)
  assert np.all(np.isneginf(np.asarray(lse)[~rows]))


@pytest.mark.parametrize("case", ["none", "causal", "seq_lengths", "mask_keys", "bias_heads",
                                  "bias_keys", "all"])
def test_grad_matches_reference(case):
  q, k, v = qkv(1, B, T, S, N, K, 16)
  bias, mask, kwargs = _split_arrays(MASK_CASES[case])
  args = [q, k, v] + ([bias] if bias is not None else [])

  def call(fn):
    return lambda q, k, v, *b: fn(q, k, v, *(b or (None,)), mask, **kwargs)

  vjp_against_reference(jax.jit(call(jaxops.attention)), call(reference.attention), args,
                        reduce_size=S)
  # and against jax.nn's own gradient
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(call(fn)(*a)))
  nn = functools.partial(jax.nn.dot_product_attention, implementation="xla")
  argnums = tuple(range(len(args)))
  assert_tree_close(jax.grad(loss(jaxops.attention), argnums)(*args),
                    jax.grad(loss(nn), argnums)(*args), reduce_size=S)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", ["causal", "all"])
@pytest.mark.parametrize("mode", ["vjp", "jvp"])
def test_dtypes_forward_and_derivatives(dtype, case, mode):
  q, k, v = qkv(2, B, T, S, N, K, 32, dtype)
  bias, mask, kwargs = _split_arrays(MASK_CASES[case])
  args = [q, k, v] + ([bias.astype(dtype)] if bias is not None else [])

  def call(fn):
    return lambda q, k, v, *b: fn(q, k, v, *(b or (None,)), mask, **kwargs)

  out, derivatives = derivative_against_reference(
      mode, call(jaxops.attention), call(reference.attention), args, dtype=dtype,
      reduce_size=2 * S)
  assert out.dtype == dtype and all(d.dtype == dtype for d in jax.tree.leaves(derivatives))


# (B, T, S, N, K, H, is_causal): GQA, MQA, decode (T = 1), T != S, S = 1, lengths
# that are not multiples of any tile, and the head dims of common models.
SHAPES = [
    (1, 1, 67, 8, 2, 64, False),
    (3, 1, 19, 4, 4, 32, True),
    (2, 70, 33, 6, 3, 32, True),
    (2, 70, 33, 6, 3, 32, False),
    (1, 29, 1, 2, 1, 16, False),
    (1, 67, 131, 2, 1, 80, True),
    (1, 33, 70, 2, 2, 128, False),
    (1, 20, 45, 2, 1, 256, True),
    (2, 5, 9, 3, 3, 7, False),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(shape):
  *shape, is_causal = shape
  args = qkv(3, *shape)
  f = functools.partial(jaxops.attention, is_causal=is_causal)
  r = functools.partial(reference.attention, is_causal=is_causal)
  vjp_against_reference(jax.jit(f), r, args, reduce_size=max(shape[2], shape[5]))
  if shape[1] <= shape[2] or not is_causal:
    assert_close(f(*args), jax.nn.dot_product_attention(*args, is_causal=is_causal),
                 reduce_size=shape[2])


def test_unbatched_and_keyword_calls():
  x = random_inputs(4, [(11, 4, 16)])[0]
  kv = random_inputs(5, [(17, 2, 16)])[0]
  bias = random_inputs(6, [(4, 11, 17)])[0]
  out = jaxops.attention(query=x, key=kv, value=kv, bias=bias, is_causal=True)
  expected = jax.nn.dot_product_attention(query=x, key=kv, value=kv, bias=bias, is_causal=True)
  assert out.shape == x.shape
  assert_close(out, expected, reduce_size=17)
  out, lse = jaxops.attention(x, kv, kv, return_residual=True,
                             query_seq_lengths=np.array([9], np.int32))
  assert lse.shape == (11, 4) and lse.dtype == x.dtype


def test_return_residual_is_differentiable():
  q, k, v = qkv(7, 2, 9, 12, 2, 1, 8)
  bias = random_inputs(8, [(2, 1, 9, 12)])[0]
  f = lambda *a: jaxops.attention(*a, is_causal=True, return_residual=True)
  r = lambda *a: reference.attention(*a, is_causal=True, return_residual=True)
  vjp_against_reference(f, r, [q, k, v, bias], reduce_size=12)
  # only the log-sum-exp used: its gradient reaches q, k and the bias, not v
  g = jax.grad(lambda *a: jnp.sum(f(*a)[1]), argnums=(0, 1, 2, 3))(q, k, v, bias)
  g_ref = jax.grad(lambda *a: jnp.sum(r(*a)[1]), argnums=(0, 1, 2, 3))(q, k, v, bias)
  assert_tree_close(g, g_ref)
  assert not np.any(np.asarray(g[2]))


def test_rows_without_keys_give_zero_and_finite_gradients():
  q, k, v = qkv(9, 2, 6, 8, 2, 2, 8)
  mask = jnp.ones((2, 2, 6, 8), bool).at[0, 1, 2].set(False)
  kwargs = dict(is_causal=True, query_offset=-2, key_value_seq_lengths=np.array([8, 0], np.int32))
  f = lambda q, k, v: jaxops.attention(q, k, v, None, mask, return_residual=True, **kwargs)
  out, lse = f(q, k, v)
  masked = np.zeros((2, 6, 2), bool)
  masked[0, :2, :] = True   # causal with offset -2: rows 0, 1 see no key
  masked[0, 2, 1] = True    # the boolean mask empties a row
  masked[1] = True          # no keys at all
  assert np.all(np.asarray(out)[masked] == 0)
  assert np.all(np.isneginf(np.asarray(lse, np.float32)[masked]))
  assert np.all(np.isfinite(np.asarray(lse, np.float32)[~masked]))
  grads = jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2) + jnp.sum(jnp.where(masked, 0, f(*a)[1])),
                   argnums=(0, 1, 2))(q, k, v)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  assert np.all(np.asarray(grads[0])[masked] == 0)
  ref_grads = jax.grad(
      lambda *a: jnp.sum(reference.attention(*a, None, mask, **kwargs) ** 2), argnums=(0, 1, 2))(q, k, v)
  assert_tree_close(jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2), argnums=(0, 1, 2))(q, k, v),
                    ref_grads)


@pytest.mark.parametrize("window", [(2**31 - 1, 0), (0, 2**31 - 1), (2**31 - 1, 2**31 - 1)])
def test_windows_wider_than_int32_positions(window):
  """A window side near 2^31 means "unbounded on that side"; the reference
  computes position -/+ side in int32 and must not wrap around."""
  q, k, v = qkv(10, 1, 5, 7, 2, 2, 8)
  unbounded = dict(is_causal=window[1] == 0, query_offset=2)
  if window == (0, 2**31 - 1):  # keys at or after each row's position
    unbounded = dict(mask=jnp.arange(7)[None, :] >= jnp.arange(5)[:, None] + 2, query_offset=2)
  expected = reference.attention(q, k, v, **unbounded)
  assert_tree_close(reference.attention(q, k, v, local_window_size=window, query_offset=2),
                    expected)
  assert_tree_close(jaxops.attention(q, k, v, local_window_size=window, query_offset=2),
                    expected)


def test_no_queries_gives_empty_outputs_and_zero_key_gradients():
  """T = 0: the backward's absent logsumexp cotangent ([0]) must not be taken
  for a present one that happens to hold no elements ([B, N, 0])."""
  q, k = jnp.ones((2, 0, 4, 8)), jnp.ones((2, 5, 2, 8))

  def loss(q, k, v):
    out, lse = jaxops.attention(q, k, v, return_residual=True, implementation="ffi")
    return out.sum() + lse.sum()

  out, lse = jaxops.attention(q, k, k, return_residual=True, implementation="ffi")
  assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 0, 4)
  dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, k)
  assert dq.shape == q.shape
  assert not jnp.any(dk) and not jnp.any(dv)


def test_check_grads_orders_1_and_2():
  q, k, v = qkv(10, 1, 3, 5, 2, 1, 4)
  bias = random_inputs(11, [(1, 2, 3, 5)])[0]
  f = lambda q, k, v, b: jaxops.attention(q, k, v, b, is_causal=True, query_offset=2)
  check_grads(f, (q, k, v, bias), order=1, atol=2e-2, rtol=2e-2)
  check_grads(f, (q, k, v, bias), order=2, atol=2e-2, rtol=2e-2)


# -- forward mode: the fused JVP kernel ---------------------------------------------------


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_jvp_matches_reference(case):
  """Output and log-sum-exp tangents from the tangents of q, k, v (and bias)."""
  q, k, v = qkv(40, B, T, S, N, K, 16)
  bias, mask, kwargs = _split_arrays(MASK_CASES[case])
  args = [q, k, v] + ([bias] if bias is not None else [])

  def call(fn):
    return lambda q, k, v, *b: fn(q, k, v, *(b or (None,)), mask, return_residual=True,
                                  **kwargs)

  out, _ = jvp_against_reference(jax.jit(call(jaxops.attention)), call(reference.attention),
                                 args, reduce_size=S)
  assert np.isfinite(np.asarray(out[0])).all()


@pytest.mark.parametrize("argnums", [(0,), (1,), (2,), (3,), (0, 3)], ids=str)
def test_jvp_of_some_inputs(argnums):
  """A zero tangent reaches the kernel as absent: only the other terms are computed."""
  q, k, v = qkv(41, B, T, S, N, K, 16)
  bias = random_inputs(42, [(B, 1, T, S)])[0]
  f = lambda q, k, v, b: jaxops.attention(q, k, v, b, is_causal=True, return_residual=True)
  r = lambda q, k, v, b: reference.attention(q, k, v, b, is_causal=True, return_residual=True)
  jvp_against_reference(jax.jit(f), r, [q, k, v, bias], argnums=argnums, reduce_size=S)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_jvp_shapes(shape):
  b, t, s, n, kv, h, causal = shape
  q, k, v = qkv(44, b, t, s, n, kv, h)
  f = lambda q, k, v: jaxops.attention(q, k, v, is_causal=causal, return_residual=True)
  r = lambda q, k, v: reference.attention(q, k, v, is_causal=causal, return_residual=True)
  jvp_against_reference(jax.jit(f), r, [q, k, v], reduce_size=s)


def test_jvp_with_a_traced_offset_and_under_vmap():
  q, k, v = qkv(45, 2, 3, 11, 4, 2, 8)
  tangents = tuple(random_inputs(46, [q.shape, k.shape, v.shape]))

  @jax.jit
  def jvp(offset, q, k, v, *t):
    f = lambda q, k, v: jaxops.attention(q, k, v, is_causal=True, query_offset=offset,
                                         return_residual=True)
    return jax.jvp(f, (q, k, v), t)

  for offset in (8, 5):
    expected = jax.jvp(lambda q, k, v: reference.attention(
        q, k, v, is_causal=True, query_offset=offset, return_residual=True), (q, k, v), tangents)
    assert_tree_close(jvp(offset, q, k, v, *tangents), expected, reduce_size=11)
  batched = jax.vmap(jvp, in_axes=(None, 0, None, None, 0, None, None))(
      8, jnp.stack([q, -q]), k, v, jnp.stack(tangents[:1] * 2), *tangents[1:])
  assert_tree_close(jax.tree.map(lambda x: x[1], batched), jvp(8, -q, k, v, *tangents))


def test_forward_mode_and_every_transformation():
  q, k, v = qkv(47, 1, 3, 5, 2, 1, 4)
  bias = random_inputs(48, [(1, 2, 3, 5)])[0]
  f = lambda q, k, v, b: jaxops.attention(q, k, v, b, is_causal=True, query_offset=2,
                                          return_residual=True)
  r = lambda q, k, v, b: reference.attention(q, k, v, b, is_causal=True, query_offset=2,
                                             return_residual=True)
  check_transformations(f, r, [q, k, v, bias], forward_kernel="jaxops_attention_fwd",
                        checkpoint_name="jaxops.attention", atol=1e-5, rtol=1e-4)


def test_each_mode_runs_the_fused_kernels():
  """grad: the forward and backward kernels. jvp: the one fused forward-mode
  kernel. A linearized attention evaluated later: the forward, then the fused
  kernel for the tangents alone."""
  q, k, v = qkv(49, 1, 9, 9, 2, 2, 8)
  f = lambda q, k, v: jaxops.attention(q, k, v, is_causal=True)
  grad = jax.grad(scalarize(f), argnums=(0, 1, 2))
  assert custom_call_targets(grad, q, k, v) == ["jaxops_attention_fwd", "jaxops_attention_bwd"]
  jvp = lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))
  assert custom_call_targets(jvp, q, k, v) == ["jaxops_attention_fwd_jvp"]
  linearized = lambda q, k, v: jax.linearize(f, q, k, v)[1](q, k, v)
  assert custom_call_targets(linearized, q, k, v) == [
      "jaxops_attention_fwd", "jaxops_attention_fwd_jvp"]


def test_jvp_keeps_memory_linear_in_the_sequence():
  """The fused JVP stores no [T, S] matrix: at T = S = 4096 its compiled
  temporaries are a small fraction of one score matrix (compiled, not run)."""
  shape = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.float32)
  jvp = lambda q, k, v: jax.jvp(lambda q, k, v: jaxops.attention(q, k, v, is_causal=True),
                                (q, k, v), (q, k, v))
  temp = jax.jit(jvp).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes
  assert temp < 0.05 * 4096 * 4096 * 4 * 2, f"{temp} bytes of temporaries"


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 1, 1), (2, 0, 0)],
                         ids=str)
def test_vmap(in_axes):
  q, k, v = qkv(12, 2, 7, 9, 4, 2, 8)
  batched = [jnp.stack([x * (1 + 0.3 * i) for i in range(3)], axis=ax) if ax is not None else x
             for x, ax in zip((q, k, v), in_axes)]
  bias = random_inputs(13, [(2, 1, 7, 9)])[0]
  f = lambda q, k, v: jaxops.attention(q, k, v, bias, is_causal=True,
                                       key_value_seq_lengths=np.array([9, 5], np.int32))
  vmap_against_loop(f, batched, in_axes)


def test_vmap_of_batched_bias_mask_and_lengths():
  q, k, v = qkv(14, 2, 7, 9, 2, 2, 8)
  bias = random_inputs(15, [(3, 1, 2, 7, 9)])[0]
  mask = random_mask(16, (3, 2, 1, 1, 9)).at[..., 0].set(True)
  lengths = jnp.array([[7, 3], [2, 7], [5, 5]], jnp.int32)
  f = lambda b, m, l: jaxops.attention(q, k, v, b, m, query_seq_lengths=l)
  vmap_against_loop(f, [bias, mask, lengths], (0, 0, 0))


def test_vmap_of_grad_and_grad_of_vmap():
  q, k, v = qkv(17, 2, 6, 10, 4, 2, 8)
  bias = random_inputs(18, [(1, 4, 6, 10)])[0]
  qs = jnp.stack([q * (1 + 0.2 * i) for i in range(3)])
  in_axes = (0, None, None, None)
  argnums = (0, 1, 2, 3)
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a, is_causal=True)))
  # per-example gradients, including per-example bias and k/v gradients
  per_example = jax.vmap(jax.grad(loss(jaxops.attention), argnums), in_axes)(qs, k, v, bias)
  per_example_ref = jax.vmap(jax.grad(loss(reference.attention), argnums), in_axes)(qs, k, v, bias)
  assert_tree_close(per_example, per_example_ref, atol=5e-5, rtol=5e-5)
  summed = lambda fn: lambda *a: jnp.sum(jax.vmap(loss(fn), in_axes)(*a))
  assert_tree_close(jax.grad(summed(jaxops.attention), argnums)(qs, k, v, bias),
                    jax.grad(summed(reference.attention), argnums)(qs, k, v, bias),
                    atol=5e-5, rtol=5e-5)


def test_traced_query_offset_in_a_decode_loop():
  """Decoding one token at a time against a KV cache under fori_loop: the offset
  is traced, the loop compiles once, and every step matches full causal attention."""
  steps, H = 12, 16
  q, k, v = qkv(19, 2, steps, steps, 4, 2, H)
  traces = []

  @jax.jit
  def decode(q, k, v):
    traces.append(1)

    def step(i, out):
      qi = jax.lax.dynamic_slice_in_dim(q, i, 1, axis=1)
      oi = jaxops.attention(qi, k, v, is_causal=True, query_offset=i)
      return jax.lax.dynamic_update_slice_in_dim(out, oi, i, axis=1)

    return jax.lax.fori_loop(0, steps, step, jnp.zeros_like(q))

  assert_close(decode(q, k, v), jax.nn.dot_product_attention(q, k, v, is_causal=True),
               reduce_size=steps)
  decode(q * 2, k, v)
  assert len(traces) == 1
  # a KV-cache chunk: the last 5 queries against all keys, offset S - T
  out = jaxops.attention(q[:, -5:], k, v, is_causal=True, query_offset=jnp.int32(steps - 5))
  assert_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True)[:, -5:],
               reduce_size=steps)


def test_implementations_agree():
  q, k, v = qkv(20, 1, 9, 11, 2, 1, 8)
  f = lambda impl: functools.partial(jaxops.attention, is_causal=True, implementation=impl)
  assert_close(f("ffi")(q, k, v), f("xla")(q, k, v), reduce_size=11)
  assert "jaxops_attention_fwd" in str(jax.make_jaxpr(f("ffi"))(q, k, v))
  assert "jaxops_" not in str(jax.make_jaxpr(f("xla"))(q, k, v))
  assert "jaxops_attention_fwd" in str(jax.make_jaxpr(f(None))(q, k, v))


# -- bad input -----------------------------------------------------------------------

_q, _k, _v = (jnp.ones((2, 5, 4, 8)), jnp.ones((2, 6, 2, 8)), jnp.ones((2, 6, 2, 8)))


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.attention(_q[0, 0], _k, _v), ValueError, r"query must have rank in \[3, 4\]: \[B, T, N, H\] or \[T, N, H\], got shape \(4, 8\)"),
    (lambda: jaxops.attention(_q, _k[0], _v), ValueError, "key must have rank 4: the rank of query"),
    (lambda: jaxops.attention(_q, _k[..., :4], _v[..., :4]), ValueError, "head dim"),
    (lambda: jaxops.attention(_q, _k, _v[:, :5]), ValueError, "value must have the shape of key"),
    (lambda: jaxops.attention(_q[:, :, :3], _k, _v), ValueError, "key must have a number of heads K that divides query's N = 3, got K = 2"),
    (lambda: jaxops.attention(_q, _k, _v.astype(jnp.bfloat16)), TypeError, r"value must have the dtype of key \(float32\), got bfloat16"),
    (lambda: jaxops.attention(_q.astype(jnp.int32), _k, _v), TypeError, "query must have a floating"),
    (lambda: jaxops.attention(_q, _k, _v, mask=jnp.ones((2, 4, 5, 7), bool)), ValueError,
     r"mask must be broadcastable to \[B, N, T, S\] \(2, 4, 5, 6\), got shape \(2, 4, 5, 7\)"),
    (lambda: jaxops.attention(_q, _k, _v, mask=jnp.ones((1, 2, 4, 5, 6), bool)), ValueError,
     r"mask must be broadcastable to .* got shape \(1, 2, 4, 5, 6\)"),
    (lambda: jaxops.attention(_q, _k, _v, mask=jnp.ones((5, 6))), TypeError, "mask must have dtype bool, got float32"),
    (lambda: jaxops.attention(_q, _k, _v, bias=jnp.ones((3, 1, 1, 6))), ValueError, r"bias must be broadcastable to .* got shape \(3, 1, 1, 6\)"),
    (lambda: jaxops.attention(_q, _k, _v, bias=jnp.ones((5, 6), bool)), TypeError, "bias must have a floating"),
    (lambda: jaxops.attention(_q, _k, _v, local_window_size=-1), ValueError, "local_window_size must be >= 0, got -1"),
    (lambda: jaxops.attention(_q, _k, _v, local_window_size=(2, -3)), ValueError, "local_window_size must be >= 0, got -3"),
    (lambda: jaxops.attention(_q, _k, _v, local_window_size=(1, 2, 3)), TypeError,
     "local_window_size must be None, an int or a pair of ints, got 3 values"),
    (lambda: jaxops.attention(_q, _k, _v, query_seq_lengths=jnp.ones(3, jnp.int32)), ValueError,
     r"query_seq_lengths must have shape \[B\] = \(2,\), got \(3,\)"),
    (lambda: jaxops.attention(_q, _k, _v, key_value_seq_lengths=jnp.ones(2)), TypeError,
     "key_value_seq_lengths must have an integer dtype, got float32"),
    (lambda: jaxops.attention(_q, _k, _v, query_offset=1.5), TypeError, "query_offset"),
    (lambda: jaxops.attention(_q, _k, _v, query_offset=jnp.ones(2, jnp.int32)), ValueError,
     r"query_offset must be a Python int or an integer scalar array, got shape \(2,\)"),
    (lambda: jaxops.attention(_q, _k, _v, scale=jnp.float32(2.0) + jnp.zeros(())), TypeError, "scale"),
    (lambda: jaxops.attention(_q, _k, _v, is_causal=1), TypeError, "is_causal must be a Python bool, got int 1"),
    (lambda: jaxops.attention(_q, _k, _v, implementation="cudnn"), ValueError, "implementation"),
    (lambda: jaxops.attention([[1.0]], _k, _v), TypeError, "query must be an array"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


def _fwd_operands(q_shape=(1, 3, 2, 4), k_shape=(1, 5, 1, 4), bias=np.zeros((0,), np.float32),
                  mask=np.zeros((0,), bool), lengths=np.zeros((0,), np.int32)):
  return [np.ones(q_shape, np.float32), np.ones(k_shape, np.float32), np.ones(k_shape, np.float32),
          bias, mask, lengths, np.zeros((0,), np.int32), np.int32(0)]


_ATTRS = dict(scale=np.float32(0.5), is_causal=np.bool_(False), window_left=np.int64(-1),
              window_right=np.int64(-1))


@pytest.mark.parametrize("operands,results,attrs,match", [
    (_fwd_operands(), [((1, 3, 2, 5), np.float32), ((1, 2, 3), np.float32)], _ATTRS, "out has shape"),
    (_fwd_operands(k_shape=(1, 5, 1, 3)), [((1, 3, 2, 4), np.float32), ((1, 2, 3), np.float32)],
     _ATTRS, "key must be"),
    (_fwd_operands(k_shape=(1, 5, 3, 4)), [((1, 3, 2, 4), np.float32), ((1, 2, 3), np.float32)],
     _ATTRS, "multiple of num_kv_heads"),
    (_fwd_operands(bias=np.ones((1, 2, 3, 4), np.float32)),
     [((1, 3, 2, 4), np.float32), ((1, 2, 3), np.float32)], _ATTRS, "bias has shape"),
    (_fwd_operands(mask=np.ones((1, 1, 3, 5), np.int8)),
     [((1, 3, 2, 4), np.float32), ((1, 2, 3), np.float32)], _ATTRS, "mask must be bool"),
    (_fwd_operands(lengths=np.ones((2,), np.int32)),
     [((1, 3, 2, 4), np.float32), ((1, 2, 3), np.float32)], _ATTRS, "query_seq_lengths"),
    (_fwd_operands(), [((1, 3, 2, 4), np.float32), ((1, 3, 2), np.float32)], _ATTRS, "logsumexp"),
    (_fwd_operands(), [((1, 3, 2, 4), np.float32), ((1, 2, 3), np.float32)],
     dict(_ATTRS, window_left=np.int64(-5)), "window sizes"),
])
def test_handler_rejects_inconsistent_buffers(operands, results, attrs, match):
  """Calls the handler directly with buffers the public API never passes: it must
  return an error (raised in Python), not crash the process."""
  call = jax.ffi.ffi_call("jaxops_attention_fwd", [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
