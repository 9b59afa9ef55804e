"""The sm_90a FlashAttention-3 forward (cuda/attention_forward_sm90.cu, hopper_fwd)
run by the CPU harness, with wgmma, TMA and mbarriers emulated and their
hazards checked (an accumulator read before the wait_group covering its
product, a product without a fence, a TMA destination read before its phase
completed, a deadlock), and once each under AddressSanitizer and
ThreadSanitizer.

tests/cuda_harness/attention_sm90_driver.cc compares every output element and
logsumexp with a double reference, in bfloat16 and float16, on small odd
shapes: T and S not multiples of the 128-row / 128-key tiles, GQA, head dims
padded to 64 (40, 64) and to 128 (72, 120, 128), sequence lengths with NaN
past them (keys masked, values zeroed, rows 0 and -inf), causal with
query_offset, a sliding window, and the soft cap with segment ids; it counts
the emulated wgmma products against the key tiles the CTAs' rows can see, and
checks that hopper_fwd_supports refuses what the kernel does not do (float32,
mask, bias, H != Hv, H > 128, H not a multiple of 8). The SASS of the nvcc
build is gated in test_wgmma_sass.py.
"""

from support.background import prestart
from support.sanitizers import RIGHT, check_driver, driver_job, executable, run

DRIVER = "attention_sm90_driver.cc"
# Several key tiles through both stages of the ring (300, 290, 260 keys), two
# row blocks (130, 140, 200 rows), one tile and a partial CTA (5 x 9).
SHAPES = ["2x5x9x4x2x40c", "1x130x300x2x1x64c", "1x200x150x2x2x128", "2x70x260x4x2x120cw",
          "1x140x270x1x1x72f", "2x33x290x2x1x64cof"]
ASAN_SHAPES = ["2x5x9x4x2x40c", "1x140x200x2x1x128cwf"]
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=3)
# Under TSan: three key tiles through both stages, and a window, so that the
# first tile's values before it are zeroed by both consumer warpgroups (a
# missing named barrier there, or a stage refilled before its empty barrier,
# is a race).
TSAN = driver_job(DRIVER, "tsan", "1x130x300x2x1x64cw")


def test_hopper_forward_matches_reference():
  driver = executable(DRIVER, "plain", with_kernels=True)
  result = run(driver, *SHAPES)
  assert result.returncode == RIGHT, result.stdout + result.stderr
  assert result.stdout.count("wgmma products") == 2 * len(SHAPES), result.stdout


def test_hopper_forward_in_random_thread_and_landing_order():
  driver = executable(DRIVER, "plain", with_kernels=True)
  for seed, shape in ((1, "2x70x260x4x2x120cw"), (2, "1x140x270x1x1x72f")):
    result = run(driver, shape, seed=seed)
    assert result.returncode == RIGHT, (seed, shape, result.stdout + result.stderr)


@prestart(ASAN)
def test_hopper_forward_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_hopper_forward_under_thread_sanitizer():
  check_driver(TSAN)
