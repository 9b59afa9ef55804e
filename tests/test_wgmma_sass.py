"""The nvcc gate of the wgmma layer (cuda/wgmma.cuh): its PTX assembles for
sm_90a, into tensor-core warpgroup products, with no local memory.

tests/cuda_sm90a/wgmma_probe.cu holds small kernels in the FlashAttention-3
consumer's pattern (SS products with 128B-swizzled K-major descriptors, P kept in
registers as the RS A operand against an MN-major V, TF32 SS and RS, f16 with
both operands MN-major) for every N the layer spells (8 to 256). Compiled with
`nvcc -arch=sm_90a -cubin`, each kernel's SASS (cuobjdump -sass) must hold
HGMMA of its shapes, no STL/LDL, and ptxas (-v) must report no spills, no
serialized wgmma and no warpgroup.arrive it had to inject;
compiled for sm_80 and sm_90 the same source must build, with no HGMMA (the
instructions become traps there). Skipped without nvcc, or without
cuobjdump/nvdisasm (the toolkit's or PyPI's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, as in test_cuda_sass.py).
"""

import collections
import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "cuda_sm90a" / "wgmma_probe.cu"


def _tool(name: str, package: str) -> str:
  found = shutil.which(name)
  if found:
    return found
  for path in sorted(Path("/usr/local").glob(f"cuda*/bin/{name}")):
    return str(path)
  try:
    for f in importlib.metadata.files(package) or []:
      if f.name == name:
        return str(f.locate())
  except importlib.metadata.PackageNotFoundError:
    pass
  pytest.skip(f"no {name} (CUDA toolkit or pip {package})")


def _cubin(source: Path, arch: str, tmp_path: Path, *flags: str) -> tuple[Path, str]:
  """(cubin of ``source`` for ``arch``, ptxas' report): nvcc with ``flags``."""
  nvcc = shutil.which("nvcc")
  if nvcc is None:
    pytest.skip("no nvcc")
  cubin = tmp_path / f"{source.stem}.{arch}.cubin"
  result = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "-cubin", f"-I{REPO}", *flags,
                           "-o", str(cubin), str(source)], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  return cubin, result.stderr


def _compile(arch: str, tmp_path: Path) -> tuple[Path, str]:
  return _cubin(PROBE, arch, tmp_path, "-Xptxas", "-v")


def _sass(cubin: Path) -> dict[str, collections.Counter]:
  """Kernel (mangled name) -> opcode counts."""
  cuobjdump = _tool("cuobjdump", "nvidia-cuda-cuobjdump")
  nvdisasm = _tool("nvdisasm", "nvidia-cuda-nvdisasm")
  env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
  text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                        check=True, env=env).stdout
  kernels: dict[str, collections.Counter] = {}
  current = None
  for line in text.splitlines():
    header = re.match(r"\s*Function : (\S+)", line)
    if header:
      current = kernels.setdefault(header.group(1), collections.Counter())
      continue
    op = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)
    if op and current is not None:
      current[op.group(1)] += 1
  return kernels


def _count(counts: collections.Counter, prefix: str) -> int:
  return sum(n for op, n in counts.items() if op == prefix or op.startswith(prefix + "."))


def test_wgmma_layer_assembles_to_warpgroup_products_on_sm90a(tmp_path):
  cubin, log = _compile("sm_90a", tmp_path)
  # ptxas neither serialized products nor had to insert warpgroup.arrive (both
  # the signs of registers touched between a product and its fence), nor spilled.
  assert "Performance Loss" not in log and "injected" not in log, log
  assert re.findall(r"(\d+) bytes spill stores", log) and all(
      n == "0" for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)), log
  kernels = _sass(cubin)
  assert len(kernels) == 11, sorted(kernels)
  for name, counts in kernels.items():
    shapes = {op for op in counts if op.startswith("HGMMA.")}
    n = int(re.search(r"ILi(\d+)E", name).group(1))
    assert _count(counts, "HGMMA") > 0, (name, counts)
    assert counts["STL"] == 0 and counts["LDL"] == 0, (name, counts)
    # The kernel's own N is among its products' shapes (P V also uses N = 64).
    assert any(op.startswith(f"HGMMA.64x{n}x") for op in shapes), (name, shapes)
    if "tf32" in name:
      assert all(op.endswith(".TF32") for op in shapes), (name, shapes)
    if "bf16" in name:
      assert all(op.endswith(".BF16") for op in shapes), (name, shapes)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_wgmma_layer_compiles_to_traps_elsewhere(tmp_path, arch):
  cubin, _ = _compile(arch, tmp_path)
  kernels = _sass(cubin)
  assert len(kernels) == 11
  for name, counts in kernels.items():
    assert _count(counts, "HGMMA") == 0, (name, counts)
    assert counts["BPT.TRAP"] > 0, (name, counts)


# -- the FlashAttention-3 forward (cuda/attention_forward_sm90.cu) --------------------------------

HOPPER_FWD = REPO / "cuda" / "attention_forward_sm90.cu"


def _compile_hopper_fwd(arch: str, tmp_path: Path) -> tuple[Path, str]:
  """The kernel file as the CMake build compiles it: ptxas spills and local
  memory are errors (cmake/cuda.cmake's -Xptxas flags), -v for the report."""
  return _cubin(HOPPER_FWD, arch, tmp_path, "-O3", "-Xptxas=-v,-warn-spills,-warn-lmem-usage,-Werror")


@pytest.fixture(scope="module")
def hopper_fwd_sm90a(tmp_path_factory):
  return _compile_hopper_fwd("sm_90a", tmp_path_factory.mktemp("hopper_fwd"))


def test_hopper_forward_assembles_to_tma_fed_warpgroup_products(hopper_fwd_sm90a):
  cubin, log = hopper_fwd_sm90a
  assert "Performance Loss" not in log and "injected" not in log, log
  spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
  assert spills and all(n == "0" for n in spills), log
  kernels = _sass(cubin)
  # bf16 and f16, head dims 64 and 128.
  assert len(kernels) == 4, sorted(kernels)
  for name, counts in kernels.items():
    hd = int(re.search(r"Li(\d+)EEEv", name).group(1))
    shapes = {op for op in counts if op.startswith("HGMMA.")}
    # S = Q K^T: m64n128k16 (kBlockN keys); O += P V: m64n<hd>k16.
    assert any(op.startswith("HGMMA.64x128x16") for op in shapes), (name, shapes)
    assert any(op.startswith(f"HGMMA.64x{hd}x16") for op in shapes), (name, shapes)
    # cuobjdump spells bf16 products ".F32.BF16" and f16 ones ".F32".
    if "bfloat16" in name:
      assert all(op.endswith(".F32.BF16") for op in shapes), (name, shapes)
    else:
      assert all(op.endswith(".F32") for op in shapes), (name, shapes)
    assert _count(counts, "UTMALDG") >= 3, (name, counts)  # Q, K, V boxes
    assert _count(counts, "SYNCS") >= 6, (name, counts)    # mbarrier init, arrive, try_wait
    assert _count(counts, "USETMAXREG") >= 2, (name, counts)
    assert counts["STL"] == 0 and counts["LDL"] == 0, (name, counts)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_hopper_forward_compiles_to_traps_elsewhere(tmp_path, arch):
  cubin, _ = _compile_hopper_fwd(arch, tmp_path)
  kernels = _sass(cubin)
  assert len(kernels) == 4
  for name, counts in kernels.items():
    assert _count(counts, "HGMMA") == 0 and _count(counts, "UTMALDG") == 0, (name, counts)
    assert counts["BPT.TRAP"] > 0, (name, counts)
