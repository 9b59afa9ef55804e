"""``python -m jaxops.bench sampling``: jaxops.sample vs the jnp reference.

For each case (top-k + top-p, top-p alone, greedy) and dtype: jaxops' kernel
and ``implementation="xla"`` (the jnp reference: ``lax.top_k`` when top_k is a
Python int, else a full sort, and the inverse-CDF draw) in the same process,
and a typical jnp sampler as a second peer ("typical": ``lax.top_k`` or a full
sort for top-p, then ``jax.random.categorical``, which draws one Gumbel per
token). Bytes a call must move: the logits read once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import jaxops_and_reference, time_implementations

_CASES = {
    "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9),
    "top_p=0.9": dict(top_p=0.9),
    "greedy": dict(temperature=0.0),
}
PRESETS = {
    "cpu": {"cases": list(_CASES), "shapes": ["64x128256"], "dtypes": ["float32", "bfloat16"],
            "runs": 7},
    "gpu": {"cases": list(_CASES), "shapes": ["256x128256"], "dtypes": ["float32", "bfloat16"],
            "runs": 3},
}
QUICK = {"cpu": {"cases": ["top_k=50,top_p=0.9"], "dtypes": ["float32"]},
         "gpu": {"cases": ["top_k=50,top_p=0.9"], "dtypes": ["bfloat16"]}}


def categorical_sampler(key, logits, *, temperature=1.0, top_k=None, top_p=None):
  """The usual jnp sampler: filter with top_k / a sort, then jax.random.categorical."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  z = logits.astype(jnp.float32) / temperature
  if top_k is not None:
    values, indices = jax.lax.top_k(z, top_k)
  else:
    values, indices = jax.lax.top_k(z, z.shape[-1])
  if top_p is not None:
    p = jax.nn.softmax(values, axis=-1)
    keep = (jnp.cumsum(p, axis=-1) - p) < top_p
    values = jnp.where(keep, values, -jnp.inf)
  choice = jax.random.categorical(key, values, axis=-1)
  return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def parse(argv):
  parser = options.parser_for("sampling", __doc__, PRESETS, QUICK)
  parser.add_argument("--cases", nargs="+", default=None, choices=list(_CASES))
  parser.add_argument("--shapes", nargs="+", default=None, help="batch x vocab")
  parser.add_argument("--dtypes", nargs="+", default=None)
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("sampling", args, argv, [("case", 19), ("shape", 10), ("dtype", 9)],
                      ["jaxops", "xla", "typical"])
  reporter.header("GB/s counts the logits read once; 'typical' = lax.top_k/sort + "
                  "jax.random.categorical")
  for case in args.cases:
    kwargs = _CASES[case]
    for shape_text in args.shapes:
      shape = options.dims(shape_text)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        logits = (3.0 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)
        fns = jaxops_and_reference(
            lambda impl: lambda k, x: jaxops.sample(k, x, **kwargs, implementation=impl))
        fns["typical"] = lambda k, x: categorical_sampler(k, x, **kwargs)
        timings = time_implementations(fns, jax.random.key(1), logits, runs=args.runs)
        reporter.add([case, shape_text, dtype_name],
                     Result(f"sample {case}", shape_text, dtype_name, "fwd", timings,
                            moved(logits.size * dtype.itemsize)))
  return 0
