"""tests/support/parallel.py: when the suite runs on pytest-xdist workers."""

import types

import pytest

from support import parallel

pytest.importorskip("xdist")


def _config(args=("tests",), numprocesses=None, collectonly=False, usepdb=False):
  option = types.SimpleNamespace(numprocesses=numprocesses, dist="no", tx=[],
                                 collectonly=collectonly, usepdb=usepdb)
  return types.SimpleNamespace(option=option, args=list(args))


@pytest.fixture(autouse=True)
def _outside_a_worker(monkeypatch):
  monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
  monkeypatch.delenv(parallel.WORKERS_VARIABLE, raising=False)


def test_the_whole_suite_gets_a_worker_per_core_up_to_four(monkeypatch):
  monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(16)))
  config = _config()
  parallel.configure(config, gpu_requested=False)
  assert (config.option.numprocesses, config.option.dist, config.option.tx) == (
      4, "loadfile", ["popen"] * 4)
  monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1})
  config = _config(args=["tests/test_norms.py", "tests/test_rope.py::test_shapes"])
  parallel.configure(config, gpu_requested=False)
  assert config.option.numprocesses == 2


@pytest.mark.parametrize("config,gpu,variable", [
    (_config(numprocesses=0), False, None),                         # -n 0 on the command line
    (_config(numprocesses=3), False, None),                         # -n 3: xdist's own
    (_config(args=["tests/test_norms.py::test_shapes"]), False, None),  # one file
    (_config(collectonly=True), False, None),
    (_config(usepdb=True), False, None),
    (_config(), True, None),                                        # JAXOPS_TEST_GPU=1
    (_config(), False, "1"),                                        # a nested run
], ids=["n0", "n3", "one_file", "collect_only", "pdb", "gpu", "workers_1"])
def test_workers_are_left_alone(monkeypatch, config, gpu, variable):
  monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(8)))
  if variable:
    monkeypatch.setenv(parallel.WORKERS_VARIABLE, variable)
  before = config.option.numprocesses
  parallel.configure(config, gpu_requested=gpu)
  assert config.option.numprocesses == before and config.option.tx == []


def test_inside_a_worker_nothing_changes(monkeypatch):
  monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
  config = _config()
  parallel.configure(config, gpu_requested=False)
  assert config.option.numprocesses is None
