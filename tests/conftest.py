"""Suite-wide set-up: host devices for the sharding tests, the backends of the
op tests (support/backends.py), the GPU run switch, and the CUDA resource table.

The sharding tests need several devices. On the CPU, XLA makes them from
`--xla_force_host_platform_device_count`, read once when the backend starts,
so it is set here, before any test module runs a computation. Single-device
tests are unaffected: arrays live on the first device unless a test shards them.

JAXOPS_TEST_GPU=1 asks for the op tests to run on an NVIDIA GPU (docs/cuda.md).
The op tests use JAX's default backend, so on a machine whose default backend
is the GPU they already call the CUDA kernels; the variable makes that a checked
condition instead of a silent one: the session stops unless the default backend
is "gpu" and jaxops registered its CUDA kernels (a build without nvcc would
otherwise run the references on the GPU and pass without testing a kernel).
The op tests' "gpu" backend is collected then, the "cpu" backend runs on the
CPU device, and the harness (the CUDA kernels emulated on the CPU: the
"cuda_harness" backend, the tests that use the `harness` fixture to call its
targets or change its scheduling, and the sanitizer files) is skipped. Without
the variable the "gpu" backend is not collected. With --collect-only the GPU
is not checked, so that the GPU selection can be collected, and checked
(tests/test_gpu_selection.py), on a machine without one. This path ran once,
the op test files on an NVIDIA H200 with jax 0.11.2; what that run showed is
fixed here: the XLA flags are checked against the running jaxlib, float32
matmuls run at "highest", the harness's tests are skipped, and the meshes are
made of the devices that exist (support/meshes.py).

An op test takes an argument ``backend`` to run on the backends
(support/backends.py says how it chooses them); here each module's tests are
ordered by backend and the backend is switched before each test that changes
it, so that the harness is entered once per module.
"""

import importlib.util
import os
import pathlib

import pytest

from support import xla_flags

HARNESS_TEST_PREFIX = "test_cuda_harness"
SHARDING_TEST_DEVICES = 8

# The tests compile thousands of small programs whose run time is negligible:
# XLA's LLVM optimisation of the jnp references and glue is most of a test's
# time, so it is turned down (about a fifth of the suite's CPU time), and the
# fusions are emitted by XLA's older elemental emitters, not the MLIR fusion
# emitters, whose pipeline costs more per small program (test_norms.py and
# test_rope.py: 63-65 s of CPU instead of 92-102). The kernels under test are
# compiled C++ and do not change; the HLO passes (fusion, aliasing, sharding)
# still run in full. A flag the running jaxlib does not know is left out
# (support/xla_flags.py): XLA aborts on one, and jaxlib 0.11 has no
# xla_cpu_use_fusion_emitters.
_TEST_FLAGS = {
    "xla_force_host_platform_device_count": str(SHARDING_TEST_DEVICES),
    "xla_backend_optimization_level": "0",
    "xla_llvm_disable_expensive_passes": "true",
    "xla_cpu_use_fusion_emitters": "false",
}
_test_flags_probe = xla_flags.Probe(xla_flags.missing(_TEST_FLAGS))  # runs while jax is imported
# float32 products at full float32, in this process and in the tests'
# subprocesses: XLA's default float32 matmul precision on a GPU is TF32 (a
# 10-bit mantissa), so the jnp references, the implementation="xla" paths and
# jaxops' own XLA matmuls would carry ~1e-3 relative errors where the float32
# tolerances allow ~1e-5 (about 85 of the first GPU run's 109 failures). On
# the CPU, XLA's float32 dot is full float32 at every precision: nothing
# changes there. Tests of the precision policy itself set theirs explicitly.
_MATMUL_PRECISION = "highest"
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = _MATMUL_PRECISION  # for the subprocesses

import jax  # noqa: E402

from support import background, backends, parallel  # noqa: E402
from support.backends import GPU_VARIABLE, gpu_requested  # noqa: E402

