"""The harness's emulation of the sm_90a warpgroup products of cuda/wgmma.cuh
(wgmma.mma_async SS and RS, bf16/f16/tf32, fence/commit/wait;
tests/cuda_harness/include/wgmma_emulation.h) against their definitions, and the
hazards it keeps.

tests/cuda_harness/wgmma_cases.cc lays A and B out in shared memory in each
swizzle mode by its own reading of the layouts, runs one warpgroup's products
stepping the descriptors along K, and checks every element of D against the
product in double; under ThreadSanitizer a barrier missing before a product is
a race. The fragment layouts, descriptor fields and swizzle are
checked against CUTLASS's CuTe in test_cute_oracle.py; the PTX itself by nvcc in
test_wgmma_sass.py.
"""

import pytest

from support.sanitizers import LAUNCH_FAILED, RIGHT, executable, run

PRODUCTS = [
    # (type, ss|rs, N, swizzle, B major): every swizzle, both B majors, both A
    # sources and every N of the attention kernels, without the full product.
    *[("bf16", "ss", n, "128", "k") for n in (64, 96, 128, 192, 256)],
    *[("bf16", "rs", n, "128", "mn") for n in (64, 128, 256)],
    *[("bf16", mode, 64, s, major) for mode in ("ss", "rs") for s in ("none", "32", "64")
      for major in ("k", "mn")],
    ("f16", "ss", 128, "128", "mn"), ("f16", "rs", 96, "64", "k"), ("f16", "ss", 16, "none", "mn"),
    ("f16", "rs", 8, "32", "mn"),
    ("tf32", "ss", 64, "128", "k"), ("tf32", "ss", 256, "none", "k"), ("tf32", "rs", 128, "64", "k"),
    ("tf32", "rs", 16, "32", "k"),
]


@pytest.fixture(scope="module")
def cases():
  return executable("wgmma_cases.cc", "plain")


@pytest.mark.parametrize("with_c", ["c", "noc"])
@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: "-".join(map(str, p)))
def test_emulated_product_matches_its_definition(cases, product, with_c):
  kind, mode, n, swizzle, major = product
  result = run(cases, "product", kind, mode, str(n), swizzle, major, with_c)
  assert result.returncode == RIGHT, result.stderr


@pytest.mark.parametrize("case", ["hand_swizzled_ss", "hand_swizzled_rs"])
def test_tiles_a_kernel_swizzles_by_hand_multiply_right(cases, case):
  """Q-like A and V-like B written through swizzled_offset by the kernel itself
  (128B rows, V MN-major in blocks of 64 columns), stepped along K."""
  result = run(cases, case)
  assert result.returncode == RIGHT, result.stderr


def test_a_right_sequence_of_products_runs(cases):
  """Two warpgroups: chained products without a fence between them, a wait, a
  read, a fence, another product."""
  result = run(cases, "right_sequence")
  assert result.returncode == RIGHT, result.stderr


HAZARDS = {
    "read_before_wait": ["wgmma accumulator", "still pending", "its commit group 0 is not covered"],
    "never_committed": ["still pending", "never committed"],
    "wait_group_counts": ["its commit group 1 is not covered", "(1 of 2 groups waited for)"],
    "missing_warp": ["deadlock", "96 of the 128 threads of warpgroup 0 arrived at "
                     "wgmma.mma_async.k16.bf16 (SS); missing: warp 3"],
    "no_fence": ["with no wgmma.fence before it"],
    "access_after_fence": ["accessed after its last wgmma.fence"],
    "partial_warpgroup": ["a block of 96 threads: a warpgroup is 4 whole warps"],
    "descriptor_out_of_bounds": ["outside the block's dynamic shared memory"],
    "divergent_descriptors": ["thread 5 of the warpgroup gives other descriptors"],
}


@pytest.mark.parametrize("case", sorted(HAZARDS))
def test_a_misused_product_fails_the_launch(cases, case):
  result = run(cases, case)
  assert result.returncode == LAUNCH_FAILED, result.stderr
  for text in HAZARDS[case]:
    assert text in result.stderr


@pytest.fixture(scope="module")
def tsan_cases():
  return executable("wgmma_cases.cc", "tsan")


@pytest.mark.parametrize("mode", ["fibers", "threads"])
def test_thread_sanitizer_sees_a_missing_barrier_before_a_product(tsan_cases, mode):
  """Each thread reads its share of the operands outside the runtime's lock, so
  a barrier missing between the threads' shared-memory writes and the product is
  a race ThreadSanitizer reports; right kernels report none."""
  result = run(tsan_cases, "missing_barrier", JAXOPS_HARNESS_MODE=mode)
  assert "ThreadSanitizer: data race" in result.stderr, result.stderr
  assert "hazard_kernel" in result.stderr
  for case in (["hand_swizzled_rs"], ["product", "bf16", "ss", "64", "128", "mn", "c"]):
    result = run(tsan_cases, *case, JAXOPS_HARNESS_MODE=mode)
    assert result.returncode == RIGHT, result.stderr
    assert "ThreadSanitizer" not in result.stderr
