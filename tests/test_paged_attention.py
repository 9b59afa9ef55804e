"""paged_attention and paged_kv_update against their jnp references.

Tests taking `backend` run on the CPU kernels (cpu/paged_attention.cc) and on
the CUDA kernels (cuda/paged_attention.cu, through xla_ffi/cuda/
paged_attention.cc) in the harness. The reference itself is checked against
jaxops.reference.attention on a contiguous cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jaxops
from jaxops import reference
from jaxops.testing import assert_close, custom_call_targets, tolerance, vmap_against_loop
from support import backends, meshes

# The backends with a paged handler: all of them.
BACKENDS = backends.ORDER
FFI = {"implementation": "ffi"}
INT8 = jnp.int8


def make_cache(seed, *, batch, heads, kv_heads, head_dim, page_size, max_pages, dtype,
               q_len=None, kv_lens=None, query_dtype=None, spare_pages=1):
  """(query, key_pages, value_pages, block_tables, kv_lens, scales): the pages
  of every sequence scattered over a shuffled pool with spare pages; int8
  pages come with random scales (a (key, value) pair, else None)."""
  rng = np.random.default_rng(seed)
  P = batch * max_pages + spare_pages
  tables = rng.permutation(P)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
  capacity = max_pages * page_size
  if kv_lens is None:
    kv_lens = rng.integers(max(1, q_len or 1), capacity + 1, size=batch)
  shape = (P, page_size, kv_heads, head_dim)
  query_dtype = query_dtype or (jnp.float32 if dtype == INT8 else dtype)
  q_shape = (batch, heads, head_dim) if q_len is None else (batch, q_len, heads, head_dim)
  query = jnp.asarray(rng.standard_normal(q_shape), jnp.float32).astype(query_dtype)
  if dtype == INT8:
    pages = [jnp.asarray(rng.integers(-127, 128, shape), INT8) for _ in range(2)]
    scales = tuple(jnp.asarray(rng.uniform(0.004, 0.02, shape[:3]), jnp.float32)
                   for _ in range(2))
  else:
    pages = [jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
             for _ in range(2)]
    scales = None
  return query, pages[0], pages[1], jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32), scales


def _scale_kwargs(scales):
  return {} if scales is None else {"key_scales": scales[0], "value_scales": scales[1]}


def check_against_reference(cache, *, query_lens=None, **options):
  query, kp, vp, tables, kv_lens, scales = cache
  kwargs = dict(query_lens=query_lens, return_residual=True, **_scale_kwargs(scales), **options)
  out, lse = jaxops.paged_attention(query, kp, vp, tables, kv_lens, **kwargs, **FFI)
  # Jitted: one compilation instead of one per jnp op (seconds per shape eagerly).
  ref_out, ref_lse = jax.jit(lambda *operands: reference.paged_attention(*operands, **kwargs))(
      query, kp, vp, tables, kv_lens)
  keys = tables.shape[1] * kp.shape[1]
  assert out.dtype == query.dtype and lse.dtype == jnp.float32
  assert_close(out, ref_out, reduce_size=keys, name="out")
  atol, rtol = tolerance(query.dtype, keys)
  assert_close(lse, ref_lse, atol=atol, rtol=rtol, name="logsumexp")
  return out, lse


def check_split_on_cuda(backend, run):
  """Runs ``run()``; on the harness, checks that it launched the CUDA split-K:
  the attention writing its partial states to the workspace, then the merge."""
  before = backends.harness().launches() if backend == backends.HARNESS else None
  result = run()
  if before is not None:
    assert backends.harness().launches() - before == 2
  return result


# (batch, T or None (decode), heads, kv_heads, head_dim, page_size, max_pages): GQA
# ratios 1, 4, 8 and MQA, page sizes 1, 16 and 5, odd head dims, a head dim of
# whole 8-element chunks but not 16.
CASES = [
    (3, None, 4, 4, 16, 16, 3),    # MHA
    (2, None, 8, 2, 7, 5, 4),      # GQA 4, page size 5, odd head dim
    (2, 3, 8, 1, 33, 1, 9),        # MQA, page size 1, prefill
    (1, 5, 16, 2, 64, 16, 2),      # GQA 8, prefill
    (2, 2, 3, 1, 1, 5, 3),         # head dim 1
    (2, 2, 8, 2, 24, 16, 3),       # 8 rows of 3 chunks of 8: the AVX2 few-rows kernels
]
DTYPES = [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float16, None),
          (INT8, jnp.float32), (INT8, jnp.bfloat16)]


# Each case with two of the dtypes, so that every dtype meets two shapes
# (the whole product costs compile time); bfloat16 meets head dim 64, the
# decode core's bfloat16 dot-product path.
VALUE_CASES = [(case, *DTYPES[(i + k) % len(DTYPES)]) for i, case in enumerate(CASES)
               for k in (0, 3)]


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("case,dtype,query_dtype", VALUE_CASES,
                         ids=[f"{c}-{backends.param_id(d)}-{backends.param_id(q)}"
                              for c, d, q in VALUE_CASES])
def test_values_against_reference(backend, case, dtype, query_dtype):
  batch, T, heads, kv_heads, head_dim, page_size, max_pages = case
  cache = make_cache(sum(case[2:]), batch=batch, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, page_size=page_size, max_pages=max_pages, dtype=dtype,
                     q_len=T, query_dtype=query_dtype)
  query_lens = None
  if T is not None:
    query_lens = jnp.asarray(np.arange(batch) % T + 1, jnp.int32)  # some rows are padding
  check_against_reference(cache, query_lens=query_lens)


@pytest.mark.parametrize("heads,q_len", [(8, None), (8, 4), (4, None)],
                         ids=["decode-gqa4", "chunk-16-rows", "decode-gqa2"])
def test_int8_within_the_fixed_point_bound(heads, q_len):
  """int8 pages at the shapes of the CPU's pair products (head_dim a multiple of
  32, up to 16 query rows per kv head; in the avx2 variant, and in the avx512
  one on a CPU with AVX512_VNNI: 16-bit fixed point for the query and the
  probabilities, README's paged_attention section)
  against the float64 reference, within the bound that rounding allows: each
  logit moves by at most scale * max|q| / 2^16 * sum_h |k_h| (the query's
  rounding), so each softmax weight by a factor within exp(+-2 delta); each
  probability by 2^-16 of its tile's largest times its value scale, over at
  most every key. Elsewhere (the float32 kernels) the same bound holds with
  room to spare."""
  query, kp, vp, tables, kv_lens, scales = make_cache(
      3, batch=2, heads=heads, kv_heads=2, head_dim=128, page_size=16, max_pages=4,
      dtype=INT8, q_len=q_len)
  query_lens = None if q_len is None else jnp.asarray([q_len, 2], jnp.int32)
  kwargs = dict(query_lens=query_lens, key_scales=scales[0], value_scales=scales[1])
  out = jaxops.paged_attention(query, kp, vp, tables, kv_lens, **kwargs, **FFI)
  as64 = lambda x: np.asarray(x, np.float64)
  with jax.enable_x64(True):
    want = reference.paged_attention(
        jnp.asarray(as64(query)), kp, vp, tables, kv_lens, query_lens=query_lens,
        key_scales=jnp.asarray(as64(scales[0])), value_scales=jnp.asarray(as64(scales[1])))
  scale = 1 / np.sqrt(128)
  keys = as64(kp) * as64(scales[0])[..., None]    # [P, page, K, H] dequantised
  values = as64(vp) * as64(scales[1])[..., None]
  logit_error = scale * np.abs(as64(query)).max() / 2**16 * np.abs(keys).sum(-1).max()
  probability_error = tables.shape[1] * kp.shape[1] * 127 * as64(scales[1]).max() / 2**16
  bound = (np.exp(2 * logit_error) - 1) * np.abs(values).max() + probability_error + 1e-5
  error = np.abs(as64(out) - as64(want)).max()
  assert error <= bound, (error, bound)


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=backends.param_id)
def test_one_sequence_splits_its_keys_across_threads(backend, dtype):
  """One sequence and one kv head (fewer groups than threads) with enough
  keys that the decode core splits them and merges the partial states (on
  CUDA: three key splits through the workspace)."""
  cache = make_cache(15, batch=1, heads=4, kv_heads=1, head_dim=64, page_size=16, max_pages=40,
                     dtype=dtype, kv_lens=[601])
  check_split_on_cuda(backend, lambda: check_against_reference(cache, logits_soft_cap=20.0))


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("options", [{}, {"local_window_size": 40}], ids=str)
def test_decode_splits_keys_through_the_workspace(backend, options):
  """Decode of few (sequence, kv head) pairs over a long capacity: the CUDA
  plan (params/paged_attention_plan.h) splits the 1024 keys four ways, the
  splits' partial states go to the hidden workspace and a second kernel merges
  them. kv_lens 0 and 1 leave every split empty or all but the first; the
  window empties the early splits of the long sequence. A NaN query row stays
  NaN through the merge, as it does unsplit."""
  cache = make_cache(21, batch=3, heads=4, kv_heads=2, head_dim=12, page_size=32, max_pages=32,
                     dtype=jnp.bfloat16, kv_lens=[0, 1, 1000])
  out, lse = check_split_on_cuda(backend, lambda: check_against_reference(cache, **options))
  assert (out[0] == 0).all() and (lse[0] == -jnp.inf).all()
  query, *rest = cache
  out, lse = jaxops.paged_attention(query.at[2, 1].set(jnp.nan), *rest[:4], return_residual=True,
                                    **options, **FFI)
  assert jnp.isnan(out[2, 1]).all() and jnp.isnan(lse[2, 1]).all()
  assert not jnp.isnan(out[2].at[1].set(0)).any()  # the other rows of the sequence


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("options", [
    {"logits_soft_cap": 2.0}, {"local_window_size": 0}, {"local_window_size": 6},
    {"logits_soft_cap": 30.0, "local_window_size": 3, "scale": 0.7}], ids=str)
def test_soft_cap_window_and_scale(backend, options):
  cache = make_cache(1, batch=2, heads=4, kv_heads=2, head_dim=16, page_size=5, max_pages=4,
                     dtype=jnp.float32, q_len=3)
  check_against_reference(cache, query_lens=jnp.array([3, 2], jnp.int32), **options)


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("dtype,q_len", [(jnp.float32, None), (jnp.bfloat16, 3), (INT8, None)],
                         ids=["float32-decode", "bfloat16-prefill", "int8-decode"])
def test_sinks(backend, dtype, q_len):
  """Per-head sinks (gpt-oss) merge into the kernel's results as the
  reference's extra logit; a row with no key keeps output 0, its lse the sink."""
  cache = make_cache(2, batch=3, heads=4, kv_heads=2, head_dim=16, page_size=4, max_pages=3,
                     dtype=dtype, q_len=q_len)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
  query_lens = None if q_len is None else jnp.array([3, 1, 2], jnp.int32)
  check_against_reference(cache, query_lens=query_lens, sinks=sinks, logits_soft_cap=5.0)
  query, kp, vp, tables, _, scales = cache
  out, lse = jaxops.paged_attention(query, kp, vp, tables, jnp.array([0, 5, 1], jnp.int32),
                                    sinks=sinks, return_residual=True, **_scale_kwargs(scales),
                                    **FFI)
  assert not jnp.any(out[0]) and jnp.allclose(lse[0], sinks if q_len is None else sinks[:, None])


