"""``python -m jaxops.bench norms``: layer_norm, rms_norm, add_rms_norm vs the jnp reference.

For each op, dtype and shape: forward, forward+backward (a VJP with a given
cotangent) and jvp (forward mode: the output and its tangent for a tangent of
each x-shaped input), for jaxops and for ``implementation="xla"`` in the same
process. Prints median ms, effective GB/s (the bytes an ideal fused kernel
must move: each input read once, each output written once) and the speed-up.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla)

# op -> (function, number of x-shaped inputs, x-shaped arrays moved forward,
#        forward+backward, and jvp)
_OPS = {
    "layer_norm": (lambda x, r, w, b, impl: jaxops.layer_norm(x, w, b, implementation=impl),
                   1, 2, 5, 4),
    "rms_norm": (lambda x, r, w, b, impl: jaxops.rms_norm(x, w, implementation=impl), 1, 2, 5, 4),
    "add_rms_norm": (lambda x, r, w, b, impl: jaxops.add_rms_norm(x, r, w, implementation=impl),
                     2, 4, 8, 8),
}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench norms", description=__doc__)
  parser.add_argument("--ops", nargs="+", default=list(_OPS), choices=list(_OPS))
  parser.add_argument("--shapes", nargs="+", default=["8192x4096", "32768x1024"],
                      help="rows x cols, e.g. 8192x4096")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd don.", "fwd+bwd", "jvp"],
                      choices=["fwd", "fwd don.", "fwd+bwd", "jvp"],
                      help="'fwd don.': add_rms_norm with the residual donated")
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; GB/s counts each x-shaped input "
                     "read once and each output written once",
                     [("op", 13), ("shape", 11), ("dtype", 9), ("pass", 8)])
  for op in args.ops:
    fn, n_inputs, fwd_arrays, fwd_bwd_arrays, jvp_arrays = _OPS[op]
    for shape_text in args.shapes:
      shape = tuple(int(s) for s in shape_text.split("x"))
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        keys = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
        r = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
        w = (1.0 + 0.1 * jax.random.normal(keys[2], shape[-1:])).astype(dtype)
        b = (0.1 * jax.random.normal(keys[3], shape[-1:])).astype(dtype)
        dy = jnp.ones(shape, dtype)
        array_bytes = x.size * dtype.itemsize
        passes = [("fwd", fwd_arrays, ()), ("fwd+bwd", fwd_bwd_arrays, ()),
                  ("jvp", jvp_arrays, ())]
        if n_inputs == 2:
          # The sum is written over the residual when the caller donates it.
          passes.insert(1, ("fwd don.", fwd_arrays, (1,)))
        for pass_name, arrays, donate in passes:
          if pass_name not in args.passes:
            continue

          def make(impl):
            if pass_name == "jvp":
              # x's tangent is dy, the residual's r: arrays already in memory.
              return lambda x, r, w, b, dy: jax.jvp(lambda x, r: fn(x, r, w, b, impl),
                                                    (x, r), (dy, r))
            return forward_or_backward(pass_name, lambda x, r, w, b: fn(x, r, w, b, impl))

          ours, xla = time_against_xla(make, x, r, w, b, dy, runs=args.runs,
                                       donate_argnums=donate)
          print(f"{op:<13} {shape_text:<11} {dtype_name:<9} {pass_name:<8} "
                f"{comparison_columns(ours, xla, arrays * array_bytes)}", flush=True)
  return 0
