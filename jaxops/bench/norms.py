"""``python -m jaxops.bench norms``: layer_norm, rms_norm, add_rms_norm vs the jnp reference.

For each op, dtype and shape: forward, forward+backward (``jax.vjp`` with a
random cotangent) and jvp (forward mode: the output and its tangent for a
tangent of each x-shaped input), for jaxops and for ``implementation="xla"``
(XLA's compiled jnp reference) in the same process.

Bytes each pass must move (an x-shaped array read or written once counts
once; the weight and bias are negligible):
  layer_norm, rms_norm: fwd x, y (2 arrays); fwd+bwd x, dy, dx (3); jvp x, its
  tangent, y, the output tangent (4).
  add_rms_norm (x, residual -> y, x + residual): fwd and fwd don. (the residual
  donated: the sum written over it) x, r, y, sum (4); fwd+bwd x, r, dy, dx, dr
  (5); jvp x, r, x's tangent (r's is r itself), y, sum and their tangents (7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

# op -> (function, x-shaped arrays each pass moves)
_OPS = {
    "layer_norm": (lambda x, r, w, b, impl: jaxops.layer_norm(x, w, b, implementation=impl),
                   {"fwd": 2, "fwd+bwd": 3, "jvp": 4}),
    "rms_norm": (lambda x, r, w, b, impl: jaxops.rms_norm(x, w, implementation=impl),
                 {"fwd": 2, "fwd+bwd": 3, "jvp": 4}),
    "add_rms_norm": (lambda x, r, w, b, impl: jaxops.add_rms_norm(x, r, w, implementation=impl),
                     {"fwd": 4, "fwd don.": 4, "fwd+bwd": 5, "jvp": 7}),
}
_PASSES = ["fwd", "fwd don.", "fwd+bwd", "jvp"]
PRESETS = {
    "cpu": {"ops": list(_OPS), "shapes": ["8192x4096", "32768x1024"],
            "dtypes": ["float32", "bfloat16"], "passes": _PASSES, "runs": 7},
    "gpu": {"ops": list(_OPS), "shapes": ["8192x4096", "32768x8192"],
            "dtypes": ["float32", "bfloat16"], "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"ops": ["rms_norm"], "shapes": ["8192x4096"], "dtypes": ["float32"],
                 "passes": ["fwd"]},
         "gpu": {"ops": ["rms_norm"], "shapes": ["8192x4096"], "dtypes": ["bfloat16"],
                 "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("norms", __doc__, PRESETS, QUICK)
  parser.add_argument("--ops", nargs="+", default=None, choices=list(_OPS))
  parser.add_argument("--shapes", nargs="+", default=None, help="rows x cols, e.g. 8192x4096")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=_PASSES,
                      help="'fwd don.': add_rms_norm with the residual donated")
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("norms", args, argv, [("op", 13), ("shape", 11), ("dtype", 9),
                                            ("pass", 8)], ["jaxops", "xla"])
  reporter.header("GB/s counts each x-shaped array the pass must move once")
  for op in args.ops:
    fn, arrays_by_pass = _OPS[op]
    for shape_text in args.shapes:
      shape = options.dims(shape_text)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        keys = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
        r = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
        w = (1.0 + 0.1 * jax.random.normal(keys[2], shape[-1:])).astype(dtype)
        b = (0.1 * jax.random.normal(keys[3], shape[-1:])).astype(dtype)
        dy = random_like(shape, dtype)
        for pass_name, arrays in arrays_by_pass.items():
          if pass_name not in args.passes:
            continue
          # The sum is written over the residual when the caller donates it.
          donate = (1,) if pass_name == "fwd don." else ()

          def make(impl):
            if pass_name == "jvp":
              # x's tangent is dy, the residual's r: arrays already in memory.
              return lambda x, r, w, b, dy: jax.jvp(lambda x, r: fn(x, r, w, b, impl),
                                                    (x, r), (dy, r))
            return forward_or_backward(pass_name, lambda x, r, w, b: fn(x, r, w, b, impl))

          timings = time_implementations(jaxops_and_reference(make),
                                         x, r, w, b, dy, runs=args.runs, donate_argnums=donate)
          reporter.add([op, shape_text, dtype_name, pass_name],
                       Result(op, shape_text, dtype_name, pass_name, timings,
                              moved(arrays * x.size * dtype.itemsize)))
  return 0