def test_sinks_nan_and_bad_sinks():
  cache = make_cache(3, batch=2, heads=4, kv_heads=2, head_dim=8, page_size=4, max_pages=2,
                     dtype=jnp.float32)
  query, kp, vp, tables, kv_lens, _ = cache
  out = jaxops.paged_attention(query, kp, vp, tables, jnp.maximum(kv_lens, 1),
                               sinks=jnp.array([0.0, jnp.nan, 0.0, 0.0]))
  assert jnp.isnan(out[:, 1]).all() and not jnp.isnan(out[:, [0, 2, 3]]).any()
  with pytest.raises(ValueError, match="sinks must have shape"):
    jaxops.paged_attention(query, kp, vp, tables, kv_lens, sinks=jnp.zeros((3,)))
  with pytest.raises(TypeError, match="sinks must have"):
    jaxops.paged_attention(query, kp, vp, tables, kv_lens, sinks=jnp.zeros((4,), jnp.int32))


def _attended_slots(tables, kv_lens, query_lens, T, num_pages, page_size, window):
  """[num_pages, page_size] bool: the slots some query row attends. Sequence
  b's rows attend positions max(0, kv - rows - window) .. kv - 1 together
  (rows = min(query_lens, kv), the first row the earliest)."""
  attended = np.zeros((num_pages, page_size), bool)
  tables, kv_lens = np.asarray(tables), np.asarray(kv_lens)
  for b in range(tables.shape[0]):
    kv = int(kv_lens[b])
    rows = min(T if query_lens is None else int(query_lens[b]), kv)
    first = 0 if window is None else max(0, kv - rows - window)
    for position in range(first, kv):
      attended[tables[b, position // page_size], position % page_size] = True
  return attended


# -- MLA: a value head dim of its own, and values inside the key rows -----------------------


def mla_cache(seed, *, head_dim, value_head_dim, in_keys, dtype, batch=2, heads=8, kv_heads=1,
              page_size=16, max_pages=3, q_len=None):
  """A cache whose value pages have value_head_dim features, or, in_keys, none:
  (query, key_pages, value_pages | None, tables, kv_lens, (key, value) scales)."""
  query, kp, vp, tables, kv_lens, scales = make_cache(
      seed, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
      page_size=page_size, max_pages=max_pages, dtype=dtype, q_len=q_len)
  if in_keys:
    return query, kp, None, tables, kv_lens, None if scales is None else (scales[0], None)
  _, vp, _, _, _, v_scales = make_cache(
      seed + 1, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=value_head_dim,
      page_size=page_size, max_pages=max_pages, dtype=dtype, q_len=q_len)
  vp = vp[:kp.shape[0]]
  return query, kp, vp, tables, kv_lens, None if scales is None else (scales[0], v_scales[1])


def _mla_kwargs(scales):
  if scales is None:
    return {}
  return {"key_scales": scales[0], **({} if scales[1] is None else {"value_scales": scales[1]})}


# (head_dim, value_head_dim, values in keys, kv_heads, q_len): absorbed MLA
# decode (DeepSeek-V3: 576 = a 512-wide latent + 64 rope features, one kv head,
# 8 query heads of a shard), its chunked prefill, MLA's 192/128 with value
# pages of their own, values wider than keys, an odd width, an empty value.
MLA_CASES = [
    (576, 512, True, 1, None),
    (576, 512, True, 1, 3),
    (192, 128, False, 2, None),
    (32, 48, False, 2, 2),
    (40, 17, True, 2, None),
    (24, 0, True, 1, None),
]


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, INT8], ids=backends.param_id)
@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_mla_value_head_dim_and_values_in_keys(backend, dtype, case):
  H, Hv, in_keys, kv_heads, q_len = case
  query, kp, vp, tables, kv_lens, scales = mla_cache(
      sum(case[:2]), head_dim=H, value_head_dim=Hv, in_keys=in_keys, dtype=dtype,
      kv_heads=kv_heads, q_len=q_len)
  kwargs = dict(return_residual=True, value_head_dim=Hv if in_keys else None,
                **_mla_kwargs(scales))
  if q_len is not None:
    kwargs["query_lens"] = jnp.asarray([q_len, 1], jnp.int32)
  out, lse = jaxops.paged_attention(query, kp, vp, tables, kv_lens, **kwargs, **FFI)
  ref_out, ref_lse = jax.jit(lambda *a: reference.paged_attention(*a, **kwargs))(
      query, kp, vp, tables, kv_lens)
  assert out.shape == (*query.shape[:-1], Hv) and out.dtype == query.dtype
  keys = tables.shape[1] * kp.shape[1]
  # int8 at head dims of whole 32-element pairs may take the fixed-point pair
  # products (bounded in test_int8_within_the_fixed_point_bound): ~1e-4 here.
  fixed_point = {"atol": 1e-3, "rtol": 1e-3} if dtype == INT8 else {"reduce_size": keys}
  assert_close(out, ref_out, **fixed_point, name="out")
  atol, rtol = tolerance(query.dtype, keys)
  assert_close(lse, ref_lse, atol=atol, rtol=rtol, name="logsumexp")
  if in_keys:
    # The same as value pages that copy the keys' first Hv features.
    copied = kp[..., :Hv]
    copy_kwargs = dict(kwargs, value_head_dim=None)
    if scales is not None:
      copy_kwargs["value_scales"] = scales[0]
    again = jaxops.paged_attention(query, kp, copied, tables, kv_lens, **copy_kwargs, **FFI)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again[0], np.float32))


