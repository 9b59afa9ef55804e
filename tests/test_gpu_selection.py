"""The GPU run's test selection, collected on a machine without a GPU.

With JAXOPS_TEST_GPU=1, ``pytest --collect-only`` does not ask for the GPU
(tests/conftest.py), so the selection a GPU machine would run is collected
here, in a subprocess (the op test modules choose their cases when imported)
with a plugin that records every collected test's skip marks: the "gpu"
backend's cases are there and not skipped, the harness's cases are skipped,
and so are the tests that call the harness's targets directly.
"""

import json
import os
import pathlib
import subprocess
import sys

from support import backends
from support.backends import GPU_VARIABLE

REPO = pathlib.Path(__file__).resolve().parent.parent

_RECORDER = '''
import json, os


def pytest_collection_finish(session):
  skips = {item.nodeid: [mark.kwargs.get("reason", "") for mark in item.iter_markers("skip")]
           for item in session.items}
  with open(os.environ["GPU_SELECTION"], "w") as f:
    json.dump(skips, f)
'''


def collect_gpu_selection(tmp_path, *args) -> dict[str, list[str]]:
  """{test id: reasons of its skip marks} of ``pytest --collect-only *args``, with
  JAXOPS_TEST_GPU=1."""
  (tmp_path / "gpu_selection_recorder.py").write_text(_RECORDER)
  record = tmp_path / "selection.json"
  inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
  search_path = [str(tmp_path)] + [path for path in inherited if path]
  env = {**os.environ, GPU_VARIABLE: "1", "GPU_SELECTION": str(record),
         "PYTHONPATH": os.pathsep.join(search_path)}
  result = subprocess.run(
      [sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
       "-p", "gpu_selection_recorder", *args], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  return json.loads(record.read_text())


def backend_of(test: str) -> str | None:
  """The backend named in a test id's parameters ("name[a-gpu-b]": "gpu"), if any."""
  parameters = test.partition("[")[2].rstrip("]").split("-")
  return next((name for name in backends.ORDER if name in parameters), None)


def test_gpu_selection_runs_the_gpu_and_skips_the_harness(tmp_path):
  selection = collect_gpu_selection(tmp_path, "tests/test_attention.py",
                                    "-k", "test_shapes or jvp_kernel or thread_order")
  on = lambda backend: [test for test in selection if backend_of(test) == backend]
  gpu, harness = on(backends.GPU), on(backends.HARNESS)
  calls_targets = [test for test in selection if "::test_jvp_kernel_" in test]
  assert gpu and harness and calls_targets
  assert not [test for test in gpu if selection[test]]
  assert not [test for test in on(backends.CPU) if selection[test]]
  assert all(selection[test] for test in harness), [t for t in harness if not selection[t]]
  assert {reason for test in harness for reason in selection[test]} == {
      f"CPU emulation of the CUDA kernels; with {GPU_VARIABLE}=1 they run on the GPU"}
  # The tests that call jaxops_harness_* targets or use the harness fixture run
  # on the harness only, so they are skipped with it.
  assert set(calls_targets) <= set(harness)
  assert [test for test in harness if "::test_thread_order_does_not_change_gradients" in test]
