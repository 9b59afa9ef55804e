"""``python -m jaxops.bench softmax``: the softmax family vs the jnp reference.

For each op, dtype and shape: forward, forward+backward (``jax.vjp`` with a
random cotangent) and jvp (the output and its tangent), for jaxops and for
``implementation="xla"`` (XLA's compiled jnp reference) in the same process.
``masked`` is softmax with a boolean mask over the last two axes (a causal
pattern, broadcast over the leading axes, as attention uses it); ``causal`` is
causal_softmax on the same shape, which needs no mask.

Bytes each pass must move, for every op (x-shaped arrays, each once; the
mask, shared by the leading axes, is not counted): fwd x, y (2 arrays);
fwd+bwd x, dy, dx (3); jvp x, its tangent, y, the output tangent (4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops import reference
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

_OPS = {
    "softmax": lambda x, mask, impl: jaxops.softmax(x, implementation=impl),
    "log_softmax": lambda x, mask, impl: jaxops.log_softmax(x, implementation=impl),
    "masked": lambda x, mask, impl: jaxops.softmax(x, where=mask, implementation=impl),
    "causal": lambda x, mask, impl: jaxops.causal_softmax(x, implementation=impl),
}
_ARRAYS = {"fwd": 2, "fwd+bwd": 3, "jvp": 4}
PRESETS = {
    "cpu": {"ops": list(_OPS), "shapes": ["8192x4096", "32x1024x1024"],
            "dtypes": ["float32", "bfloat16"], "passes": list(_ARRAYS), "runs": 7},
    "gpu": {"ops": ["softmax", "causal"], "shapes": ["8192x4096", "32768x8192"],
            "dtypes": ["float32", "bfloat16"], "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"ops": ["softmax"], "shapes": ["8192x4096"], "dtypes": ["float32"],
                 "passes": ["fwd"]},
         "gpu": {"ops": ["softmax"], "shapes": ["8192x4096"], "dtypes": ["bfloat16"],
                 "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("softmax", __doc__, PRESETS, QUICK)
  parser.add_argument("--ops", nargs="+", default=None, choices=list(_OPS))
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="axes joined by x; softmax over the last, e.g. 8192x4096")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=list(_ARRAYS))
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("softmax", args, argv, [("op", 12), ("shape", 13), ("dtype", 9),
                                              ("pass", 8)], ["jaxops", "xla"])
  reporter.header("GB/s counts each x-shaped array the pass must move once")
  for op in args.ops:
    fn = _OPS[op]
    for shape_text in args.shapes:
      shape = options.dims(shape_text)
      if len(shape) < 2 and op in ("masked", "causal"):
        continue
      mask = reference.causal_mask(shape[-2], shape[-1]) if len(shape) >= 2 else None
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        x = (3.0 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)
        dy = random_like(shape, dtype)
        for pass_name in args.passes:

          def make(impl):
            of_x = lambda x: fn(x, mask, impl)
            if pass_name == "jvp":
              return lambda x, dy: jax.jvp(of_x, (x,), (dy,))
            return forward_or_backward(pass_name, of_x)

          timings = time_implementations(jaxops_and_reference(make), x, dy,
                                         runs=args.runs)
          reporter.add([op, shape_text, dtype_name, pass_name],
                       Result(op, shape_text, dtype_name, pass_name, timings,
                              moved(_ARRAYS[pass_name] * x.size * dtype.itemsize)))
  return 0