@pytest.mark.backends(*BACKENDS)
def test_mla_splits_keys_with_values_in_keys(backend):
  """One long sequence (batch 1): the key splits' partial outputs are Hv wide."""
  query, kp, vp, tables, kv_lens, _ = mla_cache(
      5, head_dim=576, value_head_dim=512, in_keys=True, dtype=jnp.bfloat16, batch=1,
      heads=16, page_size=64, max_pages=24)
  kv_lens = jnp.asarray([24 * 64 - 7], jnp.int32)
  check = lambda: jaxops.paged_attention(query, kp, None, tables, kv_lens, value_head_dim=512,
                                         return_residual=True, **FFI)
  out, lse = check_split_on_cuda(backend, check)
  ref_out, ref_lse = reference.paged_attention(query, kp, None, tables, kv_lens,
                                               value_head_dim=512, return_residual=True)
  assert_close(out, ref_out, reduce_size=int(kv_lens[0]), name="out")
  np.testing.assert_allclose(lse, ref_lse, atol=2e-2, rtol=0)


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, INT8], ids=backends.param_id)
def test_mla_update_keys_only_then_attend(backend, dtype):
  """An absorbed-MLA decode step: write the new token's key row (latent and
  rope part; no value pages), then attend with its first 32 features as value."""
  query, kp, _, tables, kv_lens, scales = mla_cache(
      9, head_dim=40, value_head_dim=32, in_keys=True, dtype=dtype, batch=3, heads=4,
      page_size=5, max_pages=3)
  rng = np.random.default_rng(10)
  new = jnp.asarray(rng.standard_normal((3, 1, 40)), jnp.float32)
  pos = kv_lens - 1
  slots = tables[jnp.arange(3), pos // 5] * 5 + pos % 5
  kwargs = {} if scales is None else {"key_scales": scales[0]}
  out = jax.jit(lambda kp, k, s, **kw: jaxops.paged_kv_update(kp, None, k, None, s, **kw, **FFI))(
      kp, new, slots, **kwargs)
  expected = reference.paged_kv_update(kp, None, new, None, slots, *kwargs.values())
  assert out[1] is None and len(out) == (4 if dtype == INT8 else 2)
  if dtype == INT8:
    assert out[3] is None
  for a, e in zip(out, expected):
    if e is not None:
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))
  key_scales = out[2] if dtype == INT8 else None
  got = jaxops.paged_attention(query, out[0], None, tables, kv_lens, value_head_dim=32,
                               key_scales=key_scales, **FFI)
  want = reference.paged_attention(query, out[0], None, tables, kv_lens, value_head_dim=32,
                                   key_scales=key_scales)
  assert_close(got, want, reduce_size=15, name="out")


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("in_axes", [(0, None, 0, 0), (0, 0, 0, 0)], ids=str)
def test_mla_vmap(backend, in_axes):
  query, kp, _, tables, kv_lens, _ = mla_cache(11, head_dim=48, value_head_dim=32, in_keys=True,
                                               dtype=jnp.float32, heads=4)
  fn = lambda q, kp, t, l: jaxops.paged_attention(q, kp, None, t, l, value_head_dim=32, **FFI)
  stacked = lambda x: jnp.stack([x, x[::-1]])
  args = [stacked(query), kp if in_axes[1] is None else stacked(kp), stacked(tables),
          stacked(kv_lens)]
  vmap_against_loop(fn, args, in_axes)


