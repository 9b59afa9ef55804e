"""The CUDA lowering of the norms, checked on a machine without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
with operands, results and attributes of the types those handlers bind
(xla_ffi/cuda/norms.cc): a mismatch, such as an f64 epsilon against
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

T = "T"  # a buffer in the dtype of x

# target -> (operand dtypes, result dtypes, attribute types), as bound in C++.
BINDINGS = {
    "jaxops_layer_norm_fwd": ((T, T, T), (T, "f32", "f32"), {"epsilon": "f32"}),
    "jaxops_layer_norm_bwd": ((T, T, T, T, "f32", "f32"), (T, T, T, "f32"), {"groups": "i64"}),
    "jaxops_rms_norm_fwd": ((T, T), (T, "f32"), {"epsilon": "f32"}),
    "jaxops_rms_norm_bwd": ((T, T, T, "f32", T), (T, T, "f32"), {"groups": "i64"}),
    "jaxops_add_rms_norm_fwd": ((T, T, T), (T, T, "f32"), {"epsilon": "f32"}),
    "jaxops_layer_norm_jvp": ((T, T, "f32", "f32", T, T, T), (T,), {}),
    "jaxops_rms_norm_jvp": ((T, T, "f32", T, T), (T,), {}),
}
# Column sums per workspace part of each backward target.
WORKSPACE_SUMS = {"jaxops_layer_norm_bwd": 2, "jaxops_rms_norm_bwd": 1}

DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\([^)]*\) \{(.*)\} : \((.*)\) -> (.*)$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)>")
_TYPED_ATTR = re.compile(r"(\w+) = [^,}]* : (\w+)")
_BOOL_ATTR = re.compile(r"(\w+) = (?:true|false)\b")


def _tensors(text):
  return [(tuple(int(d) for d in dims.split("x") if d), dtype)
          for dims, dtype in _TENSOR.findall(text)]


def _custom_calls(fn, *args):
  """[(target, operands, results, {attr: type}, attributes text)] of fn lowered for CUDA."""
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  calls = []
  for line in lowered.as_text().splitlines():
    match = _CALL.search(line)
    if match:
      target, attributes, operands, results = match.groups()
      config = re.search(r"mhlo\.backend_config = \{([^}]*)\}", attributes)
      attrs = {}
      if config:
        attrs.update(_TYPED_ATTR.findall(config.group(1)))
        # MLIR prints a bool attribute without its i1 type.
        attrs.update((name, "i1") for name in _BOOL_ATTR.findall(config.group(1)))
      calls.append((target, _tensors(operands), _tensors(results), attrs, attributes))
  return calls


def _check_binding(call, dtype):
  target, operands, results, attrs, _ = call
  want_operands, want_results, want_attrs = BINDINGS[target]
  element = DTYPES[dtype]
  resolve = lambda kinds: [element if k == T else k for k in kinds]
  assert [d for _, d in operands] == resolve(want_operands), target
  assert [d for _, d in results] == resolve(want_results), target
  assert attrs == want_attrs, target


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
  calls = _custom_calls(_loss(op), x, residual, weight)
  assert [c[0] for c in calls] == [FORWARD_TARGET[op]]
  _check_binding(calls[0], dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(FORWARD_TARGET))
def test_gradient_lowers_to_the_fused_cuda_backward(op, dtype):
  x, residual, weight = _inputs(dtype)
  calls = _custom_calls(jax.grad(_loss(op), argnums=(0, 1, 2)), x, residual, weight)
  assert [c[0] for c in calls] == [FORWARD_TARGET[op], BACKWARD_TARGET[op]]
  for call in calls:
    _check_binding(call, dtype)
  target, operands, results, attrs, _ = calls[1]
  rows, cols = x.shape
  parts, sums, workspace_cols = results[-1][0]
  assert (sums, workspace_cols) == (WORKSPACE_SUMS[target], cols)
  assert 1 <= parts <= rows
  if op == "add_rms_norm":
    assert operands[-1][0] == x.shape, "dresidual (the cotangent of h) must be passed"


JVP_TARGET = {"layer_norm": "jaxops_layer_norm_jvp", "rms_norm": "jaxops_rms_norm_jvp",
              "add_rms_norm": "jaxops_rms_norm_jvp"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(FORWARD_TARGET))
def test_forward_mode_lowers_to_the_cuda_jvp_kernel(op, dtype):
  x, residual, weight = _inputs(dtype)
  calls = _custom_calls(lambda *a: jax.jvp(_loss(op), a, a), x, residual, weight)
  assert [c[0] for c in calls] == [FORWARD_TARGET[op], JVP_TARGET[op]]
  for call in calls:
    _check_binding(call, dtype)


def test_forward_mode_passes_zero_tangents_as_absent():
  """A tangent of x alone: the weight and bias tangents reach the kernel as [0]."""
  x, _, weight = _inputs("float32")
  f = lambda x: jaxops.layer_norm(x, weight, weight, implementation="ffi")
  (_, jvp) = _custom_calls(lambda x: jax.jvp(f, (x,), (x,)), x)
  assert [shape for shape, _ in jvp[1]] == [x.shape, weight.shape, x.shape[:1], x.shape[:1],
                                            x.shape, (0,), (0,)]


def test_per_example_weight_gradients_lower_to_groups():
  x, residual, weight = _inputs("bfloat16", shape=(4, 5, 48))
  per_example = jax.vmap(jax.grad(_loss("layer_norm"), argnums=2), in_axes=(0, 0, None))
  (fwd, bwd) = _custom_calls(per_example, x, residual, weight)
  assert (fwd[0], bwd[0]) == ("jaxops_layer_norm_fwd", "jaxops_layer_norm_bwd")
  assert re.search(r"groups = 4 : i64", bwd[4])
  dx, dweight, dbias, workspace = bwd[2]
  assert dweight[0] == dbias[0] == (4, 48)
  assert workspace[0][0] % 4 == 0 and workspace[0][1:] == (2, 48)


def test_absent_parameters_are_zero_size_operands():
  x, _, _ = _inputs("float32")
  calls = _custom_calls(jax.grad(lambda x: jaxops.layer_norm(x, implementation="ffi").sum()), x)
  fwd_operands = calls[0][1]
  assert [shape for shape, _ in fwd_operands] == [x.shape, (0,), (0,)]
  bwd_results = calls[1][2]
  assert [shape for shape, _ in bwd_results[1:3]] == [(1, 0), (1, 0)]


def test_add_rms_norm_may_write_h_over_the_residual():
  x, residual, weight = _inputs("float16")
  (call,) = _custom_calls(_loss("add_rms_norm"), x, residual, weight)
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
  assert set(BINDINGS) <= set(cuda_targets)
  assert ffi_targets.targets("cuda") == tuple(cuda_targets)
