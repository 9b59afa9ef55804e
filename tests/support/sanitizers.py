"""Runs harness-built executables (tests/cuda_harness/build.py) in a subprocess.

A sanitizer report or a planted deadlock must not take pytest down, so each
check runs its executable apart and reads its exit code and stderr.
"""

import os
import subprocess

import pytest

from cuda_harness import build

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


def check_driver(driver: str, flavor: str, *args, seed: int = 0) -> None:
  """A kernel driver under ASan or TSan: right results and no sanitizer report."""
  result = run(executable(driver, flavor, with_kernels=True), *args, seed=seed)
  assert result.returncode == RIGHT, result.stdout + result.stderr
  tool = {"asan": "AddressSanitizer", "tsan": "ThreadSanitizer"}[flavor]
  assert tool not in result.stderr