def test_head_dims_beyond_the_cuda_kernels_take_the_reference_there(monkeypatch):
  """On CUDA (the platform faked: the routing is Python's), a head dim above
  the kernels' 576 (or a value head dim above 512) runs the jnp reference under
  implementation=None and is a clear error under "ffi"."""
  from jaxops._src import paged_attention as module, primitive
  query, kp, _, tables, kv_lens, _ = mla_cache(3, head_dim=584, value_head_dim=512,
                                               in_keys=True, dtype=jnp.float32, heads=2)
  monkeypatch.setattr(primitive, "current_platform", lambda: "cuda")
  assert module._CUDA_MAX_HEAD_DIM == 576 and module._CUDA_MAX_VALUE_HEAD_DIM == 512
  call = lambda **kw: jaxops.paged_attention(query, kp, None, tables, kv_lens,
                                             value_head_dim=512, **kw)
  assert not [t for t in custom_call_targets(call) if "paged" in t]
  within = lambda: jaxops.paged_attention(query[..., :576], kp[..., :576], None, tables,
                                          kv_lens, value_head_dim=512)
  assert [t for t in custom_call_targets(within) if "paged" in t]  # 576 takes the kernel
  with pytest.raises(ValueError, match="CUDA kernels support head_dim <= 576"):
    call(implementation="ffi")


def test_mla_heads_shard_with_values_in_keys():
  mesh = meshes.make_mesh((4, 2), ("data", "model"))
  query, kp, _, tables, kv_lens, _ = mla_cache(14, head_dim=40, value_head_dim=32, in_keys=True,
                                               dtype=jnp.float32, batch=4, heads=8, kv_heads=2,
                                               page_size=4)
  specs = [PartitionSpec("data", "model", None), PartitionSpec(None, None, "model", None),
           PartitionSpec("data", None), PartitionSpec("data")]
  fn = jax.jit(lambda q, kp, t, l: jaxops.paged_attention(q, kp, None, t, l, value_head_dim=32,
                                                          **FFI))
  placed = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((query, kp, tables, kv_lens), specs)]
  assert "all-gather" not in fn.lower(*placed).compile().as_text()
  np.testing.assert_allclose(fn(*placed), fn(query, kp, tables, kv_lens), rtol=1e-6, atol=1e-6)


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, INT8], ids=backends.param_id)
@pytest.mark.parametrize("q_len,window", [(None, None), (3, None), (3, 4)],
                         ids=["decode", "prefill", "prefill-window"])
def test_slots_no_row_attends_never_reach_a_result(backend, dtype, q_len, window):
  """A serving cache's free slots hold whatever an earlier sequence or no one
  wrote: NaN and +-inf in every slot no query row attends (past kv_lens, in
  the last page's tail, before the window, in spare pages; int8 pages through
  their scales) leave the output and log-sum-exp bit for bit those of the
  cache with those slots zeroed."""
  page_size, max_pages = 5, 4
  query_lens = None if q_len is None else jnp.array([3, 2, 1], jnp.int32)
  cache = make_cache(11, batch=3, heads=4, kv_heads=2, head_dim=16, page_size=page_size,
                     max_pages=max_pages, dtype=dtype, q_len=q_len, kv_lens=[7, 13, 1],
                     spare_pages=2)
  query, kp, vp, tables, kv_lens, scales = cache
  free = ~_attended_slots(tables, kv_lens, query_lens, q_len or 1, kp.shape[0], page_size,
                          window)
  assert free.any() and (~free).any()

  def attend(kp, vp, scales):
    return jax.jit(lambda *operands: jaxops.paged_attention(
        *operands, query_lens=query_lens, local_window_size=window, return_residual=True,
        **_scale_kwargs(scales), **FFI))(query, kp, vp, tables, kv_lens)

  def fill(x, value):
    mask = jnp.asarray(free).reshape(free.shape + (1,) * (x.ndim - 2))
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)

  clean = attend(fill(kp, 0), fill(vp, 0), None if scales is None else
                 tuple(fill(s, 0.0) for s in scales))
  for value in (np.nan, np.inf, -np.inf):
    if dtype == INT8:
      poisoned = attend(kp, vp, tuple(fill(s, value) for s in scales))
    else:
      poisoned = attend(fill(kp, value), fill(vp, value), None)
    for got, want, name in zip(poisoned, clean, ("out", "lse")):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                    err_msg=f"{name}, {value}")


@pytest.mark.backends(*BACKENDS)
def test_lengths_and_page_ids_are_clamped(backend):
  """kv_lens 0, 1, full, beyond capacity and negative; query_lens beyond T
  and kv_lens; page ids out of range: clamped as the header says."""
  page_size, max_pages = 5, 3
  capacity = page_size * max_pages
  cache = make_cache(2, batch=6, heads=4, kv_heads=2, head_dim=8, page_size=page_size,
                     max_pages=max_pages, dtype=jnp.float32, q_len=2,
                     kv_lens=[0, 1, capacity, capacity + 1000, -4, 3])
  query, kp, vp, tables, kv_lens, _ = cache
  tables = tables.at[5, 0].set(-7).at[5, 1].set(10**6)
  query_lens = jnp.array([2, 9, 2, 2, 1, 5], jnp.int32)
  out, lse = check_against_reference((query, kp, vp, tables, kv_lens, None),
                                     query_lens=query_lens)
  assert (out[0] == 0).all() and (lse[0] == -jnp.inf).all()   # no cached token
  assert (out[4] == 0).all() and (lse[4] == -jnp.inf).all()   # negative length
  assert (out[1, 1] == 0).all() and (lse[1, :, 1] == -jnp.inf).all()  # query_lens > kv_lens
  # Beyond capacity reads exactly what a full cache does; bad ids read the edge pages.
  full = jaxops.paged_attention(query[2:4], kp, vp, tables[2:4],
                                jnp.array([capacity, capacity], jnp.int32), **FFI)
  np.testing.assert_array_equal(out[3], full[1])
  edge = tables.at[5, 0].set(0).at[5, 1].set(kp.shape[0] - 1)
  again = jaxops.paged_attention(query, kp, vp, edge, kv_lens, query_lens=query_lens, **FFI)
  np.testing.assert_array_equal(out[5], again[5])


