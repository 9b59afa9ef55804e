"""``python -m jaxops.bench activations``: gelu, silu, swiglu, geglu vs the jnp reference.

For each op, dtype and shape: forward, and forward+backward (``jax.vjp`` with a
random cotangent), for jaxops and for ``implementation="xla"`` (XLA's compiled
jnp reference) in the same process.

Bytes each pass must move (x-shaped arrays, each once):
  gelu, gelu_erf, silu: fwd x, y (2 arrays); fwd+bwd x, dy, dx (3).
  swiglu, geglu (gate x, up u): fwd x, u, y (3); fwd+bwd x, u, dy, dx, du (5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

# op -> (function of (x, up, implementation), whether it is gated: takes up)
_OPS = {
    "gelu": (lambda x, u, impl: jaxops.gelu(x, implementation=impl), False),
    "gelu_erf": (lambda x, u, impl: jaxops.gelu(x, False, implementation=impl), False),
    "silu": (lambda x, u, impl: jaxops.silu(x, implementation=impl), False),
    "swiglu": (lambda x, u, impl: jaxops.swiglu(x, u, implementation=impl), True),
    "geglu": (lambda x, u, impl: jaxops.geglu(x, u, implementation=impl), True),
}
# x-shaped arrays each pass moves, by whether the op is gated
_ARRAYS = {False: {"fwd": 2, "fwd+bwd": 3}, True: {"fwd": 3, "fwd+bwd": 5}}
_DEFAULT_OPS = ["gelu", "silu", "swiglu", "geglu"]
PRESETS = {
    "cpu": {"ops": _DEFAULT_OPS, "shapes": ["8192x4096"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 7},
    "gpu": {"ops": _DEFAULT_OPS, "shapes": ["8192x4096", "32768x8192"], "dtypes": ["bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"ops": ["gelu"], "dtypes": ["float32"], "passes": ["fwd"]},
         "gpu": {"ops": ["gelu"], "shapes": ["8192x4096"], "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("activations", __doc__, PRESETS, QUICK)
  parser.add_argument("--ops", nargs="+", default=None, choices=list(_OPS))
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="dimensions joined by x, e.g. 8192x4096")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=["fwd", "fwd+bwd"])
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("activations", args, argv, [("op", 9), ("shape", 11), ("dtype", 9),
                                                  ("pass", 8)], ["jaxops", "xla"])
  reporter.header("GB/s counts each x-shaped array the pass must move once")
  for op in args.ops:
    fn, gated = _OPS[op]
    for shape_text in args.shapes:
      shape = options.dims(shape_text)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        keys = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
        u = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
        dy = random_like(shape, dtype)
        for pass_name in args.passes:
          # An ungated op's gradient is x's alone (not a zero one for the unused u).
          timings = time_implementations(
              jaxops_and_reference(lambda impl: forward_or_backward(
                  pass_name, lambda x, u: fn(x, u, impl), wrt=None if gated else (0,))),
              x, u, dy, runs=args.runs)
          reporter.add([op, shape_text, dtype_name, pass_name],
                       Result(op, shape_text, dtype_name, pass_name, timings,
                              moved(_ARRAYS[gated][pass_name] * x.size * dtype.itemsize)))
  return 0
