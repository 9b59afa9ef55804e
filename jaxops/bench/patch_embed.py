"""``python -m jaxops.bench patch_embed``: ViT patch embedding vs lax.conv_general_dilated.

For each image batch, patch size, embedding width and dtype: forward (patch
GEMM + bias + class token + positional embedding), and forward+backward
(``jax.vjp`` with respect to images, kernel, bias, pos_embed and cls_token,
with a random cotangent), for jaxops and for ``implementation="xla"`` (the
stride = kernel VALID convolution plus the separate adds, under XLA) in the
same process.

Compute-bound (a GEMM of K = p * p * C): forward 2 * B * patches * K * D flops;
forward+backward three such products (the output, the images' and the
kernel's gradients). TFLOP/s against the bfloat16 matmul rate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, computed
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

PRESETS = {
    "cpu": {"images": ["32x224x224x3"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 7},
    "gpu": {"images": ["256x224x224x3"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"dtypes": ["float32"], "passes": ["fwd"]},
         "gpu": {"dtypes": ["bfloat16"], "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("patch_embed", __doc__, PRESETS, QUICK)
  parser.add_argument("--images", nargs="+", default=None, help="B x H x W x C")
  parser.add_argument("--patch", type=int, default=16)
  parser.add_argument("--dim", type=int, default=768)
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=["fwd", "fwd+bwd"],
                      help="e.g. --passes fwd: the forward alone")
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  p, d = args.patch, args.dim
  reporter = Reporter("patch_embed", args, argv, [("images", 13), ("dtype", 9), ("pass", 8)],
                      ["jaxops", "xla"], units=("flops",))
  reporter.header(f"p={p}, D={d}, with bias, class token and positional embedding; TFLOP/s "
                  "counts the patch GEMM's products")
  for images_text in args.images:
    b, h, w, c = options.dims(images_text)
    patches = (h // p) * (w // p)
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      keys = jax.random.split(jax.random.key(0), 5)
      shapes = [(b, h, w, c), (p, p, c, d), (d,), (patches + 1, d), (d,)]
      operands = [jax.random.normal(k, s, jnp.float32).astype(dtype)
                  for k, s in zip(keys, shapes)]
      dy = random_like((b, patches + 1, d), dtype)
      gemm_flops = 2 * b * patches * p * p * c * d
      for pass_name in args.passes:
        timings = time_implementations(
            jaxops_and_reference(lambda impl: forward_or_backward(
                pass_name, lambda i, k, bias, pos, cls: jaxops.patch_embed(
                    i, k, bias, patch_size=p, pos_embed=pos, cls_token=cls,
                    implementation=impl))),
            *operands, dy, runs=args.runs)
        reporter.add([images_text, dtype_name, pass_name],
                     Result(f"patch_embed p={p} D={d}", images_text, dtype_name, pass_name,
                            timings, computed(gemm_flops * (1 if pass_name == "fwd" else 3))))
  return 0