def test_reference_equals_dense_attention_on_a_contiguous_cache():
  """A cache whose pages are in order is jaxops.reference.attention's dense
  K/V with the queries at the end (causal with a query offset)."""
  B, T, N, K, H, page_size, M = 2, 3, 4, 2, 8, 4, 3
  query, kp, vp, _, _, _ = make_cache(3, batch=B, heads=N, kv_heads=K, head_dim=H,
                                      page_size=page_size, max_pages=M, dtype=jnp.float32,
                                      q_len=T, spare_pages=0)
  tables = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
  S = M * page_size
  out = reference.paged_attention(query, kp, vp, tables, jnp.full((B,), S, jnp.int32),
                                  local_window_size=5)
  dense = lambda pages: pages.reshape(B, S, K, H)
  expected = reference.attention(query, dense(kp), dense(vp), is_causal=True,
                                 query_offset=S - T, local_window_size=(5, 0))
  assert_close(out, expected, reduce_size=S)


@pytest.mark.backends(*BACKENDS)
def test_jit_and_decode_rank(backend):
  query, kp, vp, tables, kv_lens, _ = make_cache(4, batch=2, heads=4, kv_heads=4, head_dim=16,
                                                 page_size=16, max_pages=2, dtype=jnp.bfloat16)
  fn = lambda q, kp, vp, t, n: jaxops.paged_attention(q, kp, vp, t, n, return_residual=True,
                                                      **FFI)
  out, lse = jax.jit(fn)(query, kp, vp, tables, kv_lens)
  eager = fn(query, kp, vp, tables, kv_lens)
  assert out.shape == query.shape and lse.shape == (2, 4)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(eager[0], np.float32))
  targets = custom_call_targets(fn, query, kp, vp, tables, kv_lens)
  assert targets in (["jaxops_paged_attention_fwd"], ["jaxops_harness_paged_attention_fwd"])


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("in_axes", [(0, None, None, 0, 0), (0, 0, 0, 0, 0), (None, 0, 0, None, 1),
                                     (1, None, None, None, None)], ids=str)
def test_vmap(backend, in_axes):
  query, kp, vp, tables, kv_lens, _ = make_cache(5, batch=2, heads=4, kv_heads=2, head_dim=8,
                                                 page_size=5, max_pages=2, dtype=jnp.float32)
  stack = lambda x, axis, k: x if axis is None else jnp.stack(
      [x + i if x.dtype == jnp.int32 and x.ndim == 1 else x * (1 + i) for i in range(k)], axis)
  args = [stack(a, ax, 3) for a, ax in zip((query, kp, vp, tables, kv_lens), in_axes)]
  fn = lambda q, kp, vp, t, n: jaxops.paged_attention(q, kp, vp, t, n, **FFI)
  vmap_against_loop(fn, args, in_axes, atol=0, rtol=0)
  jaxpr = str(jax.make_jaxpr(jax.vmap(fn, in_axes=in_axes))(*args))
  assert jaxpr.count("jaxops_paged_attention_fwd") == 1  # folded, not looped


def test_grad_is_a_clear_error():
  query, kp, vp, tables, kv_lens, _ = make_cache(6, batch=1, heads=2, kv_heads=1, head_dim=4,
                                                 page_size=2, max_pages=2, dtype=jnp.float32)
  loss = lambda q: jaxops.paged_attention(q, kp, vp, tables, kv_lens, **FFI).sum()
  with pytest.raises(TypeError, match="inference op"):
    jax.grad(loss)(query)
  with pytest.raises(TypeError, match="inference op"):
    jax.jvp(loss, (query,), (query,))
  # Gradients of something else flow around it.
  other = lambda x: x * jaxops.paged_attention(query, kp, vp, tables, kv_lens, **FFI).sum()
  assert jax.grad(other)(1.0) == pytest.approx(float(other(1.0)))


# -- paged_kv_update --------------------------------------------------------------------


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("dtype,row_dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                             (jnp.float16, None), (INT8, jnp.float32),
                                             (INT8, jnp.bfloat16)], ids=backends.param_id)
def test_update_round_trip(backend, dtype, row_dtype):
  """Written rows read back through the block tables; padding slots are
  skipped, a repeated slot keeps the last token, int8 follows the rule."""
  P, page_size, K, H = 5, 4, 2, 9
  _, kp, vp, _, _, scales = make_cache(7, batch=1, heads=2, kv_heads=K, head_dim=H,
                                       page_size=page_size, max_pages=4, dtype=dtype)
  row_dtype = row_dtype or dtype
  rng = np.random.default_rng(8)
  rows = [jnp.asarray(rng.standard_normal((7, K, H)), jnp.float32).astype(row_dtype)
          for _ in range(2)]
  rows[0] = rows[0].at[3].set(0)  # an all-zero row: scale 0
  slots = jnp.array([6, -1, 19, 2, 6, P * page_size, 0], jnp.int32)  # 6 twice: token 4 wins
  kwargs = _scale_kwargs(scales)
  out = jaxops.paged_kv_update(kp, vp, rows[0], rows[1], slots, **kwargs, **FFI)
  # The reference runs on the CPU: int8 scales are compared bit for bit, and XLA
  # divides float32 on a GPU with div.full (up to 2 ulp off; the first GPU run's
  # scales were 1 ulp from the kernel's), the kernels and XLA's CPU exactly.
  with jax.default_device(jax.devices("cpu")[0]):
    expected = reference.paged_kv_update(kp, vp, rows[0], rows[1], slots, *kwargs.values())
  assert len(out) == (4 if dtype == INT8 else 2)
  for a, e in zip(out, expected):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))
  written = [(2, 19), (3, 2), (4, 6), (6, 0)]  # (token, slot)
  for name, pages, source, scale in ((0, out[0], rows[0], out[2] if dtype == INT8 else None),
                                     (1, out[1], rows[1], out[3] if dtype == INT8 else None)):
    flat = pages.reshape(P * page_size, K, H).astype(jnp.float32)
    for token, slot in written:
      got = flat[slot]
      if scale is not None:
        got = got * scale.reshape(P * page_size, K)[slot][:, None]
        atol = float(jnp.max(jnp.abs(source[token].astype(jnp.float32)))) / 254 + 1e-7
        np.testing.assert_allclose(got, source[token].astype(jnp.float32), atol=atol, rtol=0)
      else:
        np.testing.assert_array_equal(got, source[token].astype(jnp.float32))
    untouched = np.setdiff1d(np.arange(P * page_size), [s for _, s in written])
    before = (kp, vp)[name].reshape(P * page_size, K, H)
    np.testing.assert_array_equal(np.asarray(flat[untouched]),
                                  np.asarray(before[untouched], np.float32))


