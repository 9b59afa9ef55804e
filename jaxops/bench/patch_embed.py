"""``python -m jaxops.bench patch_embed``: ViT patch embedding vs lax.conv_general_dilated.

For each image batch, patch size, embedding width and dtype: forward (patch
GEMM + bias + class token + positional embedding), and forward+backward (a VJP
w.r.t. images, kernel, bias, pos_embed and cls_token), for jaxops and for
``implementation="xla"`` (the stride = kernel VALID convolution plus the
separate adds, under XLA) in the same process. Prints median ms, effective
GB/s (images, kernel and tokens once forward; plus the cotangent read and the
gradients written backward) and the speed-up.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla)


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench patch_embed", description=__doc__)
  parser.add_argument("--images", nargs="+", default=["32x224x224x3"], help="B x H x W x C")
  parser.add_argument("--patch", type=int, default=16)
  parser.add_argument("--dim", type=int, default=768)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"],
                      choices=["fwd", "fwd+bwd"], help="e.g. --passes fwd: the forward alone")
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  p, d = args.patch, args.dim
  print_table_header(f"median of {args.runs} runs after warm-up; p={p}, D={d}, with bias, "
                     "class token and positional embedding",
                     [("images", 13), ("dtype", 9), ("pass", 8)])
  for images_text in args.images:
    b, h, w, c = (int(s) for s in images_text.split("x"))
    tokens = (h // p) * (w // p) + 1
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      keys = jax.random.split(jax.random.key(0), 5)
      shapes = [(b, h, w, c), (p, p, c, d), (d,), (tokens, d), (d,)]
      operands = [jax.random.normal(k, s, jnp.float32).astype(dtype)
                  for k, s in zip(keys, shapes)]
      dy = jnp.ones((b, tokens, d), dtype)
      size = lambda *arrays: sum(a.size for a in arrays) * dtype.itemsize
      moved = {"fwd": size(*operands, dy), "fwd+bwd": 2 * size(*operands) + 2 * size(dy)}
      for pass_name in args.passes:
        ours, xla = time_against_xla(
            lambda impl: forward_or_backward(
                pass_name, lambda i, k, bias, pos, cls: jaxops.patch_embed(
                    i, k, bias, patch_size=p, pos_embed=pos, cls_token=cls,
                    implementation=impl)),
            *operands, dy, runs=args.runs)
        print(f"{images_text:<13} {dtype_name:<9} {pass_name:<8} "
              f"{comparison_columns(ours, xla, moved[pass_name])}", flush=True)
  return 0
