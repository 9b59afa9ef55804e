"""Static gates on the CUDA build's machine code, checked without a GPU.

A build with nvcc writes the SASS instruction summary of every kernel
(cmake/cuda_sass_summary.py, installed as jaxops/cuda_sass_summary.txt): the
tensor-core attention kernels (forward, backward, forward mode) must hold their
products on the tensor cores (HMMA), load their operands by ldmatrix (LDSM),
stream their tiles by cp.async (LDGSTS) and use no local memory, in every
instantiation and on every architecture built. Skipped where jaxops was built
without nvcc, or where no nvdisasm (which cuobjdump -sass runs) can be found:
the CUDA toolkit's, or PyPI's nvidia-cuda-nvdisasm, a build requirement.
"""

import importlib.metadata
import importlib.util
import pathlib
import shutil

import pytest

TENSOR_CORE_KERNELS = [
    ("attention_forward.cu", "attention_fwd_mma_kernel"),
    ("attention_backward.cu", "attention_bwd_dkdv_mma_kernel"),
    ("attention_backward.cu", "attention_bwd_dq_mma_kernel"),
    ("attention_jvp.cu", "attention_fwd_jvp_mma_kernel"),
]


def _nvdisasm_found() -> bool:
  """Whether the build could have found nvdisasm (cmake/cuda.cmake looks in the
  same places)."""
  if shutil.which("nvdisasm") or list(pathlib.Path("/usr/local").glob("cuda*/bin/nvdisasm")):
    return True
  try:
    files = importlib.metadata.files("nvidia-cuda-nvdisasm") or []
  except importlib.metadata.PackageNotFoundError:
    return False
  return any(f.name == "nvdisasm" for f in files)


def _summary() -> str:
  if importlib.util.find_spec("jaxops._jaxops_cuda") is None:
    pytest.skip("jaxops was built without nvcc: no CUDA kernels")
  spec = importlib.util.find_spec("jaxops")
  for location in spec.submodule_search_locations or []:
    path = pathlib.Path(location) / "cuda_sass_summary.txt"
    if path.is_file():
      return path.read_text()
  if not _nvdisasm_found():
    pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm, then rebuild): no SASS summary")
  pytest.fail("nvdisasm is installed but the CUDA build wrote no cuda_sass_summary.txt "
              "(rebuild jaxops)")


def _rows(text: str) -> dict[tuple[str, str], dict[str, int]]:
  """(source: kernel, arch) -> {instruction: fewest over the instantiations}."""
  lines = text.splitlines()
  header = lines[1].split()
  rows = {}
  for line in lines[3:]:
    fields = line.split()
    if len(fields) != len(header) + 1:  # "source:" and "kernel" are two fields
      continue
    name, arch, counts = f"{fields[0]} {fields[1]}", fields[2], fields[4:]
    rows[(name, arch)] = {op: int(c.split("-")[0]) for op, c in zip(header[3:], counts)}
  return rows


@pytest.mark.parametrize("source,kernel", TENSOR_CORE_KERNELS, ids=lambda v: v)
def test_tensor_core_attention_kernels_take_the_tensor_cores(source, kernel):
  rows = _rows(_summary())
  # The FA2 kernels are on every generic architecture built; an sm_90a cubin
  # (JAXOPS_CUDA_SM90A=ON) holds the FlashAttention-3 kernels only.
  architectures = {arch for _, arch in rows if not arch.endswith("a")}
  found = {arch: counts for (name, arch), counts in rows.items()
           if name == f"{source}: {kernel}" and not arch.endswith("a")}
  assert set(found) == architectures, f"{kernel} on {sorted(found)} of {sorted(architectures)}"
  for arch, counts in found.items():
    assert counts["HMMA"] > 0, (arch, counts)
    assert counts["LDSM"] > 0, (arch, counts)
    assert counts["LDGSTS"] > 0, (arch, counts)
    assert counts["LDL"] == 0 and counts["STL"] == 0, (arch, counts)
