"""``python -m jaxops.bench attention``: jaxops.attention vs jax.nn.dot_product_attention and
the jnp composition.

For each shape (B, S, N, H) (self-attention, T = S, K = N), dtype and mask
(full, causal): forward, and forward+backward (a VJP with respect to q, k, v),
for each implementation in the same process. Prints median ms, GFLOP/s and
XLA's peak temporary memory for the compiled program. Flops: 4*B*N*T*S*H
forward, half when causal; the backward counts 2.5x the forward.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops import reference
from jaxops.bench.timing import machine_line, time_jitted

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


def _gflops(shape, causal, backward, ms):
  B, S, N, H = shape
  flops = 4.0 * B * N * S * S * H * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
  return flops / (ms * 1e-3) / 1e9


def main(argv=()):
  args = _parse(argv)
  print(f"# {machine_line()}")
  print(f"# median of {args.runs} runs after warm-up; GFLOP/s = 4*B*N*T*S*H (x0.5 causal, x3.5 "
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
          ours_ms = None
          for impl in args.impls:
            fn = _IMPLS[impl]
            if backward:
              def f(q, k, v, dout, fn=fn):
                out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
                return vjp(dout)
            else:
              f = lambda q, k, v, dout, fn=fn: fn(q, k, v, causal)
            t = time_jitted(f, q, k, v, dout, runs=args.runs, warmup=1)
            temp = "-" if t.temp_bytes is None else f"{t.temp_bytes / 2**20:.1f}"
            line += (f" {t.median_ms:>11.2f} {_gflops(shape, causal, backward, t.median_ms):>8.1f}"
                     f" {temp:>9}")
            if impl == "jaxops":
              ours_ms = t.median_ms
            elif ours_ms is not None:
              line += f" {t.median_ms / ours_ms:>5.1f}x"
          print(line, flush=True)
  return 0
