"""The harness's emulation of the sm_80 instructions of cuda/mma.cuh (mma.sync
m16n8k16 bf16/f16 and m16n8k8 tf32, ldmatrix, cp.async;
tests/cuda_harness/include/mma_emulation.h) against their PTX ISA
definitions, and the hazards it keeps.

tests/cuda_harness/mma_cases.cc fills one warp's registers by the ISA's per-lane
formulas and checks every element of the result; the attention kernels that use
the instructions are tested in test_attention.py, test_matmul_precision_kernels.py
and test_cuda_harness_attention_sanitizers.py.
"""

import pytest

from support.sanitizers import LAUNCH_FAILED, RIGHT, executable, run


@pytest.fixture(scope="module")
def cases():
  return executable("mma_cases.cc", "plain")


@pytest.mark.parametrize("case", ["mma_f16", "mma_bf16", "mma_tf32", "ldmatrix", "ldmatrix_mma",
                                  "cp_async"])
def test_emulated_instruction_matches_its_definition(cases, case):
  result = run(cases, case)
  assert result.returncode == RIGHT, result.stderr


def test_reading_a_pending_cp_async_destination_fails_the_launch(cases):
  result = run(cases, "cp_async_read_before_wait")
  assert result.returncode == LAUNCH_FAILED, result.stderr
  assert "ldmatrix.m8n8" in result.stderr
  assert "the destination of a cp.async of thread (0,0,0)" in result.stderr
  assert "no cp.async.wait_group has covered yet" in result.stderr


def test_a_lane_missing_from_mma_sync_fails_the_launch(cases):
  result = run(cases, "mma_missing_lane")
  assert result.returncode == LAUNCH_FAILED, result.stderr
  assert "mma.sync.m16n8k16.f16" in result.stderr
