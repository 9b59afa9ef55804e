"""Runs jaxops' CUDA kernels on the CPU, through the production primitives (tests only).

The harness library (build.py) holds the unchanged CUDA kernels and CUDA FFI
handlers compiled with g++ against cuda_on_cpu.h. Its handlers are registered as
CPU FFI targets named ``jaxops_harness_<op>`` (for the handler of
``jaxops_<op>``), and :func:`cuda_kernels_on_cpu` lowers every jaxops primitive
with a harness handler on the CPU exactly as it lowers for CUDA (same operands,
attributes and CUDA-sized workspace), to that target. Public functions, custom
VJPs and batching rules are the production ones: only the kernel differs. The
op tests reach it as their "cuda_harness" backend (tests/support/backends.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import pkgutil

import jax
from jax.interpreters import mlir

import jaxops._src
from jaxops._src.primitive import FfiPrimitive

from . import build

PREFIX = "jaxops_harness_"
_MODES = {"fibers": 0, "threads": 1}
# jaxops_harness::WmmaOperand (include/cuda_on_cpu.h) and MmaOperand
# (include/mma_emulation.h), in their order; count_wgmma's kinds
# (include/wgmma_emulation_products.h) follow MmaOperand.
_WMMA_OPERANDS = ("half", "bfloat16", "tf32")
_MMA_OPERANDS = ("half", "bfloat16", "tf32")


def harness_target(target: str) -> str:
  return PREFIX + target.removeprefix("jaxops_")


class Harness:
  """The loaded harness library: its FFI targets and its scheduling controls."""

  def __init__(self, path):
    self.path = path
    self._lib = ctypes.CDLL(str(path))
    self._lib.jaxops_harness_target_name.restype = ctypes.c_char_p
    self._lib.jaxops_harness_target_handler.restype = ctypes.c_void_p
    self._lib.jaxops_harness_launches.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_sparse_mmas.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_wmma_mmas.argtypes = (ctypes.c_int,)
    self._lib.jaxops_harness_wmma_mmas.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_mma_syncs.argtypes = (ctypes.c_int,)
    self._lib.jaxops_harness_mma_syncs.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_ldmatrices.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_cp_asyncs.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_wgmmas.argtypes = (ctypes.c_int,)
    self._lib.jaxops_harness_wgmmas.restype = ctypes.c_ulonglong
    self._lib.jaxops_harness_float_to_tf32.argtypes = (ctypes.c_float,)
    self._lib.jaxops_harness_float_to_tf32.restype = ctypes.c_float
    self._lib.jaxops_harness_configure.argtypes = (ctypes.c_int, ctypes.c_ulonglong)
    self.targets = {}
    for i in range(self._lib.jaxops_harness_target_count()):
      name = self._lib.jaxops_harness_target_name(i).decode()
      handler = self._lib.jaxops_harness_target_handler(i)
      self.targets[name] = harness_target(name)
      jax.ffi.register_ffi_target(harness_target(name), jax.ffi.pycapsule(handler),
                                  platform="cpu")

  def launches(self) -> int:
    """Kernel launches run so far (a test can check that the harness ran)."""
    return self._lib.jaxops_harness_launches()

  def sparse_mmas(self) -> int:
    """Emulated sparse tensor-core instructions (mma.sp) run so far."""
    return self._lib.jaxops_harness_sparse_mmas()

  def wmma_mmas(self, operands: str) -> int:
    """Emulated wmma::mma_sync instructions run so far on ``operands``: "half",
    "bfloat16" or "tf32" (the float32 products that took the TF32 tensor cores)."""
    return self._lib.jaxops_harness_wmma_mmas(_WMMA_OPERANDS.index(operands))

  def mma_syncs(self, operands: str) -> int:
    """Emulated mma.sync instructions (cuda/mma.cuh) run so far on ``operands``:
    "half", "bfloat16" (m16n8k16) or "tf32" (m16n8k8)."""
    return self._lib.jaxops_harness_mma_syncs(_MMA_OPERANDS.index(operands))

  def ldmatrices(self) -> int:
    """Emulated ldmatrix instructions run so far."""
    return self._lib.jaxops_harness_ldmatrices()

  def cp_asyncs(self) -> int:
    """Emulated cp.async copies issued so far."""
    return self._lib.jaxops_harness_cp_asyncs()

  def wgmmas(self, operands: str) -> int:
    """Emulated wgmma.mma_async products (cuda/wgmma.cuh) run so far on
    ``operands``: "half", "bfloat16" (m64nNk16) or "tf32" (m64nNk8)."""
    return self._lib.jaxops_harness_wgmmas(_MMA_OPERANDS.index(operands))

  def float_to_tf32(self, x: float) -> float:
    """The harness's ``nvcuda::wmma::__float_to_tf32`` (cvt.rna.tf32.f32)."""
    return self._lib.jaxops_harness_float_to_tf32(x)

  def configure(self, mode: str = "fibers", seed: int = 0) -> None:
    """Fibers or OS threads per CUDA thread; seed 0 runs threads and blocks in order."""
    self._lib.jaxops_harness_configure(_MODES[mode], seed)

  @contextlib.contextmanager
  def scheduled(self, mode: str = "fibers", seed: int = 0):
    """Runs the block under :meth:`configure`'s scheduling, then the default again."""
    self.configure(mode, seed)
    try:
      yield
    finally:
      self.configure()


def ffi_primitives() -> list[FfiPrimitive]:
  """Every FfiPrimitive defined in a module of jaxops._src."""
  found = []
  for info in pkgutil.iter_modules(jaxops._src.__path__):
    module = importlib.import_module(f"jaxops._src.{info.name}")
    found += [v for v in vars(module).values() if isinstance(v, FfiPrimitive)]
  return found


@contextlib.contextmanager
def cuda_kernels_on_cpu(harness: Harness):
  """Within the context, primitives with a CUDA kernel run it (harness) on the CPU.

  JAX caches traces and lowerings by function, not by lowering rule, so the
  caches are cleared on entry and exit: nothing compiled inside leaks out, and
  nothing compiled before is reused inside.
  """
  primitives = [p for p in ffi_primitives() if p.target in harness.targets]
  jax.clear_caches()
  for p in primitives:
    mlir.register_lowering(p.primitive, p.ffi_lowering("cuda", harness.targets[p.target]),
                           platform="cpu")
  try:
    yield primitives
  finally:
    # The production CPU lowering, sharding rule included (FfiPrimitive's
    # __post_init__ registers the same).
    for p in primitives:
      mlir.register_lowering(p.primitive, p.kernel_lowering("cpu"), platform="cpu")
    jax.clear_caches()
