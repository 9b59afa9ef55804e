"""The harness's emulation of the sm_90 asynchronous-copy and synchronisation
layer (cuda/tma.cuh: mbarrier, TMA loads/stores/reductions, named barriers,
setmaxnreg, fence.proxy.async; tests/cuda_harness/include/tma_emulation.h)
against the PTX ISA's definitions, the hazards it keeps, and a warp-specialised
pipeline (tests/cuda_harness/tma_pipeline.cuh: a TMA producer warpgroup, two
consumer warpgroups on full/empty mbarrier rings) under the sanitizers and
several scheduling seeds; and the SASS of that pipeline from nvcc for sm_90a.

tests/cuda_harness/tma_cases.cc checks every byte of each TMA box against the
swizzle table and the tensor, every try_wait answer against the ISA's, and
every element of the pipeline's product against a double product on the host.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from support.sanitizers import LAUNCH_FAILED, RIGHT, executable, run

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases():
  return executable("tma_cases.cc", "plain")


@pytest.mark.parametrize("case", ["load", "store", "reduce_add", "mbarrier_phases",
                                  "encode_validation", "swizzle_agreement"])
def test_emulated_instruction_matches_its_definition(cases, case):
  result = run(cases, case)
  assert result.returncode == RIGHT, result.stderr


@pytest.mark.parametrize("seed", [1, 2])
def test_loads_and_stores_land_right_in_any_order(cases, seed):
  for case in ("load", "store", "reduce_add"):
    result = run(cases, case, seed=seed)
    assert result.returncode == RIGHT, (case, result.stderr)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_warp_specialised_pipeline(cases, seed):
  result = run(cases, "pipeline", seed=seed)
  assert result.returncode == RIGHT, result.stderr


def test_warp_specialised_pipeline_on_os_threads(cases):
  result = run(cases, "pipeline", seed=1, JAXOPS_HARNESS_MODE="threads")
  assert result.returncode == RIGHT, result.stderr


@pytest.mark.parametrize("flavor,seed", [("asan", 0), ("asan", 3), ("tsan", 0), ("tsan", 2)])
def test_warp_specialised_pipeline_under_sanitizers(flavor, seed):
  result = run(executable("tma_cases.cc", flavor), "pipeline", seed=seed)
  assert result.returncode == RIGHT, result.stderr
  tool = {"asan": "AddressSanitizer", "tsan": "ThreadSanitizer"}[flavor]
  assert tool not in result.stderr


HAZARDS = {
    "read_before_complete": ["a read of a TMA destination", "whose mbarrier phase has not completed",
                             "0 of 1 arrivals and 512 transaction bytes pending"],
    "expect_tx_mismatch": ["deadlock", "mbarrier.try_wait.parity",
                           "0 of 1 arrivals and 16 transaction bytes pending"],
    "named_count_mismatch": ["bar.sync", "barrier 1 with 64 threads", "arrived at it with 128"],
    "named_partial_warp": ["bar.sync", "whole warps arrive", "only lanes 0xffff"],
    "setmaxnreg_partial_warpgroup": ["deadlock", "setmaxnreg.dec.sync.aligned",
                                     "96 of its 128 threads arrived"],
    "setmaxnreg_overcommit": ["setmaxnreg.inc.sync.aligned", "92160 registers",
                              "more than the SM's 65536"],
    "store_without_fence": ["cp.async.bulk.tensor (store)", "no fence.proxy.async"],
    "store_not_waited": ["exited with 1 bulk async-group(s)", "cp.async.bulk.wait_group"],
}


@pytest.mark.parametrize("case", sorted(HAZARDS))
def test_misuse_fails_the_launch(cases, case):
  result = run(cases, case)
  assert result.returncode == LAUNCH_FAILED, result.stderr
  for part in HAZARDS[case]:
    assert part in result.stderr, (part, result.stderr)


# -- the SASS gate: the pipeline kernel compiled by nvcc for sm_90a -------------------------------


def _cuda_tool(name: str):
  """`name` from PATH, the CUDA toolkit, or PyPI's nvidia-cuda-* wheels (as cmake/cuda.cmake)."""
  found = shutil.which(name) or next(iter(sorted(pathlib.Path("/usr/local").glob(f"cuda*/bin/{name}"))), None)
  if found:
    return str(found)
  for root in map(pathlib.Path, sys.path):
    for candidate in sorted(root.glob(f"nvidia/*/bin/{name}")):
      return str(candidate)
  return None


@pytest.fixture(scope="module")
def pipeline_sass(tmp_path_factory):
  nvcc, cuobjdump, nvdisasm = _cuda_tool("nvcc"), _cuda_tool("cuobjdump"), _cuda_tool("nvdisasm")
  if nvcc is None or cuobjdump is None or nvdisasm is None:
    pytest.skip("needs nvcc, cuobjdump and nvdisasm (CUDA toolkit or nvidia-cuda-* wheels)")
  out = tmp_path_factory.mktemp("tma_sass")
  cubin = out / "tma_pipeline.cubin"
  compiled = subprocess.run(
      [nvcc, "-arch=sm_90a", "-cubin", "-std=c++17", f"-I{REPO}", "-Xptxas", "-v", "-o", str(cubin),
       str(REPO / "tests" / "cuda_harness" / "tma_pipeline_probe.cu")],
      capture_output=True, text=True)
  assert compiled.returncode == 0, compiled.stderr
  env = {**os.environ, "PATH": f"{pathlib.Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
  sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
  assert sass.returncode == 0, sass.stderr
  return compiled.stderr, sass.stdout


def _opcodes(sass: str) -> dict[str, int]:
  counts: dict[str, int] = {}
  for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass):
    counts[op] = counts.get(op, 0) + 1
  return counts


def test_pipeline_sass_holds_tma_and_mbarrier_instructions(pipeline_sass):
  ptxas, sass = pipeline_sass
  ops = _opcodes(sass)
  def count(prefix):
    return sum(n for op, n in ops.items() if op.startswith(prefix))
  assert count("UTMALDG") >= 2, ops    # the producer's two TMA loads per stage
  assert count("UTMASTG") >= 1, ops    # the epilogue's TMA store
  assert count("SYNCS") >= 4, ops      # mbarrier init, arrive, try_wait
  assert count("USETMAXREG") >= 2, ops  # setmaxnreg.dec and .inc
  assert count("LDS") > 0, ops         # the consumers read shared memory as shared, not generic
  assert count("LDL") == 0 and count("STL") == 0, ops
  assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
