"""``python -m jaxops.bench attention``: jaxops.attention vs jax.nn.dot_product_attention and
the jnp composition.

For each shape (B, S, N, H) (self-attention, T = S, K = N), dtype and mask
(full, causal): forward, and forward+backward (a VJP with respect to q, k, v),
for each implementation in the same process. Prints median ms, GFLOP/s and
XLA's peak temporary memory for the compiled program. Flops: 4*B*N*T*S*H
forward, half when causal; the backward counts 2.5x the forward.

The implementations' runs are interleaved (one run of each in turn), so load
from other processes on a shared machine weighs on all of them alike and the
speed-ups stay meaningful when the absolute times do not. Each timed call
starts after a short pause (``timing.settle``), so the clean-up XLA does on
another thread after the previous call does not land in it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jaxops
from jaxops import reference
from jaxops.bench.timing import machine_line, settle

_IMPLS = {
    "jaxops": lambda q, k, v, causal: jaxops.attention(q, k, v, is_causal=causal),
    "jax.nn": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"),
    "jnp": lambda q, k, v, causal: reference.attention(q, k, v, is_causal=causal),
}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench attention", description=__doc__)
  parser.add_argument("--shapes", nargs="+", default=["1x2048x8x64", "4x1024x12x64", "1x4096x8x128"],
                      help="B x S x N x H, e.g. 1x2048x8x64")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  parser.add_argument("--impls", nargs="+", default=list(_IMPLS), choices=list(_IMPLS))
  parser.add_argument("--runs", type=int, default=5)
  return parser.parse_args(argv)


def _time_interleaved(fns, args, runs):
  """(median ms, XLA temporary bytes or None) of each jitted fn, runs interleaved."""
  compiled = [jax.jit(fn).lower(*args).compile() for fn in fns]
  temps = []
  for c in compiled:
    try:
      temps.append(c.memory_analysis().temp_size_in_bytes)
    except Exception:  # not every backend reports it
      temps.append(None)
  for c in compiled:
    jax.block_until_ready(c(*args))
  times = [[] for _ in compiled]
  for _ in range(runs):
    for c, t in zip(compiled, times):
      settle()
      start = time.perf_counter()
      out = jax.block_until_ready(c(*args))
      t.append((time.perf_counter() - start) * 1e3)
      del out
  return [(statistics.median(t), temp) for t, temp in zip(times, temps)]


def _gflops(shape, causal, backward, ms):
  B, S, N, H = shape
  flops = 4.0 * B * N * S * S * H * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
  return flops / (ms * 1e-3) / 1e9


def main(argv=()):
  args = _parse(argv)
  print(f"# {machine_line()}")
  print(f"# median of {args.runs} interleaved runs after warm-up; GFLOP/s = 4*B*N*T*S*H (x0.5 causal, x3.5 "
        "fwd+bwd) / time; temp = XLA's temporary allocation; x = speed-up of jaxops over it")
  header = f"{'shape BxSxNxH':<14} {'dtype':<9} {'mask':<7} {'pass':<8}"
  for impl in args.impls:
    header += f" {impl + ' ms':>11} {'GFLOP/s':>8} {'temp MiB':>9}"
    if impl != "jaxops" and "jaxops" in args.impls:
      header += f" {'x':>6}"
  print(header)
  for shape_text in args.shapes:
    shape = tuple(int(s) for s in shape_text.split("x"))
    B, S, N, H = shape
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      keys = jax.random.split(jax.random.key(0), 4)
      q, k, v, dout = (jax.random.normal(key, (B, S, N, H), jnp.float32).astype(dtype)
                       for key in keys)
      for mask in args.masks:
        causal = mask == "causal"
        for pass_name in args.passes:
          backward = pass_name == "fwd+bwd"
          line = f"{shape_text:<14} {dtype_name:<9} {mask:<7} {pass_name:<8}"
          fns = []
          for impl in args.impls:
            fn = _IMPLS[impl]
            if backward:
              def f(q, k, v, dout, fn=fn):
                out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
                return vjp(dout)
            else:
              f = lambda q, k, v, dout, fn=fn: fn(q, k, v, causal)
            fns.append(f)
          results = dict(zip(args.impls, _time_interleaved(fns, (q, k, v, dout), args.runs)))
          for impl in args.impls:
            ms, temp_bytes = results[impl]
            temp = "-" if temp_bytes is None else f"{temp_bytes / 2**20:.1f}"
            line += f" {ms:>11.2f} {_gflops(shape, causal, backward, ms):>8.1f} {temp:>9}"
            if impl != "jaxops" and "jaxops" in results:
              line += f" {ms / results['jaxops'][0]:>5.1f}x"
          print(line, flush=True)
  return 0
