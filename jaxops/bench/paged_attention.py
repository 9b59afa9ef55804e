"""``python -m jaxops.bench paged_attention``: decode over a paged KV cache vs the jnp reference.

One query token per sequence against ``--kv-len`` cached tokens held in pages
of ``--page-size`` tokens, scattered over a shuffled page pool (block tables
as a serving engine builds them). For float32, bfloat16 and int8 pages (with
float32 scales, a float32 query), jaxops.paged_attention against the jnp
reference (``xla``: jaxops.reference.paged_attention under jit, a dense
gather of every sequence's pages through its block table, then attention; no
jax.nn function takes a paged cache) in the same run. Timed and reported as
jaxops.bench decode's cases (its ``run_bench``, whose bandwidth measures run
first): the bytes a step must move are the K/V bytes read, pages and scales,
the figure a decode step is bound by.

``--mla`` adds absorbed MLA decode (DeepSeek-V3's attention in its inference
form, one shard of tensor parallelism over 8: 16 query heads on one kv head,
head_dim 576 = a 512-wide latent and 64 rope features): one cache whose key
rows hold the values in their first 512 features (``value_pages=None``), and,
for comparison in the same run, the same cache with a second copy of the
values as value pages (what a cache without the layout must keep). With 16
heads on one key row, MLA decode does 16 x (576 + 512) x 2 flops per key row
it reads: it is bound by arithmetic on the CPU, not by the cache's bytes.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops import reference
from jaxops.bench import options
from jaxops.bench.decode import DecodeCase, run_bench


@dataclasses.dataclass(frozen=True)
class PagedDecodeCase(DecodeCase):
  """jaxops.paged_attention decoding one token of each of B sequences."""
  batch: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  page_size: int
  dtype: str  # of the pages: float32, bfloat16, float16 or int8 (float32 query)
  value_head_dim: int = -1  # -1: head_dim
  values_in_keys: bool = False  # absorbed MLA: no value pages

  @property
  def value_dim(self) -> int:
    return self.head_dim if self.value_head_dim < 0 else self.value_head_dim

  @property
  def op(self) -> str:
    if self.value_dim == self.head_dim:
      return f"paged page={self.page_size}"
    layout = "values in keys" if self.values_in_keys else "value pages"
    return f"paged MLA {self.head_dim}/{self.value_dim} {layout} page={self.page_size}"

  @property
  def cache_bytes(self) -> int:
    item = jnp.dtype(self.dtype).itemsize
    scale_bytes = 4 if self.dtype == "int8" else 0
    key = self.head_dim * item + scale_bytes
    value = 0 if self.values_in_keys else self.value_dim * item + scale_bytes
    return self.batch * self.kv_len * self.num_kv_heads * (key + value)

  def build(self):
    B, S, N, K, H, page = (self.batch, self.kv_len, self.num_heads, self.num_kv_heads,
                           self.head_dim, self.page_size)
    rng = np.random.default_rng(0)
    pages_per_seq = -(-S // page)
    tables = jnp.asarray(rng.permutation(B * pages_per_seq).reshape(B, pages_per_seq), jnp.int32)
    shape = (B * pages_per_seq, page, K, H)
    int8 = self.dtype == "int8"
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.float32 if int8 else self.dtype)
    if int8:
      pages = [jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) for _ in range(2)]
      extra = {"key_scales": jnp.full(shape[:3], 0.01, jnp.float32),
               "value_scales": jnp.full(shape[:3], 0.01, jnp.float32)}
    else:
      pages = [jnp.asarray(rng.standard_normal(shape), self.dtype) for _ in range(2)]
      extra = {}
    lens = jnp.full((B,), S, jnp.int32)
    if self.value_dim != H:
      # MLA: the values are the keys' first value_dim features, in the key
      # pages themselves or copied into value pages of their own.
      Hv = self.value_dim
      if self.values_in_keys:
        extra.pop("value_scales", None)
        extra["value_head_dim"] = Hv
        fns = {"jaxops": lambda q, kp, t, n: jaxops.paged_attention(q, kp, None, t, n, **extra),
               "xla": lambda q, kp, t, n: reference.paged_attention(q, kp, None, t, n, **extra)}
        return fns, (q, pages[0], tables, lens)
      if int8:
        extra["value_scales"] = extra["key_scales"]
      pages[1] = pages[0][..., :Hv] + 0
    fns = {"jaxops": lambda q, kp, vp, t, n: jaxops.paged_attention(q, kp, vp, t, n, **extra),
           "xla": lambda q, kp, vp, t, n: reference.paged_attention(q, kp, vp, t, n, **extra)}
    return fns, (q, *pages, tables, lens)


def paged_cases(dtypes, batches, kv_len=4096, heads=(32, 8), head_dim=128,
                page_size=16) -> list[PagedDecodeCase]:
  return [PagedDecodeCase(batch, kv_len, *heads, head_dim, page_size, dtype)
          for batch in batches for dtype in dtypes]


def mla_cases(dtypes, batches, kv_len=4096) -> list[PagedDecodeCase]:
  """Absorbed MLA decode, values in keys and (beside it) in value pages."""
  return [PagedDecodeCase(batch, kv_len, 16, 1, 576, 64, dtype, 512, in_keys)
          for batch in batches for dtype in dtypes for in_keys in (True, False)]


PRESETS = {
    "cpu": {"dtypes": ["float32", "bfloat16", "int8"], "batches": [8, 1], "kv_len": 4096,
            "runs": 9, "mla": True},
    "gpu": {"dtypes": ["bfloat16", "float32", "int8"], "batches": [32, 1], "kv_len": 8192,
            "runs": 3, "mla": True},
}
QUICK = {"cpu": {"dtypes": ["float32"], "batches": [8], "mla": False},
         "gpu": {"dtypes": ["bfloat16"], "batches": [32], "mla": False}}


def parse(argv):
  parser = options.parser_for("paged_attention", __doc__, PRESETS, QUICK)
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--batches", nargs="+", type=int, default=None)
  parser.add_argument("--kv-len", type=int, default=None)
  parser.add_argument("--heads", default="32/8", help="query heads / kv heads")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None,
                      help="also absorbed MLA decode (576/512, values in keys vs value pages)")
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  heads = tuple(int(s) for s in args.heads.split("/"))
  cases = paged_cases(args.dtypes, args.batches, args.kv_len, heads, args.head_dim,
                      args.page_size)
  if args.mla:
    cases += mla_cases([d for d in args.dtypes if d != "float32"] or args.dtypes, args.batches,
                       args.kv_len)
  run_bench("paged_attention", args, argv, cases)
  return 0
