"""Runs the suite on pytest-xdist workers, one per core (at most 4), when
pytest-xdist is installed (the `test` extra installs it).

Most of the suite's time is XLA compiling small programs, one at a time in
one process: on the CI's two cores a single process leaves the second core
idle once the out-of-process builds and checks (support/background.py) are
done, about two thirds of the run. Two workers use both cores throughout.

Files are distributed whole (``--dist loadfile``): a worker enters the CUDA
harness backend once per file (which clears JAX's caches, tests/conftest.py),
and a file's module-level fixtures are made once. The choice is made only
when the command line makes none: ``-n N`` (``-n 0``: one process) or
JAXOPS_TEST_WORKERS=N override it, and it is off for a run of one test file
(the file would go to one worker whole), --collect-only, --pdb, the GPU run
(JAXOPS_TEST_GPU=1, where tools/gpu_check.sh sets its own -n) and inside a
worker or a nested pytest started by a test (which sets
JAXOPS_TEST_WORKERS=1).
"""

from __future__ import annotations

import importlib.util
import os

WORKERS_VARIABLE = "JAXOPS_TEST_WORKERS"
MAX_DEFAULT_WORKERS = 4


def default_workers() -> int:
  if os.environ.get(WORKERS_VARIABLE):
    return int(os.environ[WORKERS_VARIABLE])
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cores = os.cpu_count() or 1
  return min(cores, MAX_DEFAULT_WORKERS)


def configure(config, gpu_requested: bool) -> None:
  """Sets the workers on ``config`` (pytest_cmdline_main) where nothing chose them."""
  option = config.option
  if (importlib.util.find_spec("xdist") is None or not hasattr(option, "numprocesses")
      or option.numprocesses is not None or os.environ.get("PYTEST_XDIST_WORKER")
      or option.collectonly or option.usepdb
      or gpu_requested):
    return
  files = {str(arg).split("::")[0] for arg in config.args}
  if len(files) == 1 and files.pop().endswith(".py"):
    return  # one file goes to one worker whole anyway: run it here, without the workers' start-up
  workers = default_workers()
  if workers < 2:
    return
  option.numprocesses = workers
  option.dist = "loadfile"
  option.tx = ["popen"] * workers
