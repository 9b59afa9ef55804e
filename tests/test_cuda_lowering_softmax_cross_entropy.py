"""The CUDA lowering of the softmax family and cross-entropy, checked without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
with operands, results and attributes of the types those handlers bind
(xla_ffi/softmax_common.h, xla_ffi/cross_entropy_common.h).
"""

import jax
import jax.numpy as jnp
import pytest

import jaxops
from support.lowering import DTYPES, T, check_binding, custom_calls

# target -> (operand dtypes, result dtypes), as bound in C++; the attributes
# come from the targets' contract.
BUFFERS = {
    # The softmax family's forwards save float32 row statistics; the
    # derivatives take x (its mask and bias) and those, never y.
    "jaxops_softmax_fwd": ((T, "i1", T), (T, "f32")),
    "jaxops_log_softmax_fwd": ((T, "i1", T), (T, "f32")),
    "jaxops_causal_softmax_fwd": ((T,), (T, "f32")),
    "jaxops_softmax_bwd": ((T, T, "i1", T, "f32"), (T,)),
    "jaxops_causal_softmax_bwd": ((T, T, "f32"), (T,)),
    "jaxops_log_softmax_bwd": ((T, T, "i1", T, "f32"), (T,)),
    "jaxops_cross_entropy_fwd": ((T, "i32"), ("f32", "f32")),
    "jaxops_cross_entropy_bwd": ((T, "i32", "f32", "f32"), (T,)),
    "jaxops_cross_entropy_fwd_grad": ((T, "i32"), ("f32", T)),
    "jaxops_softmax_jvp": ((T, "i1", T, "f32", T, T), (T,)),
    "jaxops_log_softmax_jvp": ((T, "i1", T, "f32", T, T), (T,)),
    "jaxops_causal_softmax_jvp": ((T, "f32", T), (T,)),
    "jaxops_cross_entropy_jvp": ((T, "i32", "f32", T), ("f32",)),
}


def _check(calls, targets, dtype):
  assert [c.target for c in calls] == targets
  for call in calls:
    check_binding(call, dtype, BUFFERS)


def _x(dtype, shape=(2, 6, 40)):
  return jax.random.normal(jax.random.key(0), shape, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_masked_softmax_lowers_to_the_cuda_targets(name, dtype):
  fn = getattr(jaxops, name)
  where = jnp.arange(40) < 30
  bias = jnp.ones((6, 1), dtype)
  loss = lambda x, b: fn(x, where=where, bias=b, implementation="ffi").astype(jnp.float32).sum()
  calls = custom_calls(jax.grad(loss, (0, 1)), _x(dtype), bias)
  _check(calls, [f"jaxops_{name}_fwd", f"jaxops_{name}_bwd"], dtype)
  # The mask and the bias reach the kernel unbroadcast, at x's rank; so do
  # they the backward, with the forward's statistics (two floats a row).
  fwd_operands = calls[0][1]
  assert [shape for shape, _ in fwd_operands] == [(2, 6, 40), (1, 1, 40), (1, 6, 1)]
  assert [shape for shape, _ in calls[1][1]] == [
      (2, 6, 40), (2, 6, 40), (1, 1, 40), (1, 6, 1), (2, 6, 2)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_causal_softmax_lowers_to_the_cuda_targets(dtype):
  loss = lambda x: jaxops.causal_softmax(x, query_offset=3, implementation="ffi").astype(
      jnp.float32).sum()
  calls = custom_calls(jax.grad(loss), _x(dtype))
  _check(calls, ["jaxops_causal_softmax_fwd", "jaxops_causal_softmax_bwd"], dtype)
  assert all("query_offset = 3 : i64" in call[4] for call in calls)
  assert [shape for shape, _ in calls[1][1]] == [(2, 6, 40), (2, 6, 40), (2, 6, 2)]


def test_absent_mask_and_bias_are_zero_size_operands():
  calls = custom_calls(lambda x: jaxops.softmax(x, implementation="ffi"), _x("float32"))
  assert [shape for shape, _ in calls[0][1]] == [(2, 6, 40), (0,), (0,)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cross_entropy_lowers_to_the_cuda_targets(dtype):
  labels = jnp.arange(12).reshape(2, 6) % 40
  loss = lambda x: jaxops.cross_entropy(x, labels, label_smoothing=0.1, implementation="ffi")
  calls = custom_calls(jax.grad(loss), _x(dtype))
  _check(calls, ["jaxops_cross_entropy_fwd", "jaxops_cross_entropy_bwd"], dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_runs_the_in_place_kernels(dtype, reduction):
  x = jax.random.normal(jax.random.key(1), (12, 16), dtype)
  weight = jax.random.normal(jax.random.key(2), (16, 40), dtype)
  labels = jnp.arange(12) % 40
  loss = lambda x, w: jaxops.linear_cross_entropy(x, w, labels, reduction=reduction,
                                                  implementation="ffi").astype(jnp.float32).sum()
  calls = custom_calls(jax.grad(loss, (0, 1)), x, weight)
  # Each block's logits are float32, whatever x's dtype.
  if reduction == "mean":
    # The gradients come from the forward's sweep: one kernel, logits aliased to dlogits.
    _check(calls, ["jaxops_cross_entropy_fwd_grad"], "float32")
    assert "output_tuple_indices = [1], operand_index = 0" in calls[0][4]
  else:
    _check(calls, ["jaxops_cross_entropy_fwd", "jaxops_cross_entropy_bwd"], "float32")
    assert "output_tuple_indices = [], operand_index = 0" in calls[1][4]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_forward_mode_lowers_to_the_cuda_jvp_targets(name, dtype):
  fn = getattr(jaxops, name)
  bias = jnp.ones((6, 1), dtype)
  f = lambda x, b: fn(x, bias=b, implementation="ffi")
  calls = custom_calls(lambda x, b: jax.jvp(f, (x, b), (x, b)), _x(dtype), bias)
  _check(calls, [f"jaxops_{name}_fwd", f"jaxops_{name}_jvp"], dtype)
  # x, no mask, the bias, the statistics, x's tangent and the bias tangent,
  # which reaches the kernel unbroadcast like the bias.
  assert [shape for shape, _ in calls[1][1]] == [
      (2, 6, 40), (0,), (1, 6, 1), (2, 6, 2), (2, 6, 40), (1, 6, 1)]
  causal = lambda x: jaxops.causal_softmax(x, query_offset=1, implementation="ffi")
  calls = custom_calls(lambda x: jax.jvp(causal, (x,), (x,)), _x(dtype))
  _check(calls, ["jaxops_causal_softmax_fwd", "jaxops_causal_softmax_jvp"], dtype)
  assert [shape for shape, _ in calls[1][1]] == [(2, 6, 40), (2, 6, 2), (2, 6, 40)]
  assert "query_offset = 1 : i64" in calls[1][4]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cross_entropy_forward_mode_lowers_to_the_cuda_jvp_target(dtype):
  labels = jnp.arange(12).reshape(2, 6) % 40
  f = lambda x: jaxops.cross_entropy(x, labels, z_loss=1e-4, implementation="ffi")
  calls = custom_calls(lambda x: jax.jvp(f, (x,), (x,)), _x(dtype))
  _check(calls, ["jaxops_cross_entropy_fwd", "jaxops_cross_entropy_jvp"], dtype)
