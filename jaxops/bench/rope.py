"""``python -m jaxops.bench rope``: rotary position embedding vs the jnp reference.

For each style, dtype and shape [batch, seq, heads, head_dim]: forward, and
forward+backward (a VJP with a given cotangent), for jaxops and for
``implementation="xla"`` in the same process. Prints median ms, effective GB/s
(x read once and y written once per pass) and the speed-up.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla)


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench rope", description=__doc__)
  parser.add_argument("--styles", nargs="+", default=["neox", "gptj"], choices=["neox", "gptj"])
  parser.add_argument("--shapes", nargs="+", default=["4x2048x32x128"],
                      help="batch x seq x heads x head_dim")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--rotary-dim", type=int, default=None)
  parser.add_argument("--per-batch-positions", action="store_true",
                      help="positions [batch, seq] instead of [seq]")
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; GB/s counts x read and y "
                     "written once per pass",
                     [("style", 6), ("shape", 15), ("dtype", 9), ("pass", 8)])
  for style in args.styles:
    for shape_text in args.shapes:
      shape = tuple(int(s) for s in shape_text.split("x"))
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
        dy = jnp.ones(shape, dtype)
        positions = jnp.arange(shape[1], dtype=jnp.int32)
        if args.per_batch_positions:
          positions = jnp.broadcast_to(positions, shape[:2]) + jnp.arange(shape[0])[:, None]
        array_bytes = x.size * dtype.itemsize

        def fn(x, impl):
          return jaxops.rope(x, positions, style=style, rotary_dim=args.rotary_dim,
                             implementation=impl)

        for pass_name, arrays in (("fwd", 2), ("fwd+bwd", 2)):
          ours, xla = time_against_xla(
              lambda impl: forward_or_backward(pass_name, lambda x: fn(x, impl)),
              x, dy, runs=args.runs)
          print(f"{style:<6} {shape_text:<15} {dtype_name:<9} {pass_name:<8} "
                f"{comparison_columns(ours, xla, arrays * array_bytes)}", flush=True)
  return 0
