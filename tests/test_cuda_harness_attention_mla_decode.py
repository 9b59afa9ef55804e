"""jaxops.attention's CUDA decode path with a value head dim of its own (MLA's
192/128), run in the CPU harness.

Decode-path calls (T * G query rows of a kv head in one tile, no bias, mask
or segment ids: params/attention_decode.h) whose value head dim Hv differs
from H take the MLA decode kernel of cuda/kv_decode.cuh (mla_decode_block,
tiles of 16 rows at every width) with the dense [B, S, K, H] / [B, S, K, Hv]
cache as its row source, and its merge when the keys split; the workspace
is the MLA plan's, partials Hv floats a row. Cases: float32 and bfloat16, 16
query heads on one kv head at T = 1, 8 heads at T = 2 (16 rows), ragged
key_value_seq_lengths, causal and windowed, element rows (odd head dims), split-K over a long batch-1 cache,
and one backward (the tiled backward kernels reading the MLA kernel's
log-sum-exp). Heads above 256 (absorbed MLA's 576/512) still take the
reference on CUDA (jaxops/_src/attention.py's _use_kernel: the tiled kernels
and the backward stop at 256), not tested here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops import reference
from jaxops.testing import assert_close, random_inputs, vjp_against_reference
from support import backends
from support.lowering import contract_workspace, custom_calls


def qkv(seed, B, T, S, N, K, H, Hv, dtype):
  return random_inputs(seed, [(B, T, N, H), (B, S, K, H), (B, S, K, Hv)], dtype)


def _ceil(a, b):
  return -(-a // b)


def mla_workspace_bytes(B, T, S, N, K, Hv):
  """params/decode_plan.h's mla_decode_plan and decode_workspace_bytes, written out."""
  rows = T * (N // K)
  row_tiles = _ceil(rows, 16)
  rows_per_tile = _ceil(rows, row_tiles)
  splits = min(_ceil(S, 256), 128, _ceil(4 * 132, B * K * row_tiles))
  keys_per_split = _ceil(_ceil(S, splits), 32) * 32
  splits = _ceil(S, keys_per_split)
  if splits <= 1:
    return 0
  return B * K * row_tiles * splits * rows_per_tile * (Hv + 2) * 4


CAUSAL = dict(is_causal=True, window=lambda S: None)
WINDOW = dict(is_causal=True, window=lambda S: (S // 3, 0))

# ((B, T, S, N, K, H, Hv), dtype, masks, split, backward)
CASES = [
    ((3, 1, 97, 16, 1, 192, 128), jnp.float32, CAUSAL, False, False),
    ((3, 1, 97, 16, 1, 192, 128), jnp.bfloat16, WINDOW, False, False),
    ((2, 2, 70, 8, 1, 192, 128), jnp.float32, WINDOW, False, False),  # T = 2, 16 rows
    ((2, 2, 70, 8, 1, 192, 128), jnp.bfloat16, CAUSAL, False, False),
    ((1, 1, 1100, 16, 1, 192, 128), jnp.float32, CAUSAL, True, False),  # split-K
    ((1, 2, 1100, 8, 1, 192, 128), jnp.bfloat16, CAUSAL, True, False),
    ((2, 1, 40, 4, 1, 64, 32), jnp.float32, CAUSAL, False, True),
    ((2, 1, 50, 6, 2, 17, 13), jnp.bfloat16, WINDOW, False, False),  # element rows
]


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("shape,dtype,masks,split,backward", CASES,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}" for c in CASES])
def test_mla_decode_kernel(backend, shape, dtype, masks, split, backward):
  B, T, S, N, K, H, Hv = shape
  q, k, v = qkv(7, *shape, dtype)
  kwargs = dict(is_causal=masks["is_causal"], local_window_size=masks["window"](S),
                key_value_seq_lengths=jnp.asarray(np.linspace(S, 1, B), jnp.int32))
  offset = jnp.int32(S - T - 1)
  f = jax.jit(lambda q, k, v, o: jaxops.attention(q, k, v, query_offset=o, return_residual=True,
                                                  implementation="ffi", **kwargs))
  r = lambda q, k, v, o: reference.attention(q, k, v, query_offset=o, return_residual=True,
                                             **kwargs)
  harness = backends.harness()
  mmas = lambda: sum(harness.wmma_mmas(kind) for kind in ("half", "bfloat16", "tf32"))
  launches, products = harness.launches(), mmas()
  out, lse = f(q, k, v, offset)
  # The MLA decode kernel (and its merge where the keys split), not the tiled
  # forward: no tensor-core products.
  assert harness.launches() - launches == (2 if split else 1)
  assert mmas() == products
  assert out.shape == (B, T, N, Hv)
  expected_out, expected_lse = r(*(x.astype(jnp.float32) for x in (q, k, v)), offset)
  assert_close(out, expected_out.astype(dtype), dtype=dtype, reduce_size=S)
  assert_close(lse.astype(jnp.float32), expected_lse.astype(dtype).astype(jnp.float32),
               dtype=dtype, reduce_size=S)
  if backward:
    vjp_against_reference(lambda q, k, v: f(q, k, v, offset), lambda q, k, v: r(q, k, v, offset),
                          (q, k, v), dtype=dtype, reduce_size=S)


def _forward_workspace(q_shape, k_shape, v_shape, platform="cuda"):
  q, k, v = jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(v_shape)
  f = lambda q, k, v: jaxops.attention(q, k, v, implementation="ffi")
  (call,) = custom_calls(f, q, k, v, platform=platform)
  assert call.target == "jaxops_attention_fwd"
  assert call.results[-1] == contract_workspace(call, platform)
  return call.results[-1][0][0]


@pytest.mark.parametrize("shape", [(1, 1, 1100, 16, 1, 192, 128), (1, 2, 4096, 8, 1, 192, 128),
                                   (2, 1, 1024, 4, 2, 32, 64), (1, 1, 200, 16, 1, 192, 128)],
                         ids=str)
def test_workspace_is_the_mla_plan(shape):
  """Split-K partials Hv floats a row in tiles of 16 rows (the decode kernel's
  plan for H = 192 would take tiles of 8 and H + 2 floats)."""
  B, T, S, N, K, H, Hv = shape
  got = _forward_workspace((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
  assert got == mla_workspace_bytes(B, T, S, N, K, Hv)
  if shape[2] >= 1024:
    assert got > 0
  assert _forward_workspace((B, T, N, H), (B, S, K, H), (B, S, K, Hv), platform="cpu") == 0


def test_rows_beyond_a_tile_take_no_workspace():
  """32 rows of a kv head (T = 2 x 16 heads): the tiled kernel, no decode workspace."""
  assert _forward_workspace((1, 2, 16, 192), (1, 1100, 1, 192), (1, 1100, 1, 128)) == 0
