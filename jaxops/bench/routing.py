"""``python -m jaxops.bench routing``: the MoE router vs its jnp reference.

For each router configuration, dtype and shape [tokens, experts]: forward
(weights and experts), and forward+backward (a VJP of the weights with a given
cotangent), for jaxops and for ``implementation="xla"`` (softmax or sigmoid,
lax.top_k, renormalisation; its gradient by XLA) in the same process. Prints
median ms, effective GB/s (the logits read once per pass) and the speed-up.

Then moe_aux_loss, which has no kernel: its jnp form against a plain sum of
probs, the least any kernel reading probs would cost (the measured reason
for leaving it to XLA).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import (comparison_columns, forward_or_backward, print_table_header,
                                  time_against_xla, time_jitted)

CONFIGS = {
    "softmax": {},
    "sigmoid-groups": {"score": "sigmoid", "num_groups": 8, "group_topk": 4, "bias": True},
}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench routing", description=__doc__)
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--shapes", nargs="+", default=["16384x128"], help="tokens x experts")
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=()):
  args = _parse(argv)
  print_table_header(f"median of {args.runs} runs after warm-up; k={args.k}; GB/s counts the "
                     "logits read once per pass",
                     [("config", 15), ("shape", 10), ("dtype", 9), ("pass", 8)])
  for config_name in args.configs:
    config = dict(CONFIGS[config_name])
    with_bias = config.pop("bias", False)
    for shape_text in args.shapes:
      tokens, experts = (int(s) for s in shape_text.split("x"))
      bias = jnp.linspace(-0.01, 0.01, experts) if with_bias else None
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        logits = jax.random.normal(jax.random.key(0), (tokens, experts)).astype(dtype)
        dy = jnp.ones((tokens, args.k), jnp.float32)

        def router(impl, weights_only):
          def fn(logits):
            out = jaxops.topk_router(logits, args.k, expert_bias=bias, implementation=impl,
                                     **config)
            return out[0] if weights_only else out
          return fn

        for pass_name in ("fwd", "fwd+bwd"):
          ours, xla = time_against_xla(
              lambda impl: forward_or_backward(pass_name, router(impl, "bwd" in pass_name)),
              logits, dy, runs=args.runs)
          print(f"{config_name:<15} {shape_text:<10} {dtype_name:<9} {pass_name:<8} "
                f"{comparison_columns(ours, xla, logits.size * dtype.itemsize)}", flush=True)

  print("\n# moe_aux_loss (jnp, no kernel) against a plain read of probs (jnp.sum)")
  for shape_text in args.shapes:
    tokens, experts = (int(s) for s in shape_text.split("x"))
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (tokens, experts)), axis=-1)
    counts = jnp.full((experts,), tokens * args.k // experts, jnp.int32)
    loss = time_jitted(lambda p: jaxops.moe_aux_loss(p, counts, args.k, 0.01), probs,
                       runs=args.runs)
    grad = time_jitted(jax.grad(lambda p: jaxops.moe_aux_loss(p, counts, args.k, 0.01)), probs,
                       runs=args.runs)
    read = time_jitted(jnp.sum, probs, runs=args.runs)
    print(f"{shape_text:<10} loss {loss.median_ms:.3f} ms, grad {grad.median_ms:.3f} ms, "
          f"sum(probs) {read.median_ms:.3f} ms (loss / read = "
          f"{loss.median_ms / read.median_ms:.2f})", flush=True)
  return 0
