"""``python -m jaxops.bench embedding``: embedding lookup and its gradient vs the jnp reference.

For each table shape [vocab, dim], token count and dtype: forward (gather), and
forward+backward (``jax.vjp`` with respect to the table with a random
cotangent: a scatter-add that writes the whole table gradient), for jaxops and
for ``implementation="xla"`` (XLA's compiled jnp reference) in the same
process. Ids are uniform over the vocabulary.

Bytes each pass must move (rows = [*ids, dim] in the table's dtype): fwd the
rows read from the table and written out (2 x rows); fwd+bwd the cotangent's
rows read and the whole table gradient written (rows + table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

PRESETS = {
    "cpu": {"tables": ["32000x2048"], "tokens": ["4x2048"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 7},
    "gpu": {"tables": ["128256x4096"], "tokens": ["8x4096"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"dtypes": ["float32"], "passes": ["fwd"]},
         "gpu": {"dtypes": ["bfloat16"], "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("embedding", __doc__, PRESETS, QUICK)
  parser.add_argument("--tables", nargs="+", default=None, help="vocab x dim")
  parser.add_argument("--tokens", nargs="+", default=None, help="ids shape, e.g. 4x2048")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=["fwd", "fwd+bwd"])
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("embedding", args, argv, [("table", 11), ("ids", 9), ("dtype", 9),
                                                ("pass", 8)], ["jaxops", "xla"])
  reporter.header("GB/s counts the rows (and, backward, the table gradient) each pass must move")
  for table_text in args.tables:
    vocab, dim = options.dims(table_text)
    for ids_text in args.tokens:
      ids_shape = options.dims(ids_text)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        table = jax.random.normal(jax.random.key(0), (vocab, dim), jnp.float32).astype(dtype)
        ids = jax.random.randint(jax.random.key(1), ids_shape, 0, vocab, jnp.int32)
        dout = random_like(ids_shape + (dim,), dtype)
        rows_bytes = dout.size * dtype.itemsize
        moved_bytes = {"fwd": 2 * rows_bytes, "fwd+bwd": rows_bytes + table.size * dtype.itemsize}
        for pass_name in args.passes:
          # The gradient is the table's only (ids are integers).
          timings = time_implementations(
              jaxops_and_reference(lambda impl: forward_or_backward(
                  pass_name, lambda t, i: jaxops.embedding(t, i, implementation=impl),
                  wrt=(0,))),
              table, ids, dout, runs=args.runs)
          reporter.add([table_text, ids_text, dtype_name, pass_name],
                       Result("embedding", f"{table_text} ids {ids_text}", dtype_name, pass_name,
                              timings, moved(moved_bytes[pass_name])))
  return 0
