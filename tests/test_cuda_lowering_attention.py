"""The CUDA lowering of attention, checked without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
with operands, results and attributes of the types those handlers bind
(xla_ffi/attention_common.h, whose contract gives the attribute types), and
size the backward's hidden workspace as the CUDA handler checks it (float32 D
rows, [B, N, T]).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops._src import ffi_targets
from support.lowering import DTYPES, T, check_binding, custom_calls

# q, k, v, bias, mask, the two sequence lengths, the two segment ids, query_offset.
OPERANDS = (T, T, T, "f32", "i1", "i32", "i32", "i32", "i32", "i32")
# target -> (operand dtypes, result dtypes); the attributes come from the contract.
BUFFERS = {
    "jaxops_attention_fwd": (OPERANDS, (T, "f32", "ui8")),
    "jaxops_attention_bwd": ((*OPERANDS, T, "f32", T, "f32"), (T, T, T, "f32", "ui8")),
    "jaxops_attention_fwd_jvp": ((*OPERANDS, T, T, T, "f32"), (T, "f32", T, "f32")),
}
B, TQ, S, N, K, H = 2, 5, 7, 4, 2, 16


def _inputs(dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, TQ, N, H), dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), dtype)
  bias = jax.random.normal(keys[3], (1, N, TQ, S), jnp.float32)
  return q, k, v, bias


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_lowers_to_the_cuda_targets(dtype):
  q, k, v, bias = _inputs(dtype)
  mask = jnp.ones((B, 1, 1, S), bool)
  lengths = np.array([5, 3], np.int32)

  def loss(q, k, v, bias, offset):
    out = jaxops.attention(q, k, v, bias, mask, is_causal=True, local_window_size=(3, 1),
                           query_seq_lengths=lengths, key_value_seq_lengths=lengths + 2,
                           query_offset=offset, implementation="ffi")
    return out.astype(jnp.float32).sum()

  calls = custom_calls(jax.grad(loss, (0, 1, 2, 3)), q, k, v, bias, jnp.int32(2))
  assert [c[0] for c in calls] == ["jaxops_attention_fwd", "jaxops_attention_bwd"]
  for call in calls:
    check_binding(call, dtype, BUFFERS)
    operands, text = call.operands, call.text
    # The traced query_offset is a scalar operand; bias and mask arrive unbroadcast.
    assert [shape for shape, _ in operands[3:10]] == [(1, N, TQ, S), (B, 1, 1, S), (B,), (B,),
                                                      (0,), (0,), ()]
    assert "window_left = 3 : i64" in text and "window_right = 1 : i64" in text
  bwd_results = calls[1][2]
  assert bwd_results[3][0] == (1, N, TQ, S)          # dbias, bias-shaped
  assert bwd_results[4][0] == (4 * B * N * TQ,)      # workspace bytes


def test_absent_operands_and_no_dbias():
  q, k, v, _ = _inputs("float32")
  calls = custom_calls(jax.grad(lambda q: jaxops.attention(q, k, v, implementation="ffi").sum()),
                        q)
  fwd, bwd = calls
  assert [shape for shape, _ in fwd[1][3:9]] == [(0,), (0,), (0,), (0,), (0,), (0,)]
  assert "with_dbias = false" in bwd[4]
  assert bwd[2][3][0] == (0,)


def test_cpu_lowering_has_an_empty_workspace():
  """The CPU handler allocates its own scratch: its workspace result is [0]."""
  q, k, v, _ = _inputs("float32")
  f = jax.grad(lambda q: jaxops.attention(q, k, v, implementation="ffi").sum())
  text = jax.jit(f).trace(q).lower(lowering_platforms=("cpu",)).as_text()
  bwd = [line for line in text.splitlines() if "@jaxops_attention_bwd" in line]
  assert len(bwd) == 1 and "tensor<0xui8>" in bwd[0].split("->")[-1]


@pytest.mark.skipif(not ffi_targets.available("cuda"),
                    reason="jaxops was built without nvcc: no CUDA kernel to choose")
def test_head_dims_above_the_cuda_limit_take_the_reference_on_cuda(monkeypatch):
  from jaxops._src import primitive

  monkeypatch.setattr(primitive, "current_platform", lambda: "cuda")
  limit = ffi_targets.limit("cuda_attention_max_head_dim")
  q = jnp.ones((1, 3, 1, limit + 8))
  at_limit = q[..., :limit]
  assert "jaxops_attention_fwd" in str(jax.make_jaxpr(jaxops.attention)(at_limit, at_limit,
                                                                          at_limit))
  assert "jaxops_" not in str(jax.make_jaxpr(jaxops.attention)(q, q, q))
  with pytest.raises(ValueError, match=f"head dims up to {limit}"):
    jaxops.attention(q, q, q, implementation="ffi")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_mode_lowers_to_the_one_fused_cuda_kernel(dtype):
  q, k, v, bias = _inputs(dtype)

  def f(q, k, v, bias, offset):
    return jaxops.attention(q, k, v, bias, is_causal=True, query_offset=offset,
                            return_residual=True, implementation="ffi")

  jvp = lambda q, k, v, b, o: jax.jvp(lambda q, k, v, b: f(q, k, v, b, o), (q, k, v, b),
                                      (q, k, v, b))
  (call,) = custom_calls(jvp, q, k, v, bias, jnp.int32(2))
  assert call.target == "jaxops_attention_fwd_jvp"
  check_binding(call, dtype, BUFFERS)
  # The bias tangent is bias-shaped; a zero tangent (none of v here) is absent.
  (call,) = custom_calls(lambda q, b: jax.jvp(lambda q, b: f(q, k, v, b, 0), (q, b), (q, b)),
                          q, bias)
  assert [shape for shape, _ in call[1][10:]] == [q.shape, (0,), (0,), bias.shape]