# For this process, whether or not jax was imported before the variable was set.
jax.config.update("jax_default_matmul_precision", _MATMUL_PRECISION)
# Before any test module starts a backend.
xla_flags.add_to_environment(_test_flags_probe.known())


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  parallel.configure(config, gpu_requested())


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "backends(*names): the backends a test taking `backend` runs on "
      "(default: all; see tests/support/backends.py)")
  config.addinivalue_line(
      "markers", f"{background.MARKER}(*jobs): out-of-process work the test needs, started when "
      "collection ends (tests/support/background.py)")
  if not gpu_requested() or config.option.collectonly:
    return
  from jaxops._src import ffi_targets

  backend = jax.default_backend()
  if backend != "gpu":
    raise pytest.UsageError(
        f"{GPU_VARIABLE}=1 but JAX's default backend is {backend!r}, not 'gpu': install a "
        "CUDA jaxlib (pip install 'jax[cuda13]' or 'jax[cuda12]') on a machine with an "
        "NVIDIA GPU, and do not set JAX_PLATFORMS=cpu.")
  if not ffi_targets.available("cuda"):
    raise pytest.UsageError(
        f"{GPU_VARIABLE}=1 but jaxops registered no CUDA kernels: jaxops._jaxops_cuda was not "
        "built (reinstall jaxops with nvcc on PATH or CUDACXX set).")


def pytest_report_header(config):
  if not gpu_requested():
    return None
  if config.option.collectonly:
    return f"{GPU_VARIABLE}: collecting the GPU selection (the GPU is not checked)"
  return f"{GPU_VARIABLE}: op tests on {jax.devices()[0].device_kind} ({jax.default_backend()})"


def pytest_generate_tests(metafunc):
  """`backend` not parametrised by the test itself: every backend, or the marked ones."""
  if "backend" not in metafunc.fixturenames:
    return
  if any("backend" in mark.args[0] for mark in metafunc.definition.iter_markers("parametrize")):
    return
  mark = metafunc.definition.get_closest_marker("backends")
  chosen = mark.args if mark else backends.ORDER
  unknown = set(chosen) - set(backends.ORDER)
  if unknown:
    raise pytest.UsageError(f"{metafunc.definition.nodeid}: unknown backends {sorted(unknown)}")
  metafunc.parametrize("backend", [pytest.param(b, marks=backends.marks(b), id=b)
                                   for b in chosen if b in backends.collected()])


def _backend_of(item):
  callspec = getattr(item, "callspec", None)
  return callspec.params.get("backend") if callspec else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  # Within each module, the tests of one backend together (stable otherwise).
  modules = {}
  for item in items:
    modules.setdefault(item.path, len(modules))
  items.sort(key=lambda item: (modules[item.path], backends.rank(_backend_of(item))))
  for item in items:
    backend = _backend_of(item)
    if "harness" in getattr(item, "fixturenames", ()) and backend != backends.HARNESS:
      raise pytest.UsageError(
          f"{item.nodeid} uses the harness fixture but runs on backend {backend!r}: a test "
          "that calls the harness's targets or changes its scheduling runs on "
          "@pytest.mark.backends(backends.HARNESS) only")
    if backend == backends.HARNESS:
      item.add_marker(background.prestart(backends.HARNESS_LIBRARY))
  if not gpu_requested():
    return
  skip = pytest.mark.skip(
      reason=f"CPU emulation of the CUDA kernels; with {GPU_VARIABLE}=1 the op tests run them on the GPU")
  for item in items:
    if item.path.name.startswith(HARNESS_TEST_PREFIX):
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _backend_in_use(request):
  """Switches to the test's backend; on the harness, checks that a kernel launched."""
  backend = _backend_of(request.node)
  backends.use(backend)
  if backend != backends.HARNESS:
    yield
    return
  loaded = backends.harness()
  before = loaded.launches()
  yield
  assert loaded.launches() > before, "no kernel ran in the harness"


@pytest.fixture
def harness(backend):
  """The loaded harness library, for tests that call its targets (jaxops_harness_*)
  directly or change its scheduling: they run on backend cuda_harness only, so
  JAXOPS_TEST_GPU=1 skips them with the rest of the harness."""
  assert backend == backends.HARNESS, "the harness fixture needs backend cuda_harness"
  return backends.harness()


def pytest_collection_finish(session):
  if not session.config.option.collectonly:
    background.start(session.items)


def pytest_sessionfinish(session):
  background.stop()
  backends.use(None)


def installed_cuda_resource_table() -> str | None:
  """The table the CUDA build wrote (cmake/cuda.cmake), if this jaxops has one."""
  spec = importlib.util.find_spec("jaxops")
  for location in (spec.submodule_search_locations or []) if spec else []:
    table = pathlib.Path(location) / "cuda_resource_usage.txt"
    if table.is_file():
      return table.read_text()
  return None


def pytest_terminal_summary(terminalreporter):
  table = installed_cuda_resource_table()
  if table:
    terminalreporter.write_sep("-", "CUDA kernel resources of the installed jaxops build")
    terminalreporter.write(table)
