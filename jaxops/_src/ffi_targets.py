"""Loads the compiled handler modules and registers their FFI targets with JAX.

One extension module per platform: ``_jaxops_cpu`` is always built;
``_jaxops_cuda`` only when the build found nvcc. Each exposes
``registrations()`` (target name -> handler capsule).

``_jaxops_cpu`` chooses, on that first call, which of the CPU kernel variants
(``avx512``, ``avx2``, ``generic``) to load: the one the ``JAXOPS_CPU_ISA``
environment variable names, else the widest this CPU runs. A bad value of the
variable makes ``import jaxops`` fail with a ValueError (unknown variant) or a
RuntimeError (a variant this CPU cannot run), never with SIGILL.
"""

from __future__ import annotations

import importlib

import jax

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
