"""Loads the compiled handler modules and registers their FFI targets with JAX.

One extension module per platform: ``_jaxops_cpu`` is always built;
``_jaxops_cuda`` only when the build found nvcc. Each exposes
``registrations()`` (target name -> handler capsule).
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


_register_all()
