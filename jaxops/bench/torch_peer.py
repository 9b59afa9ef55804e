"""PyTorch as an optional peer of the CPU benchmarks, timed in the same process.

Present when ``import torch`` works; absent, the benchmarks are what they were
(torch is no dependency of jaxops, not even of its test extra: CI never
installs it). The peer runs on the CPU only (a GPU's would need the device
method's queueing, and the CPU wheel is what is measured against), with as
many threads as JAX's CPU kernels use: one per core the process may run on.
Its functions are ``timing.Eager`` peers: the arrays are converted once,
untimed, and torch's eager calls return when their work is done.

Same instruction set: torch picks its kernels by the CPU as jaxops does, so
where jaxops runs a narrower variant than the CPU's (``JAXOPS_CPU_ISA=avx2`` on
an AVX-512 machine, the issue-43 proxy for AVX2 CPUs) torch is held to the same
width (ATen's ``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA``, MKL's
``MKL_ENABLE_INSTRUCTIONS``) before it is imported, unless the environment sets
them already. ``describe()`` says what torch then runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

NAME = "torch"

# jaxops' CPU variant -> torch's libraries' settings of the same width.
_SAME_ISA = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def same_isa_environment(jaxops_isa: str) -> dict:
  """The environment settings that hold torch to jaxops' variant ``jaxops_isa``
  (none for avx512, the widest: torch then takes what the CPU has)."""
  return dict(_SAME_ISA.get(jaxops_isa, {}))


@functools.cache
def available() -> bool:
  """Whether torch imports (looked up once; importing it is not free)."""
  if importlib.util.find_spec("torch") is None:
    return False
  import jaxops
  for key, value in same_isa_environment(jaxops.cpu_isa()).items():
    os.environ.setdefault(key, value)
  try:
    import torch  # noqa: F401
  except Exception:  # noqa: BLE001  (a broken install is an absent peer, whatever it raises)
    return False
  return True


def threads() -> int:
  """JAX's CPU kernels' thread count: XLA's pool and OpenMP take every core the
  process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@functools.cache
def torch():
  """The torch module, set to JAX's thread count (once per process)."""
  if not available():
    raise RuntimeError("torch does not import: the torch peer is absent")
  import torch as module
  module.set_num_threads(threads())
  return module


def describe() -> dict:
  """What the peer runs: torch's version, threads and CPU kernels' width."""
  t = torch()
  return {"version": t.__version__, "threads": t.get_num_threads(),
          "cpu_capability": t.backends.cpu.get_cpu_capability(),
          **{key: os.environ[key] for key in _SAME_ISA["avx2"] if key in os.environ}}


def to_torch(x):
  """A JAX (or NumPy) array as a torch tensor of the same dtype, shape and values.

  A copy (torch wants writable memory, and a JAX array's host view is read-only);
  bfloat16, which NumPy knows only through ml_dtypes, travels as its bits."""
  t = torch()
  array = np.array(x)
  if array.dtype.name == "bfloat16":
    return t.from_numpy(array.view(np.uint16)).view(t.bfloat16)
  return t.from_numpy(array)


def refusal(peer, *args) -> str | None:
  """None when the ``timing.Eager`` peer runs on ``args``; else torch's reason,
  which the results report as the peer's skip (as for a cuDNN refusal)."""
  try:
    peer.fn(*peer.prepare(*args))
  except Exception as error:  # noqa: BLE001  (torch's refusals have no common type)
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
  return None
