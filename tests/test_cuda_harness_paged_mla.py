"""The CUDA paged attention's MLA layouts, run in the CPU harness: value pages
with a head dim Hv of their own (MLA's 192/128) and no value pages at all, the
values being the first Hv features of each key row (absorbed MLA decode,
DeepSeek's 576/512: one cache read once for both products; int8 rows scaled
by the key scale for both).

The CUDA handler's targets (xla_ffi/cuda/paged_attention.cc) are called
directly (jaxops_harness_paged_attention_fwd, jaxops_harness_paged_kv_update)
with the workspace that the plan of params/paged_attention_plan.h sizes
(written out below, so these tests do not depend on the installed module) and
compared with a float64 NumPy reference written here: a dense gather of the
pages through the block tables with the clamping of params/paged_attention.h,
the masks, the softmax, and P V over the value rows (the first Hv features of
the key rows when the values are in the keys). Shapes: 576/512 with the
values in the keys and 192/128 with value pages of their own, float32,
bfloat16 and int8 pages (under float32 and bfloat16 queries); GQA; ragged
kv_lens (0, partial, full, beyond the capacity) and page ids outside the pool;
split-K over a long batch-1 sequence (the MLA kernel and its merge both
launched); chunked prefill in several row tiles; element rows (odd head dims)
for keys and for values; Hv above H and Hv = 0; a window and a soft cap; free
slots holding NaN, never read. Values in the keys match, bit for bit, value
pages holding copies of the keys' first Hv features.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_harness
from jaxops._src import ffi_targets
from support import backends

F32, BF16, INT8 = np.float32, jnp.bfloat16, np.int8
ATTENTION = cuda_harness.harness_target("jaxops_paged_attention_fwd")
UPDATE = cuda_harness.harness_target("jaxops_paged_kv_update")
NONE_F32, NONE_I32 = np.zeros((0,), F32), np.zeros((0,), np.int32)


# -- the plan of params/decode_plan.h and paged_attention_plan.h, written out --------------


def _ceil(a, b):
  return -(-a // b)


def plan(batch, q_len, heads, kv_heads, head_dim, value_head_dim, capacity):
  """(rows_per_tile, row_tiles, splits) of the CUDA launcher handed a workspace:
  tiles of 16 rows in the MLA kernel (Hv != H, or H above 256), of 16 or 8
  (H above 128) in the decode kernel; splits of 256 keys at least, at most 128
  of them, and no more than make 4 * 132 blocks."""
  mla = value_head_dim != head_dim or head_dim > 256
  most = 16 if mla or head_dim <= 128 else 8
  rows = q_len * (heads // kv_heads)
  row_tiles = _ceil(rows, most)
  rows_per_tile = _ceil(rows, row_tiles)
  splits = min(_ceil(capacity, 256), 128, _ceil(4 * 132, batch * kv_heads * row_tiles))
  keys_per_split = _ceil(_ceil(capacity, splits), 32) * 32
  return rows_per_tile, row_tiles, _ceil(capacity, keys_per_split)


def workspace_bytes(batch, q_len, heads, kv_heads, head_dim, value_head_dim, capacity):
  """The split-K partials: Hv floats and a (max, sum) pair per row of each split."""
  rows_per_tile, row_tiles, splits = plan(batch, q_len, heads, kv_heads, head_dim,
                                          value_head_dim, capacity)
  if splits == 1:
    return 0
  return batch * kv_heads * row_tiles * splits * rows_per_tile * (value_head_dim + 2) * 4


# -- a cache and the float64 reference ----------------------------------------------------


class Cache:
  """Pages of `batch` sequences scattered over a shuffled pool, one spare page
  of NaN (never named by a table), kv_lens and tables that take every clamping
  branch; int8 pages with random per-row scales."""

  def __init__(self, seed, *, batch, q_len, heads, kv_heads, head_dim, value_head_dim, in_keys,
               page_dtype, query_dtype=None, page_size=16, max_pages=3, kv_lens=None,
               query_lens=None):
    rng = np.random.default_rng(seed)
    self.in_keys, self.page_size, self.max_pages = in_keys, page_size, max_pages
    self.head_dim, self.value_head_dim = head_dim, value_head_dim
    pool = batch * max_pages + 1
    # The spare page is neither the first nor the last (where clamped ids land).
    self.spare = pool // 2
    named = rng.permutation([i for i in range(pool) if i != self.spare])
    tables = named.reshape(batch, max_pages).astype(np.int32)
    if batch > 1:  # ids outside the pool, clamped to its first and last page
      tables[-1, -1] = -3
      tables[0, -1] = pool + 5
    self.tables = tables
    capacity = max_pages * page_size
    if kv_lens is None:
      kv_lens = rng.integers(max(1, q_len), capacity + 1, size=batch)
      if batch > 2:
        kv_lens[1], kv_lens[2] = 0, capacity + 9
    self.kv_lens = np.asarray(kv_lens, np.int32)
    self.query_lens = None if query_lens is None else np.asarray(query_lens, np.int32)
    query_dtype = query_dtype or (F32 if page_dtype == INT8 else page_dtype)
    self.query = np.asarray(jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim)),
                                        F32).astype(query_dtype))
    self.page_dtype = page_dtype

    def pages(width):
      shape = (pool, page_size, kv_heads, width)
      if page_dtype == INT8:
        values = rng.integers(-127, 128, shape).astype(INT8)
        scales = rng.uniform(0.004, 0.02, shape[:3]).astype(F32)
        scales[self.spare] = np.nan
        return values, scales
      values = np.array(jnp.asarray(rng.standard_normal(shape), F32).astype(page_dtype))
      values[self.spare] = np.nan
      return values, None

    self.key_pages, self.key_scales = pages(head_dim)
    if in_keys:
      self.value_pages, self.value_scales = None, None
    else:
      self.value_pages, self.value_scales = pages(value_head_dim)

  @property
  def shape(self):
    B, T, N, H = self.query.shape
    return B, T, N, self.key_pages.shape[2], H

  def operands(self):
    """The target's operands: value pages and value scales [0] when absent."""
    placeholder = np.zeros((0,), self.key_pages.dtype)
    return [self.query, self.key_pages,
            placeholder if self.value_pages is None else self.value_pages, self.tables,
            self.kv_lens, NONE_I32 if self.query_lens is None else self.query_lens,
            NONE_F32 if self.key_scales is None else self.key_scales,
            NONE_F32 if self.value_scales is None else self.value_scales]

  def copied_values(self):
    """The same cache with value pages (and scales) copying the keys' first Hv."""
    copy = Cache.__new__(Cache)
    copy.__dict__.update(self.__dict__)
    copy.in_keys = False
    copy.value_pages = np.ascontiguousarray(self.key_pages[..., :self.value_head_dim])
    copy.value_scales = self.key_scales
    return copy

  def reference(self, scale, soft_cap=0.0, window_left=-1):
    """out [B, T, N, Hv] and logsumexp [B, N, T], float64."""
    B, T, N, K, H = self.shape
    Hv, G = self.value_head_dim, N // K
    capacity = self.max_pages * self.page_size
    keys_f = self.key_pages.astype(np.float64)
    if self.key_scales is not None:
      keys_f = keys_f * self.key_scales[..., None]
    if self.in_keys:
      values_f = keys_f[..., :Hv]
    else:
      values_f = self.value_pages.astype(np.float64)
      if self.value_scales is not None:
        values_f = values_f * self.value_scales[..., None]
    pool = self.key_pages.shape[0]
    out = np.zeros((B, T, N, Hv))
    lse = np.full((B, N, T), -np.inf)
    q = self.query.astype(np.float64)
    for b in range(B):
      kv = int(np.clip(self.kv_lens[b], 0, capacity))
      qn = T if self.query_lens is None else int(self.query_lens[b])
      qn = max(0, min(qn, T, kv))
      j = np.arange(kv)
      pages = np.clip(self.tables[b, j // self.page_size], 0, pool - 1)
      keys, values = keys_f[pages, j % self.page_size], values_f[pages, j % self.page_size]
      for t in range(qn):
        position = kv - qn + t
        seen = (j <= position) & ((window_left < 0) | (j >= position - window_left))
        if not seen.any():
          continue
        for n in range(N):
          s = scale * (keys[seen, n // G] @ q[b, t, n])
          if soft_cap > 0:
            s = soft_cap * np.tanh(s / soft_cap)
          top = s.max()
          p = np.exp(s - top)
          out[b, t, n] = p @ values[seen, n // G] / p.sum()
          lse[b, n, t] = top + np.log(p.sum())
    return out, lse


def attend(cache, *, scale=None, soft_cap=0.0, window_left=-1, workspace=None):
  """The harness's CUDA paged attention: (out, logsumexp) as float64 arrays."""
  B, T, N, K, H = cache.shape
  Hv = cache.value_head_dim
  if workspace is None:
    workspace = workspace_bytes(B, T, N, K, H, Hv, cache.max_pages * cache.page_size)
  scale = 1 / math.sqrt(H) if scale is None else scale
  call = jax.ffi.ffi_call(ATTENTION, [jax.ShapeDtypeStruct((B, T, N, Hv), cache.query.dtype),
                                      jax.ShapeDtypeStruct((B, N, T), F32),
                                      jax.ShapeDtypeStruct((workspace,), np.uint8)])
  out, lse, _ = call(*cache.operands(), scale=F32(scale), logits_soft_cap=F32(soft_cap),
                     window_left=np.int64(window_left), value_head_dim=np.int64(Hv),
                     allow_tf32=np.bool_(False))
  return np.asarray(out.astype(F32), np.float64), np.asarray(lse, np.float64)


def check(cache, harness, *, launches=1, **options):
  """The harness's result against the reference; `launches` kernels ran."""
  before = harness.launches()
  out, lse = attend(cache, **options)
  assert harness.launches() - before == launches
  scale = options.pop("scale", None)
  ref_out, ref_lse = cache.reference(1 / math.sqrt(cache.head_dim) if scale is None else scale,
                                     **options)
  low = cache.query.dtype != np.float32
  # float32 accumulation over the head dims and the keys; a 16-bit output
  # rounds once (8 bits of bfloat16's mantissa).
  np.testing.assert_allclose(out, ref_out, atol=2e-2 if low else 2e-5, rtol=2e-2 if low else 1e-4)
  finite = np.isfinite(ref_lse)
  np.testing.assert_array_equal(np.isfinite(lse), finite)
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
  return out, lse


PAGE_TYPES = [(F32, None), (BF16, None), (INT8, F32), (INT8, BF16)]


def _id(value):
  return backends.param_id(value) if isinstance(value, type) else str(value)


# -- absorbed MLA decode and MLA's own value pages -----------------------------------------


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("page_dtype,query_dtype", PAGE_TYPES, ids=_id)
def test_absorbed_mla_decode_reads_the_values_from_the_key_rows(harness, backend, page_dtype,
                                                               query_dtype):
  """DeepSeek's absorbed decode: 576 features a key row, of which the first 512
  are the value; 16 query heads on one kv head (one tile of 16 rows); ragged
  kv_lens (0, partial, beyond the capacity) and clamped page ids."""
  cache = Cache(1, batch=3, q_len=1, heads=16, kv_heads=1, head_dim=576, value_head_dim=512,
                in_keys=True, page_dtype=page_dtype, query_dtype=query_dtype, max_pages=2)
  out, _ = check(cache, harness)
  assert not out[1].any()  # kv_len 0: no key, a zero row


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("page_dtype,query_dtype", PAGE_TYPES, ids=_id)
def test_mla_value_pages_of_their_own_head_dim(harness, backend, page_dtype, query_dtype):
  """MLA's 192/128 with value pages of their own; GQA 4 on two kv heads."""
  cache = Cache(2, batch=3, q_len=1, heads=8, kv_heads=2, head_dim=192, value_head_dim=128,
                in_keys=False, page_dtype=page_dtype, query_dtype=query_dtype, page_size=5,
                max_pages=7)
  check(cache, harness)


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("in_keys,dims,page_dtype", [
    (True, (576, 512), BF16),
    (False, (192, 128), F32),
    (True, (576, 512), INT8),
], ids=_id)
def test_one_long_sequence_splits_its_keys(harness, backend, in_keys, dims, page_dtype):
  """Batch 1 over 41 pages of 16 (656 keys, 650 cached): the plan splits the
  keys 3 ways, the MLA kernel writes Hv-wide partial outputs to the
  workspace and the merge combines them (two launches)."""
  H, Hv = dims
  cache = Cache(3, batch=1, q_len=1, heads=8, kv_heads=1, head_dim=H, value_head_dim=Hv,
                in_keys=in_keys, page_dtype=page_dtype, max_pages=41, kv_lens=[650])
  assert plan(1, 1, 8, 1, H, Hv, 41 * 16)[2] == 3
  check(cache, harness, launches=2)


@pytest.mark.backends(backends.HARNESS)
def test_chunked_prefill_in_row_tiles(harness, backend):
  """A chunk of 3 tokens x 16 heads: 48 rows of one kv head, three tiles, each
  reading the keys its rows see; query_lens 3 and 1."""
  cache = Cache(4, batch=2, q_len=3, heads=16, kv_heads=1, head_dim=576, value_head_dim=512,
                in_keys=True, page_dtype=BF16, query_lens=[3, 1], kv_lens=[40, 9])
  check(cache, harness)


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("H,Hv,in_keys,page_dtype", [
    (40, 17, True, F32),    # 16-byte key units, values in them: an odd value width
    (40, 17, False, BF16),  # value rows of 34 bytes: element copies
    (33, 24, True, BF16),   # key rows of 66 bytes: element keys
    (33, 20, False, INT8),  # element keys, 16-byte-free int8 values
    (32, 48, False, F32),   # values wider than the keys
    (24, 0, True, F32),     # no value feature: only the log-sum-exp
    (256, 384, False, BF16),  # three column groups of 128 (a fourth warp without columns)
    (320, 320, False, BF16),  # equal dims above 256: the MLA kernel too
], ids=_id)
def test_any_pair_of_head_dims(harness, backend, H, Hv, in_keys, page_dtype):
  cache = Cache(H + Hv, batch=3, q_len=2, heads=4, kv_heads=2, head_dim=H, value_head_dim=Hv,
                in_keys=in_keys, page_dtype=page_dtype, page_size=5, max_pages=4,
                query_lens=[2, 1, 2])
  check(cache, harness)


@pytest.mark.backends(backends.HARNESS)
def test_window_soft_cap_and_scale(harness, backend):
  cache = Cache(5, batch=3, q_len=2, heads=8, kv_heads=1, head_dim=576, value_head_dim=512,
                in_keys=True, page_dtype=F32, query_lens=[2, 2, 1])
  check(cache, harness, scale=0.07, soft_cap=3.0, window_left=7)


@pytest.mark.backends(backends.HARNESS)
def test_values_as_wide_as_the_keys_take_the_decode_kernel(harness, backend):
  """Values in keys with Hv = H (the whole key row is the value): the decode
  kernel, reading the key pages as value pages."""
  cache = Cache(6, batch=3, q_len=1, heads=4, kv_heads=2, head_dim=64, value_head_dim=64,
                in_keys=True, page_dtype=INT8)
  check(cache, harness)


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("page_dtype,dims", [(BF16, (576, 512)), (INT8, (40, 17)),
                                             (F32, (96, 64))], ids=_id)
def test_values_in_keys_equal_copied_value_pages(harness, backend, page_dtype, dims):
  """Reading the values from the key rows gives the bits that value pages
  holding copies of the keys' first Hv features (and their scales) give."""
  H, Hv = dims
  cache = Cache(7, batch=3, q_len=1, heads=16, kv_heads=1, head_dim=H, value_head_dim=Hv,
                in_keys=True, page_dtype=page_dtype)
  out, lse = attend(cache)
  copied_out, copied_lse = attend(cache.copied_values())
  np.testing.assert_array_equal(out, copied_out)
  np.testing.assert_array_equal(lse, copied_lse)


@pytest.mark.backends(backends.HARNESS)
def test_random_thread_and_block_order(harness, backend):
  """The block barriers order every shared buffer: the same bits in any order
  of threads and blocks, fibers or OS threads."""
  cache = Cache(8, batch=2, q_len=2, heads=8, kv_heads=1, head_dim=192, value_head_dim=128,
                in_keys=True, page_dtype=BF16, max_pages=2)
  expected = attend(cache)
  for mode, seed in (("fibers", 3), ("threads", 5)):
    with harness.scheduled(mode, seed):
      got = attend(cache)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


# -- the cache update -----------------------------------------------------------------------


def _update(key_pages, value_pages, key, value, slots, key_scales=None, value_scales=None):
  results = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (key_pages, value_pages)]
  results += [jax.ShapeDtypeStruct((0,) if s is None else s.shape, F32)
              for s in (key_scales, value_scales)]
  call = jax.ffi.ffi_call(UPDATE, results)
  return [np.asarray(r) for r in call(key_pages, value_pages, key, value, slots,
                                      NONE_F32 if key_scales is None else key_scales,
                                      NONE_F32 if value_scales is None else value_scales)]


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_update_of_a_cache_whose_values_are_in_its_keys(harness, backend, int8):
  """Only the key rows (576 wide) land; no value rows or pages exist; int8 rows
  take the quantization rule (scale max|x| / 127)."""
  rng = np.random.default_rng(9)
  pages = np.zeros((3, 4, 1, 576), INT8 if int8 else F32)
  scales = np.full((3, 4, 1), -1.0, F32) if int8 else None
  key = rng.standard_normal((3, 1, 576)).astype(F32)
  slots = np.array([5, -1, 11], np.int32)
  before = harness.launches()
  out = _update(pages, np.zeros((0,), pages.dtype), key, np.zeros((0,), F32), slots, scales)
  assert harness.launches() - before == 1
  assert out[1].shape == (0,) and out[3].shape == (0,)
  for token, slot in ((0, 5), (2, 11)):
    page, offset = divmod(slot, 4)
    if int8:
      scale = np.abs(key[token]).max(-1) / F32(127)
      np.testing.assert_array_equal(out[2][page, offset], scale)
      expected = np.clip(np.round(key[token] / scale[:, None]), -127, 127)
      np.testing.assert_array_equal(out[0][page, offset], expected.astype(INT8))
    else:
      np.testing.assert_array_equal(out[0][page, offset], key[token])
  written = np.zeros((3, 4), bool)
  written[1, 1] = written[2, 3] = True
  assert not out[0][~written].any()
  if int8:
    assert (out[2][~written] == -1).all()


@pytest.mark.backends(backends.HARNESS)
def test_update_of_value_pages_with_a_head_dim_of_their_own(harness, backend):
  rng = np.random.default_rng(10)
  key_pages, value_pages = np.zeros((2, 3, 2, 192), BF16), np.zeros((2, 3, 2, 128), BF16)
  key = jnp.asarray(rng.standard_normal((2, 2, 192)), BF16)
  value = jnp.asarray(rng.standard_normal((2, 2, 128)), BF16)
  out = _update(key_pages, value_pages, key, value, np.array([4, 0], np.int32))
  np.testing.assert_array_equal(out[0][1, 1], key[0])
  np.testing.assert_array_equal(out[1][1, 1], value[0])
  np.testing.assert_array_equal(out[0][0, 0], key[1])
  np.testing.assert_array_equal(out[1][0, 0], value[1])
  assert np.count_nonzero(np.asarray(out[1], F32)) == np.count_nonzero(np.asarray(value, F32))


# -- the handler's limits and the contract ---------------------------------------------------


@pytest.mark.parametrize("H,Hv,in_keys,match", [
    (584, 512, True, "head_dim <= 576"),
    (576, 520, False, "value_head_dim <= 512"),
])
def test_cuda_handler_rejects_head_dims_above_its_limits(H, Hv, in_keys, match):
  harness = backends.harness()
  cache = Cache(11, batch=1, q_len=1, heads=2, kv_heads=1, head_dim=H, value_head_dim=Hv,
                in_keys=in_keys, page_dtype=F32, page_size=4, max_pages=1)
  launches = harness.launches()
  with pytest.raises(Exception, match=match):
    attend(cache, workspace=0)
  assert harness.launches() == launches


@pytest.mark.parametrize("dims,batch,keys", [((576, 512), 1, 1024), ((192, 128), 2, 2048),
                                             ((96, 96), 1, 1024), ((320, 320), 1, 1024)])
def test_contract_sizes_the_workspace_as_the_plan(dims, batch, keys):
  """The workspace the installed module's contract sizes (what the Python
  lowering allocates) is the plan's, for the MLA kernel's shapes too (a module
  built before the MLA kernel sizes tiles of 8 rows above head dim 128)."""
  H, Hv = dims
  pages = (4, 16, 1, H)
  shapes = [(batch, 1, 16, H), pages, (0,) if Hv < H else (*pages[:3], Hv),
            (batch, keys // 16), (batch,), (0,), (0,), (0,)]
  attributes = {"window_left": -1, "value_head_dim": Hv}
  aval = ffi_targets.workspace("jaxops_paged_attention_fwd", shapes, attributes, "cuda")
  assert aval.shape == (workspace_bytes(batch, 1, 16, 1, H, Hv, keys),)
  assert aval.shape[0] > 0
