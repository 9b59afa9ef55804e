"""The harness's emulation of the sparse tensor-core instruction (mma.sp
m16n8k32 .f16/.bf16, tests/cuda_harness/include/sparse_mma_emulation.h) at the
level of one tile, and the metadata conversion of cuda/sparse_mma.cuh.

tests/cuda_harness/sparse_mma_cases.cc fills one warp's registers from a 2:4
sparse A, B and C by the PTX ISA's per-lane formulas and checks D against the
dense product; the lanes the sparsity selector leaves out pass invalid
metadata. The kernel that uses the instruction is tested in test_sparse.py and
test_cuda_harness_sparse_sanitizers.py.
"""

import pytest

from support.sanitizers import LAUNCH_FAILED, RIGHT, executable, run


@pytest.fixture(scope="module")
def cases():
  return executable("sparse_mma_cases.cc", "plain")


@pytest.mark.parametrize("case", ["f16", "bf16", "selector1", "canonical"])
def test_emulated_tile_matches_the_dense_product(cases, case):
  result = run(cases, case)
  assert result.returncode == RIGHT, result.stderr


def test_metadata_the_hardware_leaves_undefined_fails_the_launch(cases):
  result = run(cases, "descending_metadata")
  assert result.returncode == LAUNCH_FAILED, result.stderr
  assert "metadata nibble 1 of row 5, chunk 6 (lane 21) is not two ascending indices" in result.stderr
