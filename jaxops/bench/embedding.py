"""``python -m jaxops.bench embedding``: embedding lookup and its gradient vs the jnp reference.

For each table shape [vocab, dim], token count and dtype: forward (gather), and
forward+backward (a VJP w.r.t. the table: a scatter-add that writes the whole
table gradient), for jaxops and for ``implementation="xla"`` in the same
process. Prints median ms, effective GB/s (rows read and written forward; plus
the cotangent read and the table gradient written backward) and the speed-up.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla)


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench embedding", description=__doc__)
  parser.add_argument("--tables", nargs="+", default=["32000x2048"], help="vocab x dim")
  parser.add_argument("--tokens", nargs="+", default=["4x2048"], help="ids shape, e.g. 4x2048")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; ids uniform over the vocabulary",
                     [("table", 11), ("ids", 9), ("dtype", 9), ("pass", 8)])
  for table_text in args.tables:
    vocab, dim = (int(s) for s in table_text.split("x"))
    for ids_text in args.tokens:
      ids_shape = tuple(int(s) for s in ids_text.split("x"))
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        table = jax.random.normal(jax.random.key(0), (vocab, dim), jnp.float32).astype(dtype)
        ids = jax.random.randint(jax.random.key(1), ids_shape, 0, vocab, jnp.int32)
        dout = jnp.ones(ids_shape + (dim,), dtype)
        rows_bytes = dout.size * dtype.itemsize
        moved = {"fwd": 2 * rows_bytes, "fwd+bwd": 3 * rows_bytes + table.size * dtype.itemsize}
        for pass_name in ("fwd", "fwd+bwd"):
          # The gradient is the table's only (ids are integers).
          ours, xla = time_against_xla(
              lambda impl: forward_or_backward(
                  pass_name, lambda t, i: jaxops.embedding(t, i, implementation=impl), wrt=(0,)),
              table, ids, dout, runs=args.runs)
          print(f"{table_text:<11} {ids_text:<9} {dtype_name:<9} {pass_name:<8} "
                f"{comparison_columns(ours, xla, moved[pass_name])}", flush=True)
  return 0
