"""``python -m jaxops.bench activations``: gelu, silu, swiglu, geglu vs the jnp reference.

For each op, dtype and shape: forward, and forward+backward (a VJP with a given
cotangent), for jaxops and for ``implementation="xla"`` in the same process.
Prints median ms, effective GB/s (each input read once, each output written
once) and the speed-up.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla)

# op -> (function of (x, up, implementation), x-shaped arrays moved forward,
#        x-shaped arrays moved forward+backward)
_OPS = {
    "gelu": (lambda x, u, impl: jaxops.gelu(x, implementation=impl), 2, 3),
    "gelu_erf": (lambda x, u, impl: jaxops.gelu(x, False, implementation=impl), 2, 3),
    "silu": (lambda x, u, impl: jaxops.silu(x, implementation=impl), 2, 3),
    "swiglu": (lambda x, u, impl: jaxops.swiglu(x, u, implementation=impl), 3, 5),
    "geglu": (lambda x, u, impl: jaxops.geglu(x, u, implementation=impl), 3, 5),
}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench activations", description=__doc__)
  parser.add_argument("--ops", nargs="+", default=["gelu", "silu", "swiglu", "geglu"],
                      choices=list(_OPS))
  parser.add_argument("--shapes", nargs="+", default=["8192x4096"],
                      help="dimensions joined by x, e.g. 8192x4096")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; GB/s counts each input read "
                     "once and each output written once",
                     [("op", 9), ("shape", 11), ("dtype", 9), ("pass", 8)])
  for op in args.ops:
    fn, fwd_arrays, fwd_bwd_arrays = _OPS[op]
    for shape_text in args.shapes:
      shape = tuple(int(s) for s in shape_text.split("x"))
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        keys = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
        u = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
        dy = jnp.ones(shape, dtype)
        array_bytes = x.size * dtype.itemsize
        for pass_name, arrays in (("fwd", fwd_arrays), ("fwd+bwd", fwd_bwd_arrays)):
          ours, xla = time_against_xla(
              lambda impl: forward_or_backward(pass_name, lambda x, u: fn(x, u, impl)),
              x, u, dy, runs=args.runs)
          print(f"{op:<9} {shape_text:<11} {dtype_name:<9} {pass_name:<8} "
                f"{comparison_columns(ours, xla, arrays * array_bytes)}", flush=True)
  return 0
