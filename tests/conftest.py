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
"cuda_harness" backend and the sanitizer files) is skipped. Without the
variable the "gpu" backend is not collected. This path has never run on a GPU.

An op test takes an argument ``backend`` to run on the backends
(support/backends.py says how it chooses them); here each module's tests are
ordered by backend and the backend is switched before each test that changes
it, so that the harness is entered once per module.
"""

import importlib.util
import os
import pathlib

import pytest

HARNESS_TEST_PREFIX = "test_cuda_harness"
SHARDING_TEST_DEVICES = 8

# The tests compile thousands of small programs whose run time is negligible:
# XLA's LLVM optimisation of the jnp references and glue is most of a test's
# time, so it is turned down (about a fifth of the suite's CPU time), and the
# fusions are emitted by XLA's older elemental emitters, not the MLIR fusion
# emitters, whose pipeline costs more per small program (test_norms.py and
# test_rope.py: 63-65 s of CPU instead of 92-102). The kernels under test are
# compiled C++ and do not change; the HLO passes (fusion, aliasing, sharding)
# still run in full.
_TEST_FLAGS = {
    "xla_force_host_platform_device_count": str(SHARDING_TEST_DEVICES),
    "xla_backend_optimization_level": "0",
    "xla_llvm_disable_expensive_passes": "true",
    "xla_cpu_use_fusion_emitters": "false",
}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags] * bool(_flags) + [f"--{name}={value}" for name, value in _TEST_FLAGS.items()
                               if name not in _flags])

from support import background, backends  # noqa: E402  (imports jax: after XLA_FLAGS)
from support.backends import GPU_VARIABLE, gpu_requested  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "backends(*names): the backends a test taking `backend` runs on "
      "(default: all; see tests/support/backends.py)")
  config.addinivalue_line(
      "markers", f"{background.MARKER}(*jobs): out-of-process work the test needs, started when "
      "collection ends (tests/support/background.py)")
  if not gpu_requested():
    return
  import jax
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
  if gpu_requested():
    import jax
    return f"{GPU_VARIABLE}: op tests on {jax.devices()[0].device_kind} ({jax.default_backend()})"
  return None


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
    if _backend_of(item) == backends.HARNESS:
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
  """The loaded harness library, for tests that change its scheduling (backend cuda_harness)."""
  assert backend == backends.HARNESS, "the harness fixture needs backend cuda_harness"
  return backends.harness()


def pytest_collection_finish(session):
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
