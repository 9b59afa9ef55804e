"""Pytest fixtures of the test files that run CUDA kernels in the harness.

Import both into a test module (``from cuda_harness.fixtures import harness,
kernels_ran``): every test of that module then runs with the primitives lowered
to the harness-built CUDA kernels, and fails if no kernel was launched.
"""

import pytest

import cuda_harness


@pytest.fixture(scope="module", autouse=True)
def harness():
  try:
    loaded = cuda_harness.load()
  except cuda_harness.build.HarnessUnavailable as e:
    pytest.skip(str(e))
  with cuda_harness.cuda_kernels_on_cpu(loaded):
    yield loaded


@pytest.fixture(autouse=True)
def kernels_ran(harness):
  before = harness.launches()
  yield
  assert harness.launches() > before, "no kernel ran in the harness"
