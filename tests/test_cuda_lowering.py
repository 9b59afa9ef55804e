"""The CUDA lowering of the norms, checked on a machine without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
with operands and results of the types those handlers bind (xla_ffi/cuda/norms.cc)
and the attributes and workspace of the targets' C++ contract
(xla_ffi/norms_common.h): a mismatch, such as an f64 epsilon against
``Attr<float>``, fails only when the program runs on a GPU.
"""

import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

import jaxops
from jaxops._src import ffi_targets
from support.lowering import DTYPES, T, check_binding, contract_workspace, custom_calls

# target -> (operand dtypes, result dtypes), as bound in C++; the attributes
# and the workspace come from the targets' contract.
BUFFERS = {
    "jaxops_layer_norm_fwd": ((T, T, T), (T, "f32", "f32")),
    "jaxops_layer_norm_bwd": ((T, T, T, T, "f32", "f32"), (T, T, T, "f32")),
    "jaxops_rms_norm_fwd": ((T, T), (T, "f32")),
    "jaxops_rms_norm_bwd": ((T, T, T, "f32", T), (T, T, "f32")),
    "jaxops_add_rms_norm_fwd": ((T, T, T), (T, T, "f32")),
    "jaxops_layer_norm_jvp": ((T, T, "f32", "f32", T, T, T), (T,)),
    "jaxops_rms_norm_jvp": ((T, T, "f32", T, T), (T,)),
}


def _check_binding(call, dtype):
  check_binding(call, dtype, BUFFERS)


def _inputs(dtype, shape=(6, 40)):
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], shape, dtype)
  residual = jax.random.normal(keys[1], shape, dtype)
  weight = (1 + 0.1 * jax.random.normal(keys[2], shape[-1:])).astype(dtype)
  return x, residual, weight


def _loss(op):
  def loss(x, residual, weight):
    if op == "layer_norm":
      y = jaxops.layer_norm(x, weight, weight, implementation="ffi")
    elif op == "rms_norm":
      y = jaxops.rms_norm(x, weight, implementation="ffi")
    else:
      y, h = jaxops.add_rms_norm(x, residual, weight, implementation="ffi")
      y = y + h
    return y.astype(jnp.float32).sum()

  return loss


FORWARD_TARGET = {"layer_norm": "jaxops_layer_norm_fwd", "rms_norm": "jaxops_rms_norm_fwd",
                  "add_rms_norm": "jaxops_add_rms_norm_fwd"}
BACKWARD_TARGET = {"layer_norm": "jaxops_layer_norm_bwd", "rms_norm": "jaxops_rms_norm_bwd",
                   "add_rms_norm": "jaxops_rms_norm_bwd"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(FORWARD_TARGET))
def test_forward_lowers_to_the_cuda_target(op, dtype):
  x, residual, weight = _inputs(dtype)
  calls = custom_calls(_loss(op), x, residual, weight)
  assert [c[0] for c in calls] == [FORWARD_TARGET[op]]
  _check_binding(calls[0], dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(FORWARD_TARGET))
def test_gradient_lowers_to_the_fused_cuda_backward(op, dtype):
  x, residual, weight = _inputs(dtype)
  calls = custom_calls(jax.grad(_loss(op), argnums=(0, 1, 2)), x, residual, weight)
  assert [c[0] for c in calls] == [FORWARD_TARGET[op], BACKWARD_TARGET[op]]
  for call in calls:
    _check_binding(call, dtype)
  backward = calls[1]
  assert backward.results[-1] == contract_workspace(backward)
  if op == "add_rms_norm":
    assert backward.operands[-1][0] == x.shape, "dresidual (the cotangent of h) must be passed"


JVP_TARGET = {"layer_norm": "jaxops_layer_norm_jvp", "rms_norm": "jaxops_rms_norm_jvp",
              "add_rms_norm": "jaxops_rms_norm_jvp"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(FORWARD_TARGET))
def test_forward_mode_lowers_to_the_cuda_jvp_kernel(op, dtype):
  x, residual, weight = _inputs(dtype)
  calls = custom_calls(lambda *a: jax.jvp(_loss(op), a, a), x, residual, weight)
  assert [c[0] for c in calls] == [FORWARD_TARGET[op], JVP_TARGET[op]]
  for call in calls:
    _check_binding(call, dtype)


def test_forward_mode_passes_zero_tangents_as_absent():
  """A tangent of x alone: the weight and bias tangents reach the kernel as [0]."""
  x, _, weight = _inputs("float32")
  f = lambda x: jaxops.layer_norm(x, weight, weight, implementation="ffi")
  (_, jvp) = custom_calls(lambda x: jax.jvp(f, (x,), (x,)), x)
  assert [shape for shape, _ in jvp[1]] == [x.shape, weight.shape, x.shape[:1], x.shape[:1],
                                            x.shape, (0,), (0,)]


def test_per_example_weight_gradients_lower_to_groups():
  x, residual, weight = _inputs("bfloat16", shape=(4, 5, 48))
  per_example = jax.vmap(jax.grad(_loss("layer_norm"), argnums=2), in_axes=(0, 0, None))
  (fwd, bwd) = custom_calls(per_example, x, residual, weight)
  assert (fwd[0], bwd[0]) == ("jaxops_layer_norm_fwd", "jaxops_layer_norm_bwd")
  assert re.search(r"groups = 4 : i64", bwd[4])
  dx, dweight, dbias, workspace = bwd[2]
  assert dweight[0] == dbias[0] == (4, 48)
  assert workspace[0][0] % 4 == 0 and workspace[0][1:] == (2, 48)


def test_absent_parameters_are_zero_size_operands():
  x, _, _ = _inputs("float32")
  calls = custom_calls(jax.grad(lambda x: jaxops.layer_norm(x, implementation="ffi").sum()), x)
  fwd_operands = calls[0][1]
  assert [shape for shape, _ in fwd_operands] == [x.shape, (0,), (0,)]
  bwd_results = calls[1][2]
  assert [shape for shape, _ in bwd_results[1:3]] == [(1, 0), (1, 0)]


def test_add_rms_norm_may_write_h_over_the_residual():
  x, residual, weight = _inputs("float16")
  (call,) = custom_calls(_loss("add_rms_norm"), x, residual, weight)
  assert "output_tuple_indices = [1], operand_index = 1" in call[4]


def _built_with_cuda():
  return shutil.which("nvcc") is not None or bool(os.environ.get("CUDACXX"))


@pytest.mark.skipif(not _built_with_cuda(), reason="no nvcc: the build is CPU-only")
def test_cuda_module_imports_and_registers_every_cpu_target():
  import jaxops._jaxops_cpu as cpu_module
  import jaxops._jaxops_cuda as cuda_module

  cuda_targets = sorted(cuda_module.registrations())
  # Every CPU target, attention's included, has its CUDA twin.
  cpu_targets = sorted(cpu_module.registrations())
  assert cuda_targets == cpu_targets
  assert set(BUFFERS) <= set(cuda_targets)
  assert ffi_targets.targets("cuda") == tuple(cuda_targets)
