"""Runs harness-built executables (tests/cuda_harness/build.py) in a subprocess.

A sanitizer report or a planted deadlock must not take pytest down, so each
check runs its executable apart and reads its exit code and stderr.
"""

import os
import subprocess

import pytest

from cuda_harness import build
from support import background

# The drivers' exit codes: results right, results wrong, a launch reported an error.
RIGHT, WRONG, LAUNCH_FAILED = 0, 3, 4
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0", "TSAN_OPTIONS": "halt_on_error=1"}


def executable(source: str, flavor: str, with_kernels: bool = False):
  """tests/cuda_harness/<source> built as ``flavor`` ("plain", "asan", "tsan"); skips
  the test where the harness cannot be built."""
  try:
    return build.executable(build.HARNESS / source, flavor, with_kernels)
  except build.HarnessUnavailable as e:
    pytest.skip(str(e))


def run(path, *args, seed: int = 0, **env) -> subprocess.CompletedProcess:
  """Runs ``path`` with the sanitizers' options and the harness's scheduling seed."""
  return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=600,
                        env={**os.environ, **SANITIZER_ENV, "JAXOPS_HARNESS_SEED": str(seed),
                             **env})


def _run_built(build: background.Job, flavor: str, args: tuple[str, ...], seed: int):
  return flavor, run(build.result(), *args, seed=seed)


_DRIVER_BUILDS: dict[tuple[str, str], background.SharedJob] = {}


def driver_job(driver: str, flavor: str, *args: str, seed: int = 0) -> background.Job:
  """A kernel driver built under ASan or TSan and run on ``args``: a job to
  prestart (support/background.py) and give to check_driver. The build is a
  job of its own (one per driver and flavor), which pytest-xdist workers share."""
  build = _DRIVER_BUILDS.setdefault(
      (driver, flavor), background.SharedJob(executable, driver, flavor, with_kernels=True))
  return background.Job(_run_built, build, flavor, tuple(args), seed)


def check_driver(job: background.Job) -> None:
  """A driver_job's run: right results and no sanitizer report."""
  flavor, result = job.result()
  assert result.returncode == RIGHT, result.stdout + result.stderr
  tool = {"asan": "AddressSanitizer", "tsan": "ThreadSanitizer"}[flavor]
  assert tool not in result.stderr
