"""``python -m jaxops.bench sampling``: jaxops.sample vs the jnp reference.

For each case (top-k + top-p, top-p alone, greedy) and dtype: jaxops' kernel
and ``implementation="xla"`` (the jnp reference: ``lax.top_k`` when top_k is a
Python int, else a full sort, and the inverse-CDF draw) in the same process,
and a typical jnp sampler for scale (``lax.top_k`` or a full sort for top-p,
then ``jax.random.categorical``, which draws one Gumbel per token). GB/s counts
the logits read once.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, print_table_header, time_against_xla,
                                  time_jitted)

_CASES = {
    "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9),
    "top_p=0.9": dict(top_p=0.9),
    "greedy": dict(temperature=0.0),
}


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


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench sampling", description=__doc__)
  parser.add_argument("--cases", nargs="+", default=list(_CASES), choices=list(_CASES))
  parser.add_argument("--shapes", nargs="+", default=["64x128256"], help="batch x vocab")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; 'typical' = lax.top_k/sort + "
                     "jax.random.categorical",
                     [("case", 19), ("shape", 10), ("dtype", 9)])
  for case in args.cases:
    kwargs = _CASES[case]
    for shape_text in args.shapes:
      shape = tuple(int(s) for s in shape_text.split("x"))
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        logits = (3.0 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)
        key = jax.random.key(1)
        make = lambda impl: lambda k, x: jaxops.sample(k, x, **kwargs, implementation=impl)
        ours, xla = time_against_xla(make, key, logits, runs=args.runs)
        typical = time_jitted(lambda k, x: categorical_sampler(k, x, **kwargs), key, logits,
                              runs=args.runs)
        print(f"{case:<19} {shape_text:<10} {dtype_name:<9} "
              f"{comparison_columns(ours, xla, logits.size * dtype.itemsize)} "
              f"typical {typical.median_ms:.2f} ms ({typical.median_ms / ours.median_ms:.2f}x)",
              flush=True)
  return 0