@pytest.mark.backends(*BACKENDS)
def test_update_then_attend_is_attention_over_the_new_tokens(backend):
  """A decode step: write the token at position kv_len - 1, then attend it."""
  query, kp, vp, tables, kv_lens, _ = make_cache(9, batch=3, heads=4, kv_heads=2, head_dim=8,
                                                 page_size=5, max_pages=3, dtype=jnp.float32)
  rng = np.random.default_rng(10)
  new = [jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32) for _ in range(2)]
  pos = kv_lens - 1
  slots = tables[jnp.arange(3), pos // 5] * 5 + pos % 5
  kp2, vp2 = jax.jit(lambda *a: jaxops.paged_kv_update(*a, **FFI))(kp, vp, *new, slots)
  dense_k = reference.paged_gather(kp2, tables)
  np.testing.assert_array_equal(dense_k[jnp.arange(3), pos], new[0])
  check_against_reference((query, kp2, vp2, tables, kv_lens, None))


@pytest.mark.backends(*BACKENDS)
@pytest.mark.parametrize("row_dtype", [jnp.float32, jnp.bfloat16], ids=backends.param_id)
def test_update_quantizes_non_finite_rows_as_the_reference(backend, row_dtype):
  """int8 pages: a row holding NaN gets a NaN scale and zeros, one holding an
  infinity the scale inf and zeros (inf / inf is NaN, converted to 0), as
  jaxops.reference.quantize_int8_rows gives them: bit for bit, the finite
  rows beside them too."""
  _, kp, vp, _, _, scales = make_cache(16, batch=1, heads=2, kv_heads=2, head_dim=40,
                                       page_size=4, max_pages=2, dtype=INT8)
  rng = np.random.default_rng(17)
  rows = [np.asarray(rng.standard_normal((4, 2, 40)), np.float32) for _ in range(2)]
  rows[0][0, 0, 3] = np.nan                        # NaN
  rows[0][1, 1, 39] = np.inf                       # +inf
  rows[1][2, 0, 0], rows[1][2, 0, 7] = -np.inf, np.nan   # both
  rows[1][3, 1, :] = -np.inf                       # all -inf
  rows = [jnp.asarray(r).astype(row_dtype) for r in rows]
  slots = jnp.array([0, 3, 5, 6], jnp.int32)
  out = jaxops.paged_kv_update(kp, vp, *rows, slots, **_scale_kwargs(scales), **FFI)
  with jax.default_device(jax.devices("cpu")[0]):
    expected = reference.paged_kv_update(kp, vp, *rows, slots, *scales)
  for a, e in zip(out, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  key_scales = np.asarray(out[2]).reshape(-1, 2)
  assert np.isnan(key_scales[0, 0]) and np.isinf(key_scales[3, 1])
  key_rows = np.asarray(out[0]).reshape(-1, 2, 40)
  assert not key_rows[0, 0].any() and not key_rows[3, 1].any() and key_rows[0, 1].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=backends.param_id)
def test_reference_never_reads_slots_no_row_attends(dtype):
  """implementation="xla" (and every float64 call, which takes the reference):
  NaN and inf in the value and key slots past kv_lens and before the window
  leave the results those of zeroed slots, as the kernels' do."""
  with jax.enable_x64(dtype == jnp.float64):
    query, kp, vp, tables, kv_lens, _ = make_cache(18, batch=2, heads=4, kv_heads=2, head_dim=8,
                                                   page_size=4, max_pages=3, dtype=jnp.float32,
                                                   kv_lens=[5, 9])
    query, kp, vp = (x.astype(dtype) for x in (query, kp, vp))
    free = ~_attended_slots(tables, kv_lens, None, 1, kp.shape[0], 4, 2)
    attend = lambda kp, vp: jaxops.paged_attention(query, kp, vp, tables, kv_lens,
                                                   local_window_size=2, return_residual=True,
                                                   implementation="xla")
    fill = lambda x, value: jnp.where(jnp.asarray(free)[..., None, None], value, x)
    clean = attend(fill(kp, 0), fill(vp, 0))
    for value in (np.nan, np.inf, -np.inf):
      for got, want in zip(attend(fill(kp, value), fill(vp, value)), clean):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.backends(*BACKENDS)
def test_empty_head_dim_with_the_default_scale(backend):
  """head_dim 0: the logits are 0 at any scale, so the default scale is 1
  there; the output is empty and the log-sum-exp log(attended keys)."""
  query, kp, vp, tables, kv_lens, _ = make_cache(19, batch=2, heads=4, kv_heads=2, head_dim=0,
                                                 page_size=4, max_pages=2, dtype=jnp.float32,
                                                 kv_lens=[3, 8])
  out, lse = jaxops.paged_attention(query, kp, vp, tables, kv_lens, local_window_size=5,
                                    return_residual=True, **FFI)
  assert out.shape == (2, 4, 0)
  np.testing.assert_allclose(lse, np.log([[3.0] * 4, [6.0] * 4]), rtol=1e-6)
  expected = reference.paged_attention(query, kp, vp, tables, kv_lens, local_window_size=5,
                                       return_residual=True)
  np.testing.assert_allclose(lse, expected[1], rtol=1e-6)


def test_update_writes_the_donated_cache_in_place():
  _, kp, vp, _, _, scales = make_cache(11, batch=2, heads=2, kv_heads=2, head_dim=16,
                                       page_size=16, max_pages=8, dtype=INT8)
  rows = jnp.ones((4, 2, 16), jnp.float32)
  slots = jnp.arange(4, dtype=jnp.int32)
  update = lambda kp, vp, ks, vs, k, v, s: jaxops.paged_kv_update(
      kp, vp, k, v, s, key_scales=ks, value_scales=vs, **FFI)
  args = (kp, vp, *scales, rows, rows, slots)
  compiled = jax.jit(update, donate_argnums=(0, 1, 2, 3)).lower(*args).compile().as_text()
  assert compiled.count("output_to_operand_aliasing") == 1
  assert "input_output_alias" in compiled
  assert " copy(" not in compiled[compiled.index("ENTRY"):]
  out = jax.jit(update, donate_argnums=(0, 1, 2, 3))(*args)
  assert kp.is_deleted() and scales[0].is_deleted()
  np.testing.assert_array_equal(out[0][0, :4], 127)
  # Not donated: XLA copies first, and the inputs are unchanged.
  _, kp, vp, _, _, scales = make_cache(11, batch=2, heads=2, kv_heads=2, head_dim=16,
                                       page_size=16, max_pages=8, dtype=INT8)
  before = np.asarray(kp)
  jax.jit(update)(kp, vp, *scales, rows, rows, slots)
  np.testing.assert_array_equal(np.asarray(kp), before)


@pytest.mark.backends(*BACKENDS)
def test_update_vmap(backend):
  _, kp, vp, _, _, _ = make_cache(12, batch=1, heads=2, kv_heads=2, head_dim=4, page_size=3,
                                  max_pages=3, dtype=jnp.float32)
  rows = jnp.arange(2 * 2 * 2 * 4, dtype=jnp.float32).reshape(2, 2, 2, 4)
  slots = jnp.array([[0, 5], [-1, 7]], jnp.int32)
  fn = lambda kp, vp, k, v, s: jaxops.paged_kv_update(kp, vp, k, v, s, **FFI)
  stacked = lambda x: jnp.stack([x, x + 1])
  for pages in [(kp, vp), (stacked(kp), stacked(vp))]:
    in_axes = (None if pages[0] is kp else 0,) * 2 + (0, 0, 0)
    vmap_against_loop(fn, [*pages, rows[:2], rows[:2] + 1, slots[:2]], in_axes, atol=0, rtol=0)


# -- bad inputs --------------------------------------------------------------------------


def _bad_calls():
  q, kp, vp, tables, lens, _ = make_cache(13, batch=2, heads=4, kv_heads=2, head_dim=8,
                                          page_size=4, max_pages=2, dtype=jnp.float32)
  i8 = kp.astype(INT8)
  s = jnp.ones(kp.shape[:3], jnp.float32)
  attend = lambda **kw: jaxops.paged_attention(
      kw.pop("q", q), kw.pop("kp", kp), kw.pop("vp", vp), kw.pop("tables", tables),
      kw.pop("lens", lens), **kw)
  rows = jnp.ones((3, 2, 8), jnp.float32)
  update = lambda **kw: jaxops.paged_kv_update(
      kw.pop("kp", kp), kw.pop("vp", vp), kw.pop("k", rows), kw.pop("v", rows),
      kw.pop("slots", jnp.zeros((3,), jnp.int32)), **kw)
  return [
      (lambda: attend(q=q[0]), ValueError, "query must have rank"),
      (lambda: attend(q=q.astype(jnp.int32)), TypeError, "query must have a floating dtype"),
      (lambda: attend(q=q.astype(jnp.bfloat16)), TypeError, "key_pages must have the query's"),
      (lambda: attend(kp=kp[0]), ValueError, "key_pages must have rank 4"),
      (lambda: attend(vp=vp[:, :2]), ValueError, "value_pages must have key_pages' first three"),
      (lambda: attend(vp=vp[0]), ValueError, "value_pages must have rank 4"),
      (lambda: attend(vp=vp.astype(jnp.bfloat16)), TypeError, "value_pages must have key_pages' "
       "dtype"),
      (lambda: attend(vp=None), TypeError, "value_head_dim must be given without value_pages"),
      (lambda: attend(vp=None, value_head_dim=9), ValueError, "value_head_dim must be at most"),
      (lambda: attend(vp=None, value_head_dim=-1), ValueError, "value_head_dim must be"),
      (lambda: attend(value_head_dim=4), ValueError, "value_head_dim must be None or"),
      (lambda: attend(kp=i8, vp=None, value_head_dim=8, key_scales=s, value_scales=s), TypeError,
       "value_scales must be None without value_pages"),
      (lambda: attend(q=q[..., :4]), ValueError, "key_pages must have the query's head_dim"),
      (lambda: attend(q=q[:, :3]), ValueError, "multiple of num_kv_heads"),
      (lambda: attend(tables=tables[0]), ValueError, "block_tables must have rank 2"),
      (lambda: attend(tables=tables[:1]), ValueError, "block_tables must have shape"),
      (lambda: attend(tables=tables.astype(jnp.float32)), TypeError, "block_tables must have an"),
      (lambda: attend(lens=lens[:1]), ValueError, "kv_lens must have shape"),
      (lambda: attend(query_lens=lens), ValueError, "query_lens must be None"),
      (lambda: attend(kp=i8, vp=i8), TypeError, "key_scales must be given"),
      (lambda: attend(kp=i8, vp=i8, key_scales=s, value_scales=s[:1]), ValueError,
       "value_scales must have shape"),
      (lambda: attend(key_scales=s, value_scales=s), TypeError, "key_scales must be None"),
      (lambda: attend(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be"),
      (lambda: attend(local_window_size=-1), ValueError, "local_window_size must be"),
      (lambda: attend(scale=float("nan")), ValueError, "scale must be finite"),
      (lambda: attend(return_residual=1), TypeError, "return_residual must be a Python bool"),
      (lambda: attend(implementation="tpu"), ValueError, "implementation must be one of"),
      (lambda: update(k=rows[:, :1]), ValueError, "key must have shape"),
      (lambda: update(k=rows.astype(jnp.float16), v=rows.astype(jnp.float16)), TypeError,
       "key must have the dtype of key_pages"),
      (lambda: update(v=rows[:2]), ValueError, "value must have shape"),
      (lambda: update(v=rows.astype(jnp.float16)), TypeError, "value must have key's dtype"),
      (lambda: update(vp=None), TypeError, "value must be None without value_pages"),
      (lambda: update(slots=jnp.zeros((2,), jnp.int32)), ValueError, "slot_mapping must have"),
      (lambda: update(slots=jnp.zeros((3,))), TypeError, "slot_mapping must have an integer"),
      (lambda: update(kp=i8, vp=i8), TypeError, "key_scales must be given"),
  ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_is_a_clear_error(index):
  call, error, match = _bad_calls()[index]
  with pytest.raises(error, match=match):
    call()


F32 = np.float32
_Q, _PAGES = np.ones((2, 1, 4, 8), F32), np.ones((3, 4, 2, 8), F32)
_TABLES, _LENS = np.zeros((2, 2), np.int32), np.ones((2,), np.int32)
_ATTRS = {"scale": F32(1), "logits_soft_cap": F32(0), "window_left": np.int64(-1),
          "value_head_dim": np.int64(8), "allow_tf32": np.bool_(False)}
_NONE = np.zeros((0,), np.int32), np.zeros((0,), F32), np.zeros((0,), F32)
_NO_WORKSPACE = ((0,), np.uint8)  # the CPU's hidden workspace result: empty
_OUT = [((2, 1, 4, 8), F32), ((2, 4, 1), F32), _NO_WORKSPACE]


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES[:, :2], _TABLES, _LENS, *_NONE], _OUT,
     _ATTRS, r"value_pages must be \[3, 4, 2, value_head_dim\]"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES[..., :4], _TABLES, _LENS, *_NONE], _OUT,
     _ATTRS, "value_head_dim 8 must be value_pages' last dim 4"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _NONE[1], _TABLES, _LENS, *_NONE], _OUT,
     dict(_ATTRS, value_head_dim=np.int64(9)), r"value_head_dim 9 must be in \[0, head_dim 8\]"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _NONE[1], _TABLES, _LENS, *_NONE], _OUT,
     dict(_ATTRS, value_head_dim=np.int64(4)), r"out must be \[2, 1, 4, 4\]"),
    ("jaxops_paged_attention_fwd", [_Q[..., :4], _PAGES, _PAGES, _TABLES, _LENS, *_NONE], _OUT,
     _ATTRS, "head_dim"),
    ("jaxops_paged_attention_fwd", [_Q[:, :, :3], _PAGES, _PAGES, _TABLES, _LENS, *_NONE],
     [((2, 1, 3, 8), F32), ((2, 3, 1), F32), _NO_WORKSPACE], _ATTRS, "multiple of num_kv_heads"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES[:1], _LENS, *_NONE], _OUT,
     _ATTRS, "block_tables must be int32"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES, _LENS[:1], *_NONE], _OUT,
     _ATTRS, "kv_lens must be int32"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES, _LENS, _LENS[:1], *_NONE[1:]],
     _OUT, _ATTRS, "query_lens must be int32"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES.astype(np.int8), _PAGES.astype(np.int8),
                                    _TABLES, _LENS, *_NONE], _OUT, _ATTRS,
     "key_scales must be float32 of shape"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES, _LENS, *_NONE],
     [((2, 1, 4, 8), F32), ((2, 1, 4), F32), _NO_WORKSPACE], _ATTRS,
     "logsumexp must be float32"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES, _LENS, *_NONE],
     _OUT[:2] + [((16,), np.uint8)], _ATTRS, r"workspace must be uint8 of shape \[0\]"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES, _LENS, *_NONE], _OUT,
     dict(_ATTRS, window_left=np.int64(-2)), "window_left"),
    ("jaxops_paged_attention_fwd", [_Q, _PAGES, _PAGES, _TABLES, _LENS, *_NONE], _OUT,
     dict(_ATTRS, logits_soft_cap=F32(-1)), "logits_soft_cap"),
    ("jaxops_paged_kv_update", [_PAGES, _PAGES, np.ones((3, 2, 4), F32), np.ones((3, 2, 4), F32),
                                np.zeros((3,), np.int32), *_NONE[1:]],
     [((3, 4, 2, 8), F32), ((3, 4, 2, 8), F32), ((0,), F32), ((0,), F32)], {},
     "key must be"),
    ("jaxops_paged_kv_update", [_PAGES, _PAGES, np.ones((3, 2, 8), F32), np.ones((3, 2, 8), F32),
                                np.zeros((2,), np.int32), *_NONE[1:]],
     [((3, 4, 2, 8), F32), ((3, 4, 2, 8), F32), ((0,), F32), ((0,), F32)], {},
     "slot_mapping must be int32"),
    ("jaxops_paged_kv_update", [_PAGES, _PAGES, np.ones((3, 2, 8), F32), np.ones((3, 2, 8), F32),
                                np.zeros((3,), np.int32), *_NONE[1:]],
     [((3, 4, 2, 8), F32), ((3, 4, 2, 4), F32), ((0,), F32), ((0,), F32)], {},
     "value_pages result has shape"),
    ("jaxops_paged_kv_update", [_PAGES, _NONE[1], np.ones((3, 2, 8), F32), np.ones((3, 2, 8), F32),
                                np.zeros((3,), np.int32), *_NONE[1:]],
     [((3, 4, 2, 8), F32), ((0,), F32), ((0,), F32), ((0,), F32)], {},
     r"value must be absent \(\[0\]\) without value_pages"),
    ("jaxops_paged_kv_update", [_PAGES, _PAGES, np.ones((3, 2, 8), F32), np.ones((3, 2, 4), F32),
                                np.zeros((3,), np.int32), *_NONE[1:]],
     [((3, 4, 2, 8), F32), ((3, 4, 2, 8), F32), ((0,), F32), ((0,), F32)], {},
     r"value must be \[3, 2, 8\]"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs))


