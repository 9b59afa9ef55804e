"""``python -m jaxops.bench sparse``: 2:4 sparse linear vs the dense product under XLA.

For each x shape and dtype, ``jaxops.sparse.linear(x, compress(w_pruned))``
against ``x @ w_pruned.T`` (XLA's dense dot on the same values), in the same
process. Decode-shaped calls (a few rows) are bound by reading the weight: GB/s
there counts the weight bytes each implementation reads (packed values and
metadata; the dense matrix), next to the machine's streaming read bandwidth
measured in the same run (decode's probes: jnp reductions and a C++ OpenMP
loop, the higher of the two); "bound ms" is the time the
packed weight takes to stream at that bandwidth, the floor of a decode-shaped
call. Prefill-shaped calls are compute-bound: GFLOP/s counts the dense
product's 2 * rows * in * out.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxops import sparse
from jaxops.bench.decode import stream_bandwidth
from jaxops.bench.timing import machine_line, time_jitted


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench sparse", description=__doc__)
  parser.add_argument("--weight", default="11008x4096", help="out x in")
  parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 2048])
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  out, in_features = (int(s) for s in args.weight.split("x"))
  print(f"# {machine_line()}")
  bandwidth, probe = stream_bandwidth(args.runs)
  print(f"# median of {args.runs} runs after warm-up (prefill: of {max(3, args.runs // 2)}); "
        f"w [{out}, {in_features}]; streams against the higher probe: {bandwidth:.1f} GB/s "
        f"({probe})")
  print(f"{'x':<11} {'dtype':<9} {'sparse ms':>10} {'dense ms':>9} {'speed-up':>8} "
        f"{'sparse GB/s':>11} {'dense GB/s':>10} {'of stream':>9} {'bound ms':>8} {'GFLOP/s':>8} "
        f"{'weight MiB sparse/dense':>24}")
  for dtype_name in args.dtypes:
    dtype = jnp.dtype(dtype_name)
    w = jax.random.normal(jax.random.key(0), (out, in_features), jnp.float32).astype(dtype)
    w_pruned, _ = sparse.prune_2_4(w)
    packed = sparse.compress(w_pruned)
    dense_bytes, sparse_bytes = w_pruned.nbytes, packed.nbytes
    for rows in args.rows:
      x = jax.random.normal(jax.random.key(1), (rows, in_features), jnp.float32).astype(dtype)
      runs = args.runs if rows <= 64 else max(3, args.runs // 2)
      ours = time_jitted(lambda x, s: sparse.linear(x, s), x, packed, runs=runs)
      dense = time_jitted(lambda x, w: x @ w.T, x, w_pruned, runs=runs)
      gbs = lambda nbytes, t: nbytes / (t.median_ms * 1e-3) / 1e9
      flops = 2 * rows * in_features * out / (ours.median_ms * 1e-3) / 1e9
      print(f"{rows}x{in_features:<6} {dtype_name:<9} {ours.median_ms:>10.2f} "
            f"{dense.median_ms:>9.2f} {dense.median_ms / ours.median_ms:>7.2f}x "
            f"{gbs(sparse_bytes, ours):>11.1f} {gbs(dense_bytes, dense):>10.1f} "
            f"{gbs(sparse_bytes, ours) / bandwidth:>9.0%} "
            f"{sparse_bytes / (bandwidth * 1e9) * 1e3:>8.2f} {flops:>8.1f} "
            f"{sparse_bytes / 2**20:>11.1f} / {dense_bytes / 2**20:<10.1f}", flush=True)
  return 0
