"""The CUDA lowering of paged_attention and paged_kv_update, checked without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
(xla_ffi/cuda/paged_attention.cc) with operands, results and attributes of the
types those handlers bind (xla_ffi/paged_attention_common.h, whose contract
gives the attribute types), absent optional operands as [0] placeholders, and
paged_kv_update's pages and scales aliased to its results (written in place).
"""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxops
from support.lowering import DTYPES, T, check_binding, custom_calls

B, TQ, N, K, H, P, PAGE, M = 2, 3, 4, 2, 16, 7, 5, 3


def _pages(page_dtype):
  shape = (P, PAGE, K, H)
  if page_dtype == "int8":
    pages = jnp.ones(shape, jnp.int8)
    return pages, pages, jnp.ones(shape[:3], jnp.float32), jnp.ones(shape[:3], jnp.float32)
  return jnp.ones(shape, page_dtype), jnp.ones(shape, page_dtype), None, None


def _buffers(page_dtype):
  """{target: (operand dtypes, result dtypes)}, T the query's dtype."""
  kv = "i8" if page_dtype == "int8" else T
  return {
      "jaxops_paged_attention_fwd": ((T, kv, kv, "i32", "i32", "i32", "f32", "f32"), (T, "f32")),
      "jaxops_paged_kv_update": ((kv, kv, T, T, "i32", "f32", "f32"), (kv, kv, "f32", "f32")),
  }


PAIRS = [(d, d) for d in DTYPES] + [(d, "int8") for d in DTYPES]


@pytest.mark.parametrize("dtype,page_dtype", PAIRS, ids=lambda d: str(d))
def test_paged_attention_lowers_to_the_cuda_target(dtype, page_dtype):
  key_pages, value_pages, key_scales, value_scales = _pages(page_dtype)
  query = jnp.ones((B, TQ, N, H), dtype)
  tables = jnp.zeros((B, M), jnp.int32)

  def f(query, kv_lens, query_lens):
    return jaxops.paged_attention(query, key_pages, value_pages, tables, kv_lens,
                                  query_lens=query_lens, logits_soft_cap=5.0,
                                  local_window_size=4, return_residual=True,
                                  key_scales=key_scales, value_scales=value_scales,
                                  implementation="ffi")

  (call,) = custom_calls(f, query, jnp.array([7, 3], jnp.int32), jnp.array([3, 1], jnp.int32))
  assert call.target == "jaxops_paged_attention_fwd"
  check_binding(call, dtype, _buffers(page_dtype))
  assert [shape for shape, _ in call.operands[3:6]] == [(B, M), (B,), (B,)]
  scales = [shape for shape, _ in call.operands[6:]]
  assert scales == ([(P, PAGE, K)] * 2 if page_dtype == "int8" else [(0,), (0,)])
  assert [shape for shape, _ in call.results] == [(B, TQ, N, H), (B, N, TQ)]
  assert call.integers["window_left"] == 4


def test_decode_query_lowers_with_one_query_row_and_no_query_lens():
  key_pages, value_pages, _, _ = _pages("float32")
  query = jnp.ones((B, N, H), jnp.float32)
  (call,) = custom_calls(
      lambda q, lens: jaxops.paged_attention(q, key_pages, value_pages,
                                             jnp.zeros((B, M), jnp.int32), lens,
                                             implementation="ffi"),
      query, jnp.array([7, 3], jnp.int32))
  assert call.operands[0][0] == (B, 1, N, H)
  assert call.operands[5][0] == (0,)  # query_lens absent
  assert call.integers["window_left"] == -1


@pytest.mark.parametrize("dtype,page_dtype", PAIRS, ids=lambda d: str(d))
def test_paged_kv_update_lowers_in_place(dtype, page_dtype):
  key_pages, value_pages, key_scales, value_scales = _pages(page_dtype)
  rows = jnp.ones((5, K, H), dtype)
  slots = jnp.array([0, 6, -1, 34, 35], jnp.int32)

  def f(key_pages, value_pages, *scales):
    kwargs = dict(zip(("key_scales", "value_scales"), scales))
    return jaxops.paged_kv_update(key_pages, value_pages, rows, rows, slots,
                                  implementation="ffi", **kwargs)

  args = (key_pages, value_pages) + ((key_scales, value_scales) if page_dtype == "int8" else ())
  (call,) = custom_calls(f, *args)
  assert call.target == "jaxops_paged_kv_update"
  check_binding(call, dtype, _buffers(page_dtype))
  # Results 0..3 alias operands 0, 1, 5, 6: the pages and scales are written in place.
  aliases = [(int(out), int(operand)) for out, operand in re.findall(
      r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call.text)]
  assert aliases == [(0, 0), (1, 1), (2, 5), (3, 6)]


def test_donated_pages_are_the_updates_results():
  """Donated pages under jax.jit lower for CUDA as parameters aliased to the
  results (tf.aliasing_output), which with the call's alias map lets XLA
  write the cache in place, without a copy."""
  key_pages, value_pages, _, _ = _pages("bfloat16")
  rows = jnp.ones((2, K, H), jnp.bfloat16)
  slots = jnp.array([0, 9], jnp.int32)
  f = jax.jit(lambda kp, vp: jaxops.paged_kv_update(kp, vp, rows, rows, slots,
                                                    implementation="ffi"),
              donate_argnums=(0, 1))
  text = f.trace(key_pages, value_pages).lower(lowering_platforms=("cuda",)).as_text()
  assert "@jaxops_paged_kv_update" in text
  assert text.count("tf.aliasing_output") == 2