# -- sharding ----------------------------------------------------------------------------


def test_batch_and_heads_shard():
  """Batch over one mesh axis, kv heads over the other: each shard attends its
  own sequences and heads, with no all-gather, and the values are unchanged."""
  mesh = meshes.make_mesh((4, 2), ("data", "model"))
  query, kp, vp, tables, kv_lens, _ = make_cache(14, batch=4, heads=8, kv_heads=2, head_dim=8,
                                                 page_size=4, max_pages=3, dtype=jnp.float32)
  specs = [PartitionSpec("data", "model", None), PartitionSpec(None, None, "model", None),
           PartitionSpec(None, None, "model", None), PartitionSpec("data", None),
           PartitionSpec("data")]
  fn = jax.jit(lambda *a: jaxops.paged_attention(*a, return_residual=True, **FFI))
  placed = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((query, kp, vp, tables, kv_lens), specs)]
  hlo = fn.lower(*placed).compile().as_text()
  assert "all-gather" not in hlo
  out, lse = fn(*placed)
  expected = fn(query, kp, vp, tables, kv_lens)
  assert tuple(out.sharding.spec) == ("data", "model")
  np.testing.assert_allclose(out, expected[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, expected[1], rtol=1e-6, atol=1e-6)
  update = jax.jit(lambda kp, vp, k, s: jaxops.paged_kv_update(kp, vp, k, k, s, **FFI))
  rows = jax.device_put(jnp.ones((4, 2, 8)), NamedSharding(mesh, PartitionSpec(None, "model")))
  slots = jnp.arange(4, dtype=jnp.int32)
  new_k, _ = update(placed[1], placed[2], rows, slots)
  assert "all-gather" not in update.lower(placed[1], placed[2], rows, slots).compile().as_text()
  np.testing.assert_array_equal(new_k, update(kp, vp, jnp.ones((4, 2, 8)), slots)[0])
