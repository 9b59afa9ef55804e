"""``python -m jaxops.bench sparse``: 2:4 sparse linear vs the dense product under XLA.

For each x shape and dtype, ``jaxops.sparse.linear(x, compress(w_pruned))``
against ``dense``: ``x @ w_pruned.T`` (XLA's dense dot on the same values), in
the same process.

Decode-shaped calls (at most 64 rows) are bound by reading the weight: the
bytes a call must move are the packed weight's (values and metadata; x and
the output are small beside it), against the roofline's copy bandwidth, and
next to the machine's streaming read bandwidth measured in the same run
(decode's probes: jnp reductions and, on the CPU, a C++ OpenMP loop, the
higher of the two); "bound ms" is the time the packed weight takes to stream
at that bandwidth, the floor of a decode-shaped call, and "dense GB/s" counts
the dense matrix the peer reads. Prefill-shaped calls are compute-bound:
TFLOP/s counts the dense product's 2 * rows * in * out, against the matmul rate.

Prefill-shaped calls also time forward+backward (a training step's share):
``jax.vjp`` with respect to x and the weight (jaxops: the packed values, whose
gradient is the sampled product dy^T x at the kept positions; dense: the whole
dense matrix) with a random cotangent, counted as three dense products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import sparse
from jaxops.bench import options
from jaxops.bench.decode import stream_bandwidth
from jaxops.bench.results import Reporter, Result, computed, moved
from jaxops.bench.timing import time_implementations

_DECODE_ROWS = 64
PRESETS = {
    "cpu": {"weight": "11008x4096", "rows": [1, 2, 4, 8, 2048], "dtypes": ["float32", "bfloat16"],
            "runs": 7},
    "gpu": {"weight": "28672x8192", "rows": [1, 8, 8192], "dtypes": ["float32", "bfloat16"],
            "runs": 3},
}
QUICK = {"cpu": {"rows": [1], "dtypes": ["float32"]},
         "gpu": {"rows": [1], "dtypes": ["bfloat16"]}}


def parse(argv):
  parser = options.parser_for("sparse", __doc__, PRESETS, QUICK)
  parser.add_argument("--weight", default=None, help="out x in")
  parser.add_argument("--rows", nargs="+", type=int, default=None)
  parser.add_argument("--dtypes", nargs="+", default=None)
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  out, in_features = options.dims(args.weight)
  reporter = Reporter("sparse", args, argv, [("x", 11), ("dtype", 9)], ["jaxops", "dense"],
                      ("bytes", "flops"))
  reporter.header(f"w [{out}, {in_features}]; rate: GB/s of the packed weight up to "
                  f"{_DECODE_ROWS} rows, TFLOP/s beyond (prefill: median of "
                  f"{max(3, args.runs // 2)} runs on the CPU)")
  bandwidth, probe = stream_bandwidth(args.runs)
  print(f"# 'of stream' against the higher probe: {bandwidth:.1f} GB/s ({probe})", flush=True)
  for dtype_name in args.dtypes:
    dtype = jnp.dtype(dtype_name)
    w = jax.random.normal(jax.random.key(0), (out, in_features), jnp.float32).astype(dtype)
    w_pruned, _ = sparse.prune_2_4(w)
    packed = sparse.compress(w_pruned)
    dense_bytes, sparse_bytes = w_pruned.nbytes, packed.nbytes
    for rows in args.rows:
      x = jax.random.normal(jax.random.key(1), (rows, in_features), jnp.float32).astype(dtype)
      decode_shaped = rows <= _DECODE_ROWS
      runs = args.runs if decode_shaped else max(3, args.runs // 2)
      # Each implementation takes its own weight: the packed one, or the dense matrix.
      timings = time_implementations(
          {"jaxops": lambda x, s, w: sparse.linear(x, s), "dense": lambda x, s, w: x @ w.T},
          x, packed, w_pruned, runs=runs)
      ours = timings["jaxops"]
      trailer = ""
      if decode_shaped:
        work = moved(sparse_bytes)
        trailer = (f"  {work.rate(ours.ms) / bandwidth:.0%} of stream, bound "
                   f"{sparse_bytes / (bandwidth * 1e9) * 1e3:.2f} ms, dense "
                   f"{dense_bytes / (timings['dense'].ms * 1e-3) / 1e9:.1f} GB/s")
      else:
        work = computed(2 * rows * in_features * out)
      trailer += f"  weight MiB {sparse_bytes / 2**20:.1f} / {dense_bytes / 2**20:.1f} dense"
      shape_text = f"{rows}x{in_features}"
      reporter.add([shape_text, dtype_name],
                   Result(f"sparse.linear {'decode' if decode_shaped else 'prefill'}, "
                          f"w {args.weight}", shape_text, dtype_name, "fwd", timings, work),
                   trailer)
      if not decode_shaped:
        _forward_backward(reporter, args, x, packed, w_pruned, runs, shape_text, dtype_name)
  return 0


def _forward_backward(reporter, args, x, packed, w_pruned, runs, shape_text, dtype_name):
  rows, in_features = x.shape
  out = w_pruned.shape[0]
  dy = jax.random.normal(jax.random.key(2), (rows, out), jnp.float32).astype(x.dtype)

  def ours(x, values, dy):
    f = lambda x, values: sparse.linear(x, sparse.SparseWeight(values, packed.metadata, in_features))
    return jax.vjp(f, x, values)[1](dy)

  def dense(x, w, dy):
    return jax.vjp(lambda x, w: x @ w.T, x, w)[1](dy)

  # Each implementation takes its own weight and the same cotangent.
  timings = time_implementations(
      {"jaxops": lambda x, v, w, dy: ours(x, v, dy), "dense": lambda x, v, w, dy: dense(x, w, dy)},
      x, packed.values, w_pruned, dy, runs=runs, interleave=True)
  reporter.add([shape_text, dtype_name],
               Result(f"sparse.linear prefill, w {args.weight}", shape_text, dtype_name, "fwd+bwd",
                      timings, computed(6 * rows * in_features * out)),
               f"  dvalues: the sampled product; dense: the whole dW")
  return 0
