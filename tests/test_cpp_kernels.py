"""The C++ kernel tests of tests/cpp, built with g++ and run as part of the suite.

Each tests/cpp/<name>_test.cc is a standalone program that checks a cpu/ kernel
against a naive double-precision loop and exits non-zero on a mismatch (its
header says what it covers). They reach corners the Python tests reach only
slowly (every mask/window/length combination of attention in every dtype), so
the suite builds and runs them rather than leaving them to a manual CMake
option. The kernels are compiled from this checkout's cpu/ sources (as the
CUDA harness compiles cuda/), so the test also runs when jaxops itself is
installed from a wheel; Eigen comes from the cmeel-eigen package of the test
extra (or $JAXOPS_EIGEN_INCLUDE). Objects are cached under
$JAXOPS_CPP_TEST_CACHE (default ~/.cache/jaxops/cpp_tests) in a directory named
by a hash of every input, so a second run only runs.

Each test is also cross-compiled for aarch64 (the generic variant, the only
one there: NEON instead of AVX) and run under qemu-aarch64, where
aarch64-linux-gnu-g++ and qemu-aarch64 are on the PATH (Debian's
g++-aarch64-linux-gnu and qemu-user; tools/aarch64_check.sh installs them and
runs just these); skipped otherwise.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import pathlib
import platform
import re
import shutil
import subprocess

import pytest

from support import background, file_lock
from support.background import prestart

REPO = pathlib.Path(__file__).resolve().parents[1]
CPP_TESTS = sorted((REPO / "tests" / "cpp").glob("*_test.cc"))
# The flags of the shipped kernels that matter for their results (-O3 and
# -fno-math-errno as cmake/cpu_isas.cmake); -march=native: the widest variant
# this machine runs (tests/test_cpu_isa.py runs the lower ones through Python).
FLAGS = ["-std=c++17", "-O2", "-fno-math-errno", "-fopenmp"]
NATIVE = "native"
# Tests built a second time for a lower x86-64 level, whose kernels are their
# own code (not the native build's at another width): the decode core's AVX2
# few-rows kernels (cpu/kv_decode_few_rows_avx2.h) and the AVX2 bfloat16 row
# store (cpu/float_convert.h). Run where the CPU has AVX2 and FMA and the
# native build is wider.
LOWER_BUILDS = {"kv_decode_test": ["x86-64-v3"], "float_convert_test": ["x86-64-v3"]}
# Every test built a third time, for aarch64 (the generic kernels on NEON),
# statically linked so that qemu-aarch64 runs it without an aarch64 sysroot.
AARCH64 = "aarch64"
CROSS_COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
# The arguments of a test under qemu, where it runs ~20x slower: attention_test
# quick (every case, fewer thread counts and tangent subsets: 68 -> 32 s of CPU,
# 63-88 -> 39 s on 2 shared cores); kv_decode_test runs whole (~10 s).
EMULATED_ARGS = {"attention_test": ["quick"]}


def _cpu_flags() -> set[str]:
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return set()
  for line in text.splitlines():
    if line.startswith("flags"):
      return set(line.split(":", 1)[1].split())
  return set()


def _builds(source: pathlib.Path) -> list[str]:
  lower = LOWER_BUILDS.get(source.stem, [])
  flags = _cpu_flags()
  runs_avx2 = {"avx2", "fma", "f16c", "bmi2"} <= flags
  return [NATIVE, *(m for m in lower if runs_avx2 and "avx512f" in flags), AARCH64]


@functools.lru_cache(maxsize=None)
def _eigen_include() -> str:
  explicit = os.environ.get("JAXOPS_EIGEN_INCLUDE")
  if explicit:
    return explicit
  try:
    import cmeel
  except ImportError:
    pytest.skip("the C++ kernel tests need Eigen: pip install cmeel-eigen (in the test extra) "
                "or set JAXOPS_EIGEN_INCLUDE")
  # cmeel wheels install their headers under <site-packages>/cmeel.prefix.
  include = pathlib.Path(cmeel.__file__).resolve().parent.parent / "cmeel.prefix" / "include"
  return str(include / "eigen3")


def _compiler() -> str:
  cxx = os.environ.get("CXX", "g++")
  if shutil.which(cxx) is None:
    pytest.skip(f"the C++ kernel tests need a C++ compiler ({cxx})")
  return cxx


def _target(build: str) -> tuple[str, list[str]]:
  """The compiler of a build (NATIVE, an x86-64 level, AARCH64) and its
  target flags; skips the aarch64 build where its tools are missing."""
  if build != AARCH64:
    return _compiler(), [f"-march={build}"]
  if platform.machine() in ("aarch64", "arm64"):
    pytest.skip("the native build is aarch64 already")
  missing = [tool for tool in (CROSS_COMPILER, QEMU) if shutil.which(tool) is None]
  if missing:
    pytest.skip(f"the aarch64 build needs {' and '.join(missing)} on the PATH (Debian: "
                "g++-aarch64-linux-gnu, qemu-user; tools/aarch64_check.sh installs them)")
  return CROSS_COMPILER, ["-march=armv8-a"]


@functools.lru_cache(maxsize=None)
def _build_dir(build: str) -> pathlib.Path:
  compiler, target_flags = _target(build)
  digest = hashlib.sha256()
  for path in sorted([*(REPO / "cpu").iterdir(), *(REPO / "params").iterdir(), *CPP_TESTS]):
    digest.update(path.name.encode())
    digest.update(path.read_bytes())
  digest.update(" ".join([compiler, *FLAGS, *target_flags, _eigen_include()]).encode())
  digest.update(subprocess.run([compiler, "--version"], capture_output=True,
                               text=True).stdout.encode())
  root = pathlib.Path(os.environ.get("JAXOPS_CPP_TEST_CACHE",
                                     pathlib.Path.home() / ".cache" / "jaxops" / "cpp_tests"))
  out = root / digest.hexdigest()[:16]
  out.mkdir(parents=True, exist_ok=True)
  return out


def _compile(source: pathlib.Path, build: str = NATIVE) -> pathlib.Path:
  out = _build_dir(build) / f"{source.stem}.o"

  def compile_it(tmp: pathlib.Path) -> None:
    compiler, target_flags = _target(build)
    command = [compiler, *FLAGS, *target_flags, f"-I{REPO}", "-isystem", _eigen_include(), "-c",
               str(source), "-o", str(tmp)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-8000:]}"

  return file_lock.produce(out, compile_it)


def _kernel_sources(test_source: pathlib.Path) -> list[pathlib.Path]:
  """The kernels a test links: cpu/<family>*.cc for each cpu/<family>.h it
  includes (attention.h -> attention.cc, attention_jvp.cc), so a test of one
  family does not wait for every other family to compile."""
  families = re.findall(r'#include "cpu/(\w+)\.h"', test_source.read_text())
  return sorted({source for family in families for source in (REPO / "cpu").glob(f"{family}*.cc")})


def _kernel_objects(test_source: pathlib.Path, build: str) -> list[pathlib.Path]:
  """The test's kernels, compiled two at a time (the CI machine's cores)."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    return list(pool.map(functools.partial(_compile, build=build), _kernel_sources(test_source)))


