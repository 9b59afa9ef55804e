"""The CUDA lowering of paged_attention and paged_kv_update, checked without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
(xla_ffi/cuda/paged_attention.cc) with operands, results and attributes of the
types those handlers bind (xla_ffi/paged_attention_common.h, whose contract
gives the attribute types), absent optional operands as [0] placeholders, the
attention's hidden workspace of the size its split-K plan needs
(params/paged_attention_plan.h; [0] on the CPU and where the keys are not
split), and paged_kv_update's pages and scales aliased to its results (written
in place). The handlers themselves run in the CUDA harness: they reject
inconsistent buffers, a missing workspace included, with an error (launching
nothing), and the update starts from a copy of its operands when XLA did not
alias them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_harness
import jaxops
from support import backends
from support.lowering import DTYPES, T, check_binding, contract_workspace, custom_calls

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
      "jaxops_paged_attention_fwd": ((T, kv, kv, "i32", "i32", "i32", "f32", "f32"),
                                     (T, "f32", "ui8")),
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
  # 15 keys of capacity: the plan does not split them, the workspace is empty.
  assert [shape for shape, _ in call.results] == [(B, TQ, N, H), (B, N, TQ), (0,)]
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


def _lowered_workspace(query_shape, page_size, max_pages, platform="cuda"):
  """The workspace result of paged_attention lowered for ``platform``."""
  pages = jnp.ones((4, page_size, K, H), jnp.float32)
  tables = jnp.zeros((query_shape[0], max_pages), jnp.int32)
  (call,) = custom_calls(
      lambda q, lens: jaxops.paged_attention(q, pages, pages, tables, lens, implementation="ffi"),
      jnp.ones(query_shape, jnp.float32), jnp.ones((query_shape[0],), jnp.int32),
      platform=platform)
  assert call.results[-1] == contract_workspace(call, platform)
  return call.results[-1]


def test_split_decode_lowers_with_the_planned_workspace():
  """Decode of one sequence over 1024 keys: the plan (params/paged_attention_plan.h)
  splits them 4 ways (256 keys each), so the CUDA call carries the float32
  partial outputs and (max, sum) of [B, K, splits, rows] rows, as bytes."""
  batch, splits, rows = 1, 4, N // K
  assert _lowered_workspace((batch, N, H), 16, 64) == (
      (batch * K * splits * rows * (H + 2) * 4,), "ui8")
  # The CPU kernel splits within its own scratch: its workspace is empty.
  assert _lowered_workspace((batch, N, H), 16, 64, platform="cpu") == ((0,), "ui8")


def test_short_capacities_lower_with_an_empty_workspace():
  """256 keys or fewer are not split."""
  assert _lowered_workspace((1, N, H), 16, 16) == ((0,), "ui8")


def test_few_prefill_tiles_split_their_keys_too():
  """A short chunk of 9 tokens: 18 rows per kv head take two tiles of 9 rows,
  whose 1024 keys still split 4 ways (few blocks without splits)."""
  row_tiles, splits, rows = 2, 4, 9
  assert _lowered_workspace((1, 9, N, H), 16, 64) == (
      (K * row_tiles * splits * rows * (H + 2) * 4,), "ui8")


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


# -- the CUDA handlers, run in the harness (tests/cuda_harness) ----------------------------

F32 = np.float32
_Q, _PAGES = np.ones((2, 1, 4, 8), F32), np.ones((3, 4, 2, 8), F32)
_TABLES, _LENS = np.zeros((2, 2), np.int32), np.ones((2,), np.int32)
_ATTRS = {"scale": F32(1), "logits_soft_cap": F32(0), "window_left": np.int64(-1),
          "value_head_dim": np.int64(8), "allow_tf32": np.bool_(False)}
_NONE = np.zeros((0,), np.int32), np.zeros((0,), F32), np.zeros((0,), F32)
_WIDE = 584  # above the CUDA kernels' head-dim limit (576), which the CPU kernel does not have
_EMPTY = ((0,), np.uint8)  # the workspace of a plan without key splits
# Decode of one sequence over 512 keys: two splits of 2 rows x (8 + 2) floats per kv head.
_LONG_TABLES, _SPLIT_BYTES = np.zeros((1, 32), np.int32), 1 * 2 * 2 * 2 * (8 + 2) * 4
_LONG_PAGES = np.ones((3, 16, 2, 8), F32)


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    ("jaxops_paged_attention_fwd",
     [np.ones((2, 1, 4, _WIDE), F32), np.ones((3, 4, 2, _WIDE), F32),
      np.ones((3, 4, 2, _WIDE), F32), _TABLES, _LENS, *_NONE],
     [((2, 1, 4, _WIDE), F32), ((2, 4, 1), F32), _EMPTY],
     dict(_ATTRS, value_head_dim=np.int64(_WIDE)), "head_dim <= 576"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES[:, :2], _TABLES, _LENS, *_NONE],
     [((2, 1, 4, 8), F32), ((2, 4, 1), F32), _EMPTY], _ATTRS,
     r"value_pages must be \[3, 4, 2, value_head_dim\]"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES.astype(np.int8), _PAGES.astype(np.int8),
                                    _TABLES, _LENS, *_NONE],
     [((2, 1, 4, 8), F32), ((2, 4, 1), F32), _EMPTY], _ATTRS,
     "key_scales must be float32 of shape"),
    ("jaxops_paged_attention_fwd", [_Q[:1], _LONG_PAGES, _LONG_PAGES, _LONG_TABLES, _LENS[:1],
                                    *_NONE],
     [((1, 1, 4, 8), F32), ((1, 4, 1), F32), _EMPTY], _ATTRS,
     rf"workspace must be uint8 of shape \[{_SPLIT_BYTES}\]"),
    ("jaxops_paged_kv_update", [_PAGES, _PAGES, np.ones((3, 2, 4), F32), np.ones((3, 2, 4), F32),
                                np.zeros((3,), np.int32), *_NONE[1:]],
     [((3, 4, 2, 8), F32), ((3, 4, 2, 8), F32), ((0,), F32), ((0,), F32)], {}, "key must be"),
])
def test_cuda_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  """The CUDA handlers return an error, launching nothing, for what the shared
  checks reject, for head dims above the CUDA kernel's limit and for a
  workspace other than the plan's (here: none where the keys split)."""
  harness = backends.harness()
  launches = harness.launches()
  call = jax.ffi.ffi_call(cuda_harness.harness_target(target),
                          [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))
  assert harness.launches() == launches


def test_cuda_update_handler_copies_an_unaliased_operand():
  """Called without aliasing (a plain ffi_call), the CUDA update handler
  starts its results from copies of the pages and writes only the slots."""
  backends.harness()
  pages = np.arange(3 * 4 * 2 * 8, dtype=F32).reshape(3, 4, 2, 8)
  rows = -np.ones((2, 2, 8), F32)
  call = jax.ffi.ffi_call(cuda_harness.harness_target("jaxops_paged_kv_update"),
                          [jax.ShapeDtypeStruct(pages.shape, F32)] * 2 +
                          [jax.ShapeDtypeStruct((0,), F32)] * 2)
  key_pages, value_pages, _, _ = call(pages, pages, rows, rows, np.array([5, -1], np.int32),
                                      *_NONE[1:])
  expected = pages.copy()
  expected[1, 1] = -1  # slot 5 = page 1, offset 1; slot -1 is padding
  np.testing.assert_array_equal(np.asarray(key_pages), expected)
  np.testing.assert_array_equal(np.asarray(value_pages), expected)
