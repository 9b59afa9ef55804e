"""Suite-wide set-up: host devices for the sharding tests, the GPU run switch,
and the CUDA resource table.

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
The harness tests, which emulate the CUDA kernels on the CPU, are skipped then.
Without the variable nothing changes. This path has never run on a GPU.
"""

import importlib.util
import os
import pathlib

import pytest

GPU_VARIABLE = "JAXOPS_TEST_GPU"
HARNESS_TEST_PREFIX = "test_cuda_harness"
SHARDING_TEST_DEVICES = 8

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (
      f"{_flags} --xla_force_host_platform_device_count={SHARDING_TEST_DEVICES}").strip()


def gpu_requested() -> bool:
  return os.environ.get(GPU_VARIABLE, "") not in ("", "0")


def pytest_configure(config):
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


def pytest_collection_modifyitems(config, items):
  if not gpu_requested():
    return
  skip = pytest.mark.skip(
      reason=f"CPU emulation of the CUDA kernels; with {GPU_VARIABLE}=1 the op tests run them on the GPU")
  for item in items:
    if item.path.name.startswith(HARNESS_TEST_PREFIX):
      item.add_marker(skip)


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
