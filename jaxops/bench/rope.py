"""``python -m jaxops.bench rope``: rotary position embedding vs the jnp reference.

For each style, dtype and shape [batch, seq, heads, head_dim]: forward, and
forward+backward (``jax.vjp`` with a random cotangent), for jaxops and for
``implementation="xla"`` (XLA's compiled jnp reference) in the same process.

Bytes each pass must move: fwd x read, y written; fwd+bwd (rope is linear: the
backward needs no x) dy read, dx written; 2 x-shaped arrays each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

_STYLES = ["neox", "gptj"]
PRESETS = {
    "cpu": {"styles": _STYLES, "shapes": ["4x2048x32x128"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 7},
    "gpu": {"styles": _STYLES, "shapes": ["8x4096x32x128"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"styles": ["neox"], "dtypes": ["float32"], "passes": ["fwd"]},
         "gpu": {"styles": ["neox"], "dtypes": ["bfloat16"], "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("rope", __doc__, PRESETS, QUICK)
  parser.add_argument("--styles", nargs="+", default=None, choices=_STYLES)
  parser.add_argument("--shapes", nargs="+", default=None, help="batch x seq x heads x head_dim")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=["fwd", "fwd+bwd"])
  parser.add_argument("--rotary-dim", type=int, default=None)
  parser.add_argument("--per-batch-positions", action="store_true",
                      help="positions [batch, seq] instead of [seq]")
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("rope", args, argv, [("style", 6), ("shape", 15), ("dtype", 9),
                                           ("pass", 8)], ["jaxops", "xla"])
  reporter.header("GB/s counts the 2 x-shaped arrays each pass must move")
  for style in args.styles:
    for shape_text in args.shapes:
      shape = options.dims(shape_text)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
        dy = random_like(shape, dtype)
        positions = jnp.arange(shape[1], dtype=jnp.int32)
        if args.per_batch_positions:
          positions = jnp.broadcast_to(positions, shape[:2]) + jnp.arange(shape[0])[:, None]

        def fn(x, impl):
          return jaxops.rope(x, positions, style=style, rotary_dim=args.rotary_dim,
                             implementation=impl)

        for pass_name in args.passes:
          timings = time_implementations(
              jaxops_and_reference(lambda impl: forward_or_backward(pass_name,
                                                                    lambda x: fn(x, impl))),
              x, dy, runs=args.runs)
          reporter.add([style, shape_text, dtype_name, pass_name],
                       Result(f"rope {style}", shape_text, dtype_name, pass_name, timings,
                              moved(2 * x.size * dtype.itemsize)))
  return 0
