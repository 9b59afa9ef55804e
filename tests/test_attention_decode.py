"""jaxops.attention's CPU decode path (the decode core, cpu/kv_decode.h) at the shapes
that pick its branches: few query rows per kv head (T * G < the vector lanes), no
bias or mask; one group (batch 1, one kv head) with a long cache, whose keys are
split across threads and the partial results merged; a traced query_offset; the
bfloat16 dot-product path (head dim a multiple of 32) and the converted-rows
path (odd head dim). CPU only: the CUDA kernels have no such path (tests/
test_attention.py covers them at decode shapes). tests/cpp/kv_decode_test.cc
tests the core's other row sources (paged, int8, soft cap).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops import reference
from jaxops.testing import FLOAT_DTYPES, assert_close, random_inputs, vjp_against_reference


def qkv(seed, B, T, S, N, K, H, dtype):
  return random_inputs(seed, [(B, T, N, H), (B, S, K, H), (B, S, K, H)], dtype)


# (B, T, S, N, K, H): one group with a long cache (split keys), GQA with a
# prime cache length and odd head dim, T = 3 x G = 2 rows with a 64 head dim.
SHAPES = [(1, 1, 1031, 4, 1, 128), (3, 1, 97, 6, 2, 17), (2, 3, 300, 4, 2, 64)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_against_reference(shape, dtype):
  B, T, S, N, K, H = shape
  q, k, v = qkv(1, *shape, dtype)
  kwargs = dict(is_causal=True, local_window_size=(S // 2, 0),
                key_value_seq_lengths=jnp.asarray(np.linspace(S, 1, B), jnp.int32))
  offset = jnp.int32(S - T - 2)  # causal: no row sees the last two keys
  f = jax.jit(lambda q, k, v, o: jaxops.attention(q, k, v, query_offset=o, **kwargs))
  r = lambda q, k, v, o: reference.attention(q, k, v, query_offset=o, **kwargs)
  out = f(q, k, v, offset)
  assert out.dtype == dtype
  assert_close(out, r(*(x.astype(jnp.float32) for x in (q, k, v)), offset).astype(dtype),
               dtype=dtype, reduce_size=S)
  # Split keys merge in a fixed order: the same inputs give the same bits.
  np.testing.assert_array_equal(np.asarray(f(q, k, v, offset)), np.asarray(out))
  # The backward reads the forward's logsumexp.
  vjp_against_reference(functools.partial(f, o=offset), functools.partial(r, o=offset),
                        (q, k, v), dtype=dtype, reduce_size=S)


def test_rows_past_query_lengths_and_empty_caches_are_zero():
  q, k, v = qkv(2, 2, 2, 40, 4, 2, 32, jnp.float32)
  kwargs = dict(query_seq_lengths=jnp.array([1, 0], jnp.int32),
                key_value_seq_lengths=jnp.array([0, 40], jnp.int32))
  out = jaxops.attention(q, k, v, **kwargs)
  assert_close(out, reference.attention(q, k, v, **kwargs), reduce_size=40)
  assert not np.any(np.asarray(out))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "float64", jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_no_keys_at_all_give_zeros(dtype, implementation):
  """S = 0: every row attends no key, so the output is 0 (as jax.nn's) on the
  kernel and on the reference, float64 and complex included, with gradients."""
  with jax.enable_x64(dtype == "float64"):
    q = jnp.ones((2, 3, 4, 8), dtype)
    k = v = jnp.ones((2, 0, 2, 8), dtype)
    attend = lambda q, k, v: jaxops.attention(q, k, v, implementation=implementation)
    out = attend(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and not np.any(np.asarray(out))
    if not jnp.issubdtype(q.dtype, jnp.complexfloating):
      grads = jax.grad(lambda *a: attend(*a).sum(), argnums=(0, 1, 2))(q, k, v)
      assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
      assert not np.any(np.asarray(grads[0]))
