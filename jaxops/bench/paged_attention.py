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
"""

from __future__ import annotations

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

  @property
  def op(self) -> str:
    return f"paged page={self.page_size}"

  @property
  def cache_bytes(self) -> int:
    scale_bytes = 4 if self.dtype == "int8" else 0
    per_token = self.num_kv_heads * (self.head_dim * jnp.dtype(self.dtype).itemsize + scale_bytes)
    return 2 * self.batch * self.kv_len * per_token

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
    fns = {"jaxops": lambda q, kp, vp, t, n: jaxops.paged_attention(q, kp, vp, t, n, **extra),
           "xla": lambda q, kp, vp, t, n: reference.paged_attention(q, kp, vp, t, n, **extra)}
    return fns, (q, *pages, tables, lens)


def paged_cases(dtypes, batches, kv_len=4096, heads=(32, 8), head_dim=128,
                page_size=16) -> list[PagedDecodeCase]:
  return [PagedDecodeCase(batch, kv_len, *heads, head_dim, page_size, dtype)
          for batch in batches for dtype in dtypes]


PRESETS = {
    "cpu": {"dtypes": ["float32", "bfloat16", "int8"], "batches": [8, 1], "kv_len": 4096,
            "runs": 9},
    "gpu": {"dtypes": ["bfloat16", "float32", "int8"], "batches": [32, 1], "kv_len": 8192,
            "runs": 3},
}
QUICK = {"cpu": {"dtypes": ["float32"], "batches": [8]},
         "gpu": {"dtypes": ["bfloat16"], "batches": [32]}}


def parse(argv):
  parser = options.parser_for("paged_attention", __doc__, PRESETS, QUICK)
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--batches", nargs="+", type=int, default=None)
  parser.add_argument("--kv-len", type=int, default=None)
  parser.add_argument("--heads", default="32/8", help="query heads / kv heads")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--page-size", type=int, default=16)
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  heads = tuple(int(s) for s in args.heads.split("/"))
  run_bench("paged_attention", args, argv, paged_cases(args.dtypes, args.batches, args.kv_len,
                                                       heads, args.head_dim, args.page_size))
  return 0