def _executable(test_source: pathlib.Path, build: str = NATIVE) -> pathlib.Path:
  out = _build_dir(build) / test_source.stem

  def link(tmp: pathlib.Path) -> None:
    objects = [_compile(test_source, build), *_kernel_objects(test_source, build)]
    static = ["-static"] if build == AARCH64 else []
    command = [_target(build)[0], "-fopenmp", *static, "-o", str(tmp), *map(str, objects)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-8000:]}"

  return file_lock.produce(out, link)


def test_there_are_cpp_kernel_tests():
  assert CPP_TESTS, "tests/cpp holds no *_test.cc"


def _run_built(executable: background.Job, build: str) -> subprocess.CompletedProcess:
  path = executable.result()
  command = [str(path)]
  if build == AARCH64:
    command = [QEMU, str(path), *EMULATED_ARGS.get(path.name, [])]
  return subprocess.run(command, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "OMP_NUM_THREADS": "2"})


# The build is a job of its own: cached, so pytest-xdist workers share it.
RUNS = {(source, build): background.Job(_run_built,
                                         background.SharedJob(_executable, source, build), build)
        for source in CPP_TESTS for build in _builds(source)}


@pytest.mark.parametrize("source, build",
                         [pytest.param(s, b, marks=prestart(RUNS[s, b]),
                                       id=s.stem if b == NATIVE else f"{s.stem}-{b}")
                          for s, b in RUNS])
def test_cpp_kernel_test_passes(source, build):
  result = RUNS[source, build].result()
  assert result.returncode == 0, (
      f"{source.name} ({build}) failed (exit {result.returncode}):\n{result.stdout[-6000:]}\n"
      f"{result.stderr[-2000:]}")
  assert "ALL PASSED" in result.stdout, result.stdout[-2000:]
