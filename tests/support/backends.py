"""The backends an op test runs on, and the one switch between them.

- ``"cpu"``: the CPU kernels (the production lowering).
- ``"cuda_harness"``: the CUDA kernels and handlers compiled with g++ and run
  on the CPU (:func:`cuda_harness.cuda_kernels_on_cpu`); skipped where the
  harness cannot be built, and with JAXOPS_TEST_GPU=1. A test on it fails if no
  kernel launched in the harness.
- ``"gpu"``: the CUDA kernels on an NVIDIA GPU; collected only with
  JAXOPS_TEST_GPU=1 (tests/conftest.py checks that the GPU and jaxops' CUDA
  kernels are there).

A test chooses its backends by taking an argument ``backend``: every backend
by default, the ones named by ``@pytest.mark.backends(...)``, or, with the
cases each runs, by :func:`parametrize` (the harness runs every CUDA thread on
the CPU, so its cases are shapes chosen for the CUDA block sizes, kept small).
tests/conftest.py orders each module's tests by backend and switches once per
change: entering and leaving the harness clears JAX's caches, so it happens
once per module, not per test. Tests without a ``backend`` argument run on
JAX's default backend with the production lowering.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import pytest

from support import background

CPU, HARNESS, GPU = "cpu", "cuda_harness", "gpu"
ORDER = (CPU, HARNESS, GPU)
GPU_VARIABLE = "JAXOPS_TEST_GPU"


def gpu_requested() -> bool:
  return os.environ.get(GPU_VARIABLE, "") not in ("", "0")


def collected() -> tuple[str, ...]:
  """The backends this session collects: the GPU only when asked for."""
  return ORDER if gpu_requested() else (CPU, HARNESS)


def marks(backend: str) -> list:
  if backend == HARNESS and gpu_requested():
    return [pytest.mark.skip(
        reason=f"CPU emulation of the CUDA kernels; with {GPU_VARIABLE}=1 they run on the GPU")]
  return []


def param_id(value) -> str:
  """A readable id: dtypes by name, functions by name, the rest as str()."""
  try:
    if isinstance(value, type) or isinstance(value, jnp.dtype):
      return jnp.dtype(value).name
  except TypeError:
    pass
  return getattr(value, "__name__", None) or str(value)


def with_dtypes(cases, low_precision_cases):
  """Cases for a trailing ``dtype`` argument: float32 on every case, bfloat16
  and float16 on a few (kernels whose low-precision paths differ from
  float32's only in their loads and stores: the whole product costs compile
  time and adds nothing)."""
  return ([(*case, jnp.float32) for case in cases]
          + [(*case, dtype) for case in low_precision_cases
             for dtype in (jnp.bfloat16, jnp.float16)])


def parametrize(argnames: str, cases: dict[str, list], ids=None):
  """``@pytest.mark.parametrize("backend," + argnames, ...)`` with each backend's cases.

  ``cases`` maps "cpu" and/or "cuda_harness" to their lists of values (tuples for
  several argnames). The GPU, when collected, runs every case of either. A
  case's id is ``ids(case)`` if given, else its values' ``param_id``s; the
  backend's name comes first.
  """
  names = [n.strip() for n in argnames.split(",")]
  cases = dict(cases)
  if gpu_requested():
    union = []
    for backend in (CPU, HARNESS):
      union += [c for c in cases.get(backend, []) if c not in union]
    cases[GPU] = union
  params = []
  for backend in ORDER:
    if backend not in cases or backend not in collected():
      continue
    for case in cases[backend]:
      values = tuple(case) if len(names) > 1 else (case,)
      case_id = ids(case) if ids else "-".join(map(param_id, values))
      params.append(pytest.param(backend, *values, marks=marks(backend),
                                 id=f"{backend}-{case_id}"))
  return pytest.mark.parametrize(["backend", *names], params)


# -- the switch ----------------------------------------------------------------------


class _Active:
  name: str | None = None
  stack = contextlib.ExitStack()
  harness = None
  unavailable: str | None = None


def _build_harness_library():
  import cuda_harness
  return cuda_harness.build.library("plain")


# Built in the background from the start of the session (conftest.py) when a
# test on the harness backend is selected: a minute of g++ otherwise spent
# while the first such test waits.
HARNESS_LIBRARY = background.SharedJob(_build_harness_library)


def harness():
  """The loaded harness library (builds it once); skips the test where it cannot be built."""
  import cuda_harness
  if _Active.unavailable is not None:
    pytest.skip(_Active.unavailable)
  if _Active.harness is None:
    try:
      _Active.harness = cuda_harness.Harness(HARNESS_LIBRARY.result())
    except cuda_harness.build.HarnessUnavailable as e:
      _Active.unavailable = str(e)
      pytest.skip(_Active.unavailable)
  return _Active.harness


def use(backend: str | None) -> None:
  """Lowers jaxops' primitives for ``backend`` from now on (None: JAX's default
  backend, production lowering). Does nothing if it is already in use."""
  if backend == _Active.name:
    return
  loaded = harness() if backend == HARNESS else None
  _Active.stack.close()
  _Active.name = None
  if backend == HARNESS:
    import cuda_harness
    _Active.stack.enter_context(cuda_harness.cuda_kernels_on_cpu(loaded))
  elif backend is not None and gpu_requested():
    # The default backend is the GPU then: "cpu" must say so explicitly.
    _Active.stack.enter_context(jax.default_device(jax.devices(backend)[0]))
  _Active.name = backend


def rank(backend: str | None) -> int:
  """Tests without a backend sort with the CPU's, before the harness's."""
  return ORDER.index(backend) if backend in ORDER else 0
