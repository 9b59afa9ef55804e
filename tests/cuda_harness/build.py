"""Builds the CUDA harness binaries with g++ (tests only; nothing here is shipped).

The kernel sources (cuda/*.cu) and the CUDA FFI handlers (xla_ffi/cuda/*.cc) are
read from the checkout this file lives in, unchanged, so the tests also work
when jaxops itself is installed from a wheel. Products are cached under
$JAXOPS_HARNESS_CACHE (default ~/.cache/jaxops/cuda_harness) in a directory named
by a hash of every input, so a second session only links nothing and loads.
Each product is made under a file lock (support/file_lock.py): pytest-xdist
workers asking for the same one at once build it once.

Flavors: "plain" (-O2), "asan" (AddressSanitizer), "tsan" (ThreadSanitizer;
the runtime then makes each CUDA thread's fiber a TSan fiber).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from support import file_lock

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "cuda_harness"
INCLUDE = HARNESS / "include"

_FLAVOR_FLAGS = {
    "plain": ["-O2"],
    "asan": ["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"],
    "tsan": ["-O1", "-fsanitize=thread"],
}
# Function-local statics of namespaces other than these are __shared__ variables.
_NOT_SHARED = ("_ZZNSt", "_ZZNKSt", "_ZZN9__gnu_cxx", "_ZZNK9__gnu_cxx", "_ZZN14jaxops_harness")


class HarnessUnavailable(RuntimeError):
  pass


def compiler() -> str:
  cxx = os.environ.get("JAXOPS_HARNESS_CXX", "g++")
  if shutil.which(cxx) is None or shutil.which("objcopy") is None:
    raise HarnessUnavailable(f"the CUDA harness needs {cxx} and objcopy")
  return cxx


def kernel_sources() -> list[Path]:
  return sorted((REPO / "cuda").glob("*.cu"))


def handler_sources() -> list[Path]:
  return sorted((REPO / "xla_ffi" / "cuda").glob("*.cc"))


@functools.lru_cache(maxsize=None)
def _ffi_include() -> str:
  import jax.ffi

  return jax.ffi.include_dir()


@functools.lru_cache(maxsize=None)
def _build_dir() -> Path:
  digest = hashlib.sha256()
  inputs = [p for d in ("cuda", "params", "xla_ffi", "tests/cuda_harness") for p in (REPO / d).rglob("*")
            if p.is_file() and p.suffix in (".h", ".cc", ".cu", ".cuh", ".py")]
  for path in sorted(inputs):
    digest.update(str(path.relative_to(REPO)).encode())
    digest.update(path.read_bytes())
  version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout
  digest.update(version.encode())
  digest.update(_ffi_include().encode())
  root = Path(os.environ.get("JAXOPS_HARNESS_CACHE",
                             Path.home() / ".cache" / "jaxops" / "cuda_harness"))
  out = root / digest.hexdigest()[:16]
  out.mkdir(parents=True, exist_ok=True)
  return out


def _run(command: list[str]) -> None:
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    raise RuntimeError(f"harness build failed: {' '.join(command)}\n{result.stderr[-8000:]}")


def _move_shared_statics(obj: Path) -> None:
  """Renames the sections of function-local statics (-fdata-sections) to jaxops_shared."""
  listing = subprocess.run(["readelf", "-SW", str(obj)], capture_output=True, text=True,
                           check=True).stdout
  names = re.findall(r"\]\s+(\.bss\.(_ZZ\S+))\s", listing)
  renames = [f"--rename-section={section}=jaxops_shared" for section, symbol in names
             if not symbol.startswith(_NOT_SHARED)]
  if renames:
    _run(["objcopy", *renames, str(obj)])


def _compile(source: Path, flavor: str, kind: str) -> Path:
  out = _build_dir() / f"{source.stem}.{kind}.{flavor}.o"
  return file_lock.produce(out, lambda tmp: _compile_to(source, flavor, kind, tmp))


def _compile_to(source: Path, flavor: str, kind: str, tmp: Path) -> None:
  # -g1: line tables only, all the sanitizers' reports use (file:line in each
  # frame); full -g made the kernels' builds 1.5x slower (attention_backward.cu
  # under TSan 11.3 s -> 7.5 s) and their objects 3x larger, for variable
  # information no test reads.
  flags = ["-std=c++17", "-g1", "-fPIC", *_FLAVOR_FLAGS[flavor], f"-I{INCLUDE}", f"-I{REPO}"]
  if kind == "kernel":
    flags += ["-fdata-sections", "-include", "cuda_on_cpu.h", "-x", "c++"]
  elif kind == "handler":
    # Handlers are not what the sanitizers examine; one -O1 build serves all flavors.
    flags = ["-std=c++17", "-O1", "-fPIC", f"-I{INCLUDE}", f"-I{REPO}",
             "-isystem", _ffi_include(), "-include", str(HARNESS / "ffi_host_stream.h")]
  elif kind == "driver":
    flags += ["-fdata-sections", "-include", "cuda_on_cpu.h", "-x", "c++"]
  _run([compiler(), *flags, "-c", str(source), "-o", str(tmp)])
  if kind in ("kernel", "driver"):
    _move_shared_statics(tmp)


def _compile_all(units: list[tuple[Path, str, str]]) -> list[Path]:
  jobs = int(os.environ.get("JAXOPS_HARNESS_JOBS", "2"))
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    return list(pool.map(lambda unit: _compile(*unit), units))


def _link(name: str, objects: list[Path], flavor: str, shared: bool) -> Path:
  out = _build_dir() / name

  def link(tmp: Path) -> None:
    sanitizer = [f for f in _FLAVOR_FLAGS[flavor] if f.startswith("-fsanitize")]
    _run([compiler(), *(["-shared"] if shared else []), *sanitizer, "-o", str(tmp),
          *map(str, objects), "-lpthread"])

  return file_lock.produce(out, link)


def library(flavor: str = "plain") -> Path:
  """The kernels, the CUDA handlers and the runtime as one shared library."""
  units = [(s, flavor, "kernel") for s in kernel_sources()]
  units += [(s, "plain", "handler") for s in handler_sources()]
  units += [(HARNESS / "runtime.cc", flavor, "runtime"), (HARNESS / "tma_emulation.cc", flavor, "runtime"),
            (HARNESS / "wgmma_emulation.cc", flavor, "runtime"),
            (HARNESS / "exports.cc", flavor, "runtime")]
  return _link(f"libjaxops_cuda_harness.{flavor}.so", _compile_all(units), flavor, shared=True)


def executable(driver: Path, flavor: str, with_kernels: bool) -> Path:
  """`driver` (a main) with the runtime, and the cuda/ kernels when asked."""
  units = [(driver, flavor, "driver"), (HARNESS / "runtime.cc", flavor, "runtime"),
           (HARNESS / "tma_emulation.cc", flavor, "runtime"),
           (HARNESS / "wgmma_emulation.cc", flavor, "runtime")]
  if with_kernels:
    units += [(s, flavor, "kernel") for s in kernel_sources()]
  return _link(f"{driver.stem}.{flavor}", _compile_all(units), flavor, shared=False)
