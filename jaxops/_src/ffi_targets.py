"""Loads the compiled handler modules, registers their FFI targets with JAX and
reads the targets' contract.

One extension module per platform: ``_jaxops_cpu`` is always built;
``_jaxops_cuda`` only when the build found nvcc. Each exposes
``registrations()`` (target name -> handler capsule) and the contract of every
target, declared once in C++ (``xla_ffi/contract.h``, each family's
``xla_ffi/<family>_common.h``) and bound by the handlers from that declaration:
``contract()`` (the attributes, as name and type, and whether the target has a
hidden workspace result), ``workspace(...)`` (its shape and dtype) and
``limits()``. The Python side reads these facts from ``_jaxops_cpu`` instead
of retyping them.

``_jaxops_cpu`` chooses, on that first call, which of the CPU kernel variants
(``avx512``, ``avx2``, ``generic``) to load: the one the ``JAXOPS_CPU_ISA``
environment variable names, else the widest this CPU runs. A bad value of the
variable makes ``import jaxops`` fail with a ValueError (unknown variant) or a
RuntimeError (a variant this CPU cannot run), never with SIGILL.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Mapping, Sequence

import jax
import numpy as np

# module name -> the platform name jax.ffi.register_ffi_target expects
_MODULES = {"_jaxops_cpu": "cpu", "_jaxops_cuda": "CUDA"}
_registered: dict[str, tuple[str, ...]] = {}


def _register_all() -> None:
  for module_name, platform in _MODULES.items():
    try:
      module = importlib.import_module(f"jaxops.{module_name}")
    except ImportError:
      if module_name == "_jaxops_cpu":
        raise
      continue
    targets = module.registrations()
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    _registered[platform.lower()] = tuple(sorted(targets))


def available(platform: str) -> bool:
  """Whether jaxops kernels were built and registered for ``platform``."""
  return bool(_registered.get(platform.lower()))


def targets(platform: str) -> tuple[str, ...]:
  return _registered.get(platform.lower(), ())


@dataclasses.dataclass(frozen=True)
class TargetContract:
  """What a custom-call target's handlers bind, as C++ declares it."""

  name: str
  # attribute name -> numpy scalar type the handlers decode it as, in binding order
  attributes: Mapping[str, type]
  has_workspace: bool


@functools.cache
def _contracts() -> dict[str, TargetContract]:
  module = importlib.import_module("jaxops._jaxops_cpu")
  return {name: TargetContract(name, {a: np.dtype(t).type for a, t in attributes}, workspace)
          for name, (attributes, workspace) in module.contract().items()}


def contract(target: str) -> TargetContract:
  """The contract of ``target``; a KeyError names a target C++ does not declare."""
  contracts = _contracts()
  if target not in contracts:
    raise KeyError(f"{target!r} is not a jaxops FFI target declared in C++ "
                   f"(xla_ffi/<family>_common.h); declared: {sorted(contracts)}")
  return contracts[target]


def all_contracts() -> dict[str, TargetContract]:
  return dict(_contracts())


def workspace(target: str, operand_shapes: Sequence[Sequence[int]],
              integer_attributes: Mapping[str, int], platform: str) -> jax.core.ShapedArray:
  """The hidden workspace result of a call to ``target`` lowered for ``platform``,
  sized by the C++ function its handlers check it with."""
  dims, dtype = importlib.import_module("jaxops._jaxops_cpu").workspace(
      target, [list(s) for s in operand_shapes], dict(integer_attributes), platform)
  return jax.core.ShapedArray(tuple(dims), np.dtype(dtype))


def limit(name: str) -> int:
  """A limit of the kernels declared in C++ (params/), e.g. "cuda_attention_max_head_dim"."""
  return importlib.import_module("jaxops._jaxops_cpu").limits()[name]


def cpu_isa() -> str:
  """The CPU kernel variant in use: ``"avx512"``, ``"avx2"`` or ``"generic"``.

  ``avx512`` is built for x86-64-v4 (its bfloat16 attention also uses
  AVX512_BF16 where the CPU has it), ``avx2`` for x86-64-v3 (AVX2, FMA, F16C),
  ``generic`` for x86-64-v2 (on other architectures, the compiler's default).
  The widest the CPU runs is chosen when jaxops is imported, unless the
  environment variable ``JAXOPS_CPU_ISA`` names another one.
  """
  return importlib.import_module("jaxops._jaxops_cpu").cpu_isa()


_register_all()
