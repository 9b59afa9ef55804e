"""Out-of-process checks, started when collection ends and run beside the rest.

Most of the suite is one process whose time is XLA compiling small programs,
on one core. The checks that build and run other programs (the CUDA harness
library, its drivers under ASan and TSan, the C++ kernel tests, the op tests
on the lower CPU variants) would otherwise each run alone when their test
comes up, leaving the second core of a 2-core machine idle: about a third of
the suite's time. So a test that needs one declares it as a Job with
``@prestart(job)``; when collection ends (conftest.py), the jobs of the
selected tests start, one at a time in the order of their tests, on a worker
thread (their subprocesses release the GIL), and each test waits for its job's
result and asserts on it. A job that raises (a failed build, pytest.skip)
raises in its test. A job whose test is not selected or is skipped outright
(the harness's tests on a GPU) never runs, nor does any with --collect-only;
a job not started by then (a test run without this conftest) runs in its test.

Under pytest-xdist (support/parallel.py) the workers are the parallelism, and
a worker cannot know ahead which files it will be given. So a job that runs a
test's check (a sanitizer driver, a subprocess) is not started ahead: it runs
in its test, in the worker that has it, while the other workers run tests.
Builds (:class:`SharedJob`: products cached on disk under a file lock, the
same for every process) still start ahead, in the first worker only; another
worker that needs one waits for that worker's files instead of compiling them
again (support/file_lock.py).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from typing import Callable, Iterable

import pytest

MARKER = "background"


class Job:
  """A call to make once, ahead of the test that needs its result. Jobs among
  its arguments are ones it waits for (``result()``): they start before it."""

  shared = False

  def __init__(self, fn: Callable, *args, **kwargs):
    self._call = functools.partial(fn, *args, **kwargs)
    self._future: concurrent.futures.Future | None = None
    self._lock = threading.Lock()
    self.needs = [arg for arg in args if isinstance(arg, Job)]

  def start(self, pool: concurrent.futures.Executor) -> None:
    with self._lock:
      if self._future is None:
        self._future = pool.submit(self._call)

  def result(self):
    with self._lock:
      if self._future is None:
        self._future = concurrent.futures.Future()
        try:
          self._future.set_result(self._call())
        except BaseException as e:  # pytest.skip's exception is a BaseException
          self._future.set_exception(e)
    return self._future.result()


class SharedJob(Job):
  """A build whose products are cached on disk under a file lock: whichever
  process makes them, every process reuses them."""

  shared = True


def prestart(*jobs: Job):
  """Marks a test whose jobs start when collection ends."""
  return getattr(pytest.mark, MARKER)(*jobs)


class _Worker:
  pool: concurrent.futures.ThreadPoolExecutor | None = None


def start(items: Iterable[pytest.Item]) -> None:
  """Starts the jobs of ``items`` (in their order) on one worker thread."""
  jobs = []
  for item in items:
    if item.get_closest_marker("skip") is not None:
      continue  # a test skipped unconditionally (the harness's on a GPU) needs no job
    for mark in item.iter_markers(MARKER):
      for job in mark.args:
        jobs += [j for j in (*job.needs, job) if j not in jobs]
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker is not None:
    jobs = [job for job in jobs if job.shared] if worker == "gw0" else []
  if not jobs:
    return
  _Worker.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="jaxops-tests-bg")
  for job in jobs:
    job.start(_Worker.pool)


def stop() -> None:
  """Drops the jobs that have not started (an interrupted or -x session)."""
  if _Worker.pool is not None:
    _Worker.pool.shutdown(wait=False, cancel_futures=True)
    _Worker.pool = None
