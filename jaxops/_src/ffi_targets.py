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
RuntimeError (a variant this CPU cannot run), never with SIGILL. A package
without ``_jaxops_cpu`` (a source checkout that was never built, imported
because it shadows the installed jaxops) fails with a ModuleNotFoundError that
says so and what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import sys
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
    except ModuleNotFoundError as error:
      if module_name == "_jaxops_cpu" and error.name == "jaxops._jaxops_cpu":
        raise missing_extension_error(pathlib.Path(__file__).resolve().parents[1]) from error
      if module_name == "_jaxops_cpu":
        raise
      continue
    targets = module.registrations()
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    _registered[platform.lower()] = tuple(sorted(targets))


def missing_extension_error(package: pathlib.Path) -> ModuleNotFoundError:
  """What ``import jaxops`` says when the package it found, ``package``, has no
  compiled extension: most often a source checkout that shadows an installed
  jaxops, because Python puts the current directory first on ``sys.path``."""
  name = "jaxops._jaxops_cpu"
  if not (package.parent / "pyproject.toml").is_file():
    return ModuleNotFoundError(
        f"No module named {name!r}: the jaxops package at {package} has no compiled "
        "extension; the installation is incomplete, reinstall jaxops", name=name)
  installed = [str(entry / "jaxops") for entry in map(pathlib.Path, sys.path)
               if (entry / "jaxops" / "__init__.py").is_file()
               and (entry / "jaxops").resolve() != package]
  shadowed = (f" It shadows the jaxops installed at {installed[0]}, because Python puts the "
              "current directory (or the script's) first on sys.path." if installed else "")
  return ModuleNotFoundError(
      f"No module named {name!r}: jaxops is being imported from the source checkout at "
      f"{package}, which has no compiled extension.{shadowed} Run from another directory "
      "or with `python -P`, or develop in the checkout with the editable install, which "
      "builds the extension and imports the checkout's Python files: "
      "pip install -e \".[test]\" -Cbuild-dir=build/editable (see CONTRIBUTING.md).",
      name=name)


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

  Returns:
    ``"avx512"``, ``"avx2"`` or ``"generic"``.

  Examples:
    >>> jaxops.cpu_isa() in ("avx512", "avx2", "generic")
    True
  """
  return importlib.import_module("jaxops._jaxops_cpu").cpu_isa()


_register_all()
