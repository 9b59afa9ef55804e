"""The wgmma layouts of cuda/wgmma.cuh against CUTLASS's CuTe, an oracle
written independently of this project's reading of the PTX ISA.

tests/cuda_harness/cute_layout_oracle.cc, compiled by the host g++ against the
CuTe headers of the nvidia-cutlass wheel (a test dependency; nothing of it is
vendored), prints from CuTe's own definitions the accumulator and register-A
fragments of the SM90 GMMA atoms, GmmaDescriptor encodings, Swizzle<b, 4, 3>
offsets and, for canonical tiles of every swizzle mode and both majors (16-bit
and TF32), the descriptor make_gmma_desc derives and every element's address
through CuTe's swizzled pointer. tests/cuda_harness/wgmma_layout_check.cc reads
those records and checks each against wgmma.cuh's functions, which the kernels
and the harness emulation (test_cuda_harness_wgmma.py) both use. Skipped where
the wheel or the CUDA headers CuTe's configuration includes are missing.
"""

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cuda_harness import build
from support import file_lock


def _cute_include() -> Path:
  spec = importlib.util.find_spec("cutlass_library")
  if spec is None or spec.origin is None:
    pytest.skip("no nvidia-cutlass wheel (pip install nvidia-cutlass): no CuTe oracle")
  include = Path(spec.origin).parent / "source" / "include"
  if not (include / "cute" / "tensor.hpp").is_file():
    pytest.skip(f"the nvidia-cutlass wheel has no CuTe headers under {include}")
  return include


def _cuda_includes() -> list[Path]:
  """The CUDA toolkit's include directories CuTe's headers need (cuda_runtime_api.h,
  and libcu++'s cuda/std, under cccl/ since CUDA 13)."""
  roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
  nvcc = shutil.which("nvcc")
  if nvcc:
    roots.append(str(Path(os.path.realpath(nvcc)).parents[1]))
  roots += ["/usr/local/cuda", *map(str, sorted(Path("/usr/local").glob("cuda-*")))]
  for root in filter(None, roots):
    include = Path(root) / "include"
    if not (include / "cuda_runtime_api.h").is_file():
      continue
    for std in (include, include / "cccl"):
      if (std / "cuda" / "std" / "utility").is_file():
        return [include] + ([std] if std != include else [])
  pytest.skip("no CUDA toolkit headers (cuda_runtime_api.h, cuda/std): CuTe does not compile")


def _compiled(source: str, name: str, flags: list[str]) -> Path:
  def make(tmp: Path) -> None:
    command = [build.compiler(), "-std=c++17", *flags, str(build.HARNESS / source),
               "-o", str(tmp)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-6000:]}"

  return file_lock.produce(build._build_dir() / name, make)


@pytest.fixture(scope="module")
def oracle_records() -> str:
  try:
    build.compiler()
  except build.HarnessUnavailable as e:
    pytest.skip(str(e))
  include = _cute_include()
  version = importlib.metadata.version("nvidia-cutlass")
  includes = [f"-I{include}", *(f"-I{p}" for p in _cuda_includes())]
  # -O0: CuTe's templates are most of the compile time, and the oracle runs once.
  oracle = _compiled("cute_layout_oracle.cc", f"cute_layout_oracle.{version}", ["-O0", *includes])
  result = subprocess.run([str(oracle)], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return result.stdout


@pytest.fixture(scope="module")
def checker() -> Path:
  return _compiled("wgmma_layout_check.cc", "wgmma_layout_check",
                   ["-O1", f"-I{build.INCLUDE}", f"-I{build.REPO}", "-include", "cuda_on_cpu.h",
                    "-x", "c++"])


def test_wgmma_layouts_agree_with_cute(oracle_records, checker):
  result = subprocess.run([str(checker)], input=oracle_records, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  counts = {line.split()[1]: int(line.split()[2]) for line in result.stdout.splitlines()
            if line.startswith("checked ")}
  # Every record the oracle printed was checked: the accumulators of N = 8, 64,
  # 96, 256 (128 threads x N / 2 values), both register-A layouts, 12
  # descriptors, 3 x 2048 swizzled offsets and 12 canonical tiles.
  expected = {kind: sum(line.startswith(kind + " ") for line in oracle_records.splitlines())
              for kind in ("acc", "rega16", "regatf32", "desc", "swz", "canon")}
  assert counts == expected
  assert expected["acc"] == 128 * (8 + 64 + 96 + 256) // 2
  assert expected["rega16"] == 128 * 8 and expected["regatf32"] == 128 * 4
  assert expected["canon"] == 8 * 128 * 16 + 4 * 64 * 8


def test_the_checker_sees_a_wrong_record(oracle_records, checker):
  """A record the layer disagrees with must fail the check (the oracle is read)."""
  lines = oracle_records.splitlines()
  index = next(i for i, line in enumerate(lines) if line.startswith("canon mn 1 "))
  fields = lines[index].split()
  fields[-1] = str(int(fields[-1]) + 16)
  lines[index] = " ".join(fields)
  result = subprocess.run([str(checker)], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 3
  assert "mismatch: canon mn 1" in result.stdout
