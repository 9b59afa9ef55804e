"""``python -m jaxops.bench softmax``: the softmax family vs the jnp reference.

For each op, dtype and shape: forward, forward+backward (a VJP with a given
cotangent) and jvp (the output and its tangent), for jaxops and for
``implementation="xla"`` in the same process.
``masked`` is softmax with a boolean mask over the last two axes (a causal
pattern, broadcast over the leading axes, as attention uses it); ``causal`` is
causal_softmax on the same shape, which needs no mask. Prints median ms,
effective GB/s (each x-shaped array an ideal fused kernel must move, counted
once: x and y forward; x, y, dy, dx forward+backward; x, dx, y, dy jvp) and
the speed-up.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops import reference
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla)

_OPS = {
    "softmax": lambda x, mask, impl: jaxops.softmax(x, implementation=impl),
    "log_softmax": lambda x, mask, impl: jaxops.log_softmax(x, implementation=impl),
    "masked": lambda x, mask, impl: jaxops.softmax(x, where=mask, implementation=impl),
    "causal": lambda x, mask, impl: jaxops.causal_softmax(x, implementation=impl),
}
_ARRAYS = {"fwd": 2, "fwd+bwd": 4, "jvp": 4}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench softmax", description=__doc__)
  parser.add_argument("--ops", nargs="+", default=list(_OPS), choices=list(_OPS))
  parser.add_argument("--shapes", nargs="+", default=["8192x4096", "32x1024x1024"],
                      help="axes joined by x; softmax over the last, e.g. 8192x4096")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd", "jvp"],
                      choices=["fwd", "fwd+bwd", "jvp"])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; GB/s counts each x-shaped array "
                     "moved once (x, y forward; x, y, dy, dx forward+backward and jvp)",
                     [("op", 12), ("shape", 13), ("dtype", 9), ("pass", 8)])
  for op in args.ops:
    fn = _OPS[op]
    for shape_text in args.shapes:
      shape = tuple(int(s) for s in shape_text.split("x"))
      if len(shape) < 2 and op in ("masked", "causal"):
        continue
      mask = reference.causal_mask(shape[-2], shape[-1]) if len(shape) >= 2 else None
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        x = (3.0 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)
        dy = jnp.ones(shape, dtype)
        array_bytes = x.size * dtype.itemsize
        for pass_name in args.passes:
          arrays = _ARRAYS[pass_name]

          def make(impl):
            of_x = lambda x: fn(x, mask, impl)
            if pass_name == "jvp":
              return lambda x, dy: jax.jvp(of_x, (x,), (dy,))
            return forward_or_backward(pass_name, of_x)

          ours, xla = time_against_xla(make, x, dy, runs=args.runs)
          print(f"{op:<12} {shape_text:<13} {dtype_name:<9} {pass_name:<8} "
                f"{comparison_columns(ours, xla, arrays * array_bytes)}", flush=True)
  return 0
