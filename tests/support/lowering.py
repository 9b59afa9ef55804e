"""What a jitted function lowers to: its jaxops custom calls, read from the
StableHLO text, and their checks against the targets' C++ contract.

Shared by tests/test_contract.py and tests/test_cuda_lowering*.py. The
attribute types a call must carry are not written here: they are read from the
contract the handlers bind (jaxops._src.ffi_targets, declared in
xla_ffi/<family>_common.h).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import numpy as np

from jaxops._src import ffi_targets

T = "T"  # in an operand or result table: a buffer in the dtype of the op's floating input

# JAX dtype name -> MLIR element type.
DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

# numpy scalar type of a contract attribute -> the MLIR type of the attribute
# that binds to it. MLIR prints a bool attribute without its type: "i1" here.
_ATTRIBUTE_TYPES = {np.float32: "f32", np.float64: "f64", np.int64: "i64", np.bool_: "i1"}

_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\([^)]*\) \{(.*)\} : \((.*)\) -> (.*)$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)>")
_TYPED_ATTR = re.compile(r"(\w+) = ([^,}]*) : (\w+)")
_BOOL_ATTR = re.compile(r"(\w+) = (true|false)\b")
_CONFIG = re.compile(r"mhlo\.backend_config = \{([^}]*)\}")


class CustomCall(NamedTuple):
  target: str
  operands: list        # [(shape, MLIR element type)]
  results: list         # the same, the hidden workspace included
  attributes: dict      # {name: MLIR type}
  text: str             # the call's attributes as printed
  integers: dict        # {name: value} of its integer attributes


def _tensors(text):
  return [(tuple(int(d) for d in dims.split("x") if d), dtype)
          for dims, dtype in _TENSOR.findall(text)]


def custom_calls(fn, *args, platform="cuda") -> list[CustomCall]:
  """The custom calls of ``fn`` lowered for ``platform``, in program order."""
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  calls = []
  for line in lowered.as_text().splitlines():
    match = _CALL.search(line)
    if not match:
      continue
    target, text, operands, results = match.groups()
    config = _CONFIG.search(text)
    attributes, integers = {}, {}
    if config:
      for name, value, kind in _TYPED_ATTR.findall(config.group(1)):
        attributes[name] = kind
        if kind.startswith("i"):
          integers[name] = int(value)
      attributes.update((name, "i1") for name, _ in _BOOL_ATTR.findall(config.group(1)))
    calls.append(CustomCall(target, _tensors(operands), _tensors(results), attributes, text,
                            integers))
  return calls


def contract_attribute_types(target: str) -> dict:
  """{attribute: MLIR type} of ``target`` as its C++ contract declares it."""
  return {name: _ATTRIBUTE_TYPES[kind]
          for name, kind in ffi_targets.contract(target).attributes.items()}


def check_binding(call: CustomCall, dtype: str, buffers: dict):
  """``call`` has the operand and result dtypes of ``buffers[target]`` (T: ``dtype``)
  and the attributes, with their types, of its target's C++ contract."""
  want_operands, want_results = buffers[call.target]
  resolve = lambda kinds: [DTYPES[dtype] if kind == T else kind for kind in kinds]
  assert [d for _, d in call.operands] == resolve(want_operands), call.target
  assert [d for _, d in call.results] == resolve(want_results), call.target
  assert call.attributes == contract_attribute_types(call.target), call.target


_ELEMENT_TYPES = {"float32": "f32", "int32": "i32", "uint8": "ui8"}


def contract_workspace(call: CustomCall, platform: str = "cuda"):
  """(shape, MLIR element type) of the workspace ``call`` must end its results
  with, as the C++ contract sizes it for ``platform``."""
  aval = ffi_targets.workspace(call.target, [shape for shape, _ in call.operands],
                               call.integers, platform)
  return aval.shape, _ELEMENT_TYPES[aval.dtype.name]
