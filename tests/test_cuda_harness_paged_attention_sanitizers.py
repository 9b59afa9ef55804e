"""The CUDA decode kernels (cuda/kv_decode.cuh) of paged attention and of
jaxops.attention's decode path under AddressSanitizer and ThreadSanitizer, run
by the CPU harness (see test_cuda_harness_checks.py for the harness's own
checks).

tests/cuda_harness/paged_attention_driver.cc runs attention over the pages
(the decode kernels of cuda/kv_decode.cuh: unsplit, split-K with three splits
and the default plan, with and without a logsumexp; the MLA kernel for value
pages of a head dim of their own and for values in the key rows) and
paged_kv_update (padding slots, a slot named twice, the int8 quantization rule
bit for bit, rows with NaN and infinities included; keys only where the
values are in them) for every (query, page) type pair:
float32, bfloat16 and float16 pages, and int8 pages with scales under all
three query types, against a double-precision reference, on tiny shapes: page
sizes 1, 5 and 16, GQA and MQA, decode (T = 1) and chunked prefill (T > 1 with
query_lens, clamped where they exceed T or kv_len), kv_lens of 0, part of the
capacity, the capacity and beyond, page ids below 0 and past the last page, a
soft cap, a window, more query rows than one tile (several row tiles), key
splits merged (decode and a short chunk), and the launchers' rejections.
"""

from support.background import prestart
from support.sanitizers import check_driver, driver_job

# Capacities (page size x pages) above 64 keys give the "3 splits" runs three key
# splits (of 32 keys at least), so the merge kernel runs; with the window, most
# splits of a row are empty. Head dims 8 and 20 take the 16-byte loads of
# float32 rows, 7 and 33 element loads, 136 the wide tiles (8 rows, 8 output
# elements per lane). The MLA kernel (vHV: value head dim HV; k: the values in
# the key rows): absorbed MLA's 576/512 (16 rows, four warps of 128 columns),
# 192/128 with value pages of their own, an odd value width in the keys, element
# keys with element values, Hv = 0, Hv > H, equal dims above 256.
ASAN_SHAPES = ["3x1x4x2x8x16x6s", "2x3x2x1x7x1x70w", "4x3x8x1x20x16x2", "2x1x1x1x33x5x15ws",
               "1x1x4x2x136x4x2", "1x1x16x1x576x16x2v512k", "2x2x8x1x192x5x7v128",
               "3x1x4x2x40x5x4v17k", "2x2x4x2x33x5x3v20w", "1x1x4x1x24x16x3v0k",
               "2x3x4x2x32x5x3v48s", "1x2x8x1x320x4x3v320"]
TSAN_SHAPES = ["1x1x4x2x8x5x15s", "1x3x2x1x7x1x9w", "1x1x16x1x576x16x3v512k",
               "1x2x8x2x48x5x9v32"]
DRIVER = "paged_attention_driver.cc"
ASAN = driver_job(DRIVER, "asan", *ASAN_SHAPES, seed=7)
TSAN = driver_job(DRIVER, "tsan", *TSAN_SHAPES)


# (B, T, S, N, K, H): 300 keys split in two; element loads (head dim 17),
# kv lengths 97, 0 and 49 of 97; three tokens of a GQA group; head dim 136.
DECODE_ASAN_SHAPES = ["1x1x300x4x1x16cl", "3x1x97x6x2x17cwl", "2x3x40x4x2x64cl",
                      "1x1x20x8x1x136c"]
DECODE_TSAN_SHAPES = ["1x2x300x4x2x8cl"]
DECODE_DRIVER = "attention_decode_driver.cc"
DECODE_ASAN = driver_job(DECODE_DRIVER, "asan", *DECODE_ASAN_SHAPES, seed=3)
DECODE_TSAN = driver_job(DECODE_DRIVER, "tsan", *DECODE_TSAN_SHAPES)


@prestart(ASAN)
def test_paged_attention_under_address_sanitizer():
  check_driver(ASAN)


@prestart(TSAN)
def test_paged_attention_under_thread_sanitizer():
  check_driver(TSAN)


@prestart(DECODE_ASAN)
def test_attention_decode_under_address_sanitizer():
  check_driver(DECODE_ASAN)


@prestart(DECODE_TSAN)
def test_attention_decode_under_thread_sanitizer():
  check_driver(DECODE_TSAN)
