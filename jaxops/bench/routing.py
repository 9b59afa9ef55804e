"""``python -m jaxops.bench routing``: the MoE router vs its jnp reference.

For each router configuration, dtype and shape [tokens, experts]: forward
(weights and experts), and forward+backward (``jax.vjp`` of the weights with a
random cotangent), for jaxops and for ``implementation="xla"`` (softmax or
sigmoid, lax.top_k, renormalisation; its gradient by XLA) in the same process.
Bytes each pass must move (the [tokens, k] outputs and cotangent are small
beside the logits): fwd the logits read once; fwd+bwd the logits read and
their gradient written.

Then (not with --quick) moe_aux_loss, which has no kernel: its jnp form (the loss, and its
gradient through ``jax.vjp`` with a random scalar cotangent) against a plain
sum of probs, the least any kernel reading probs would cost (the measured
reason for leaving it to XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_call, time_implementations)

CONFIGS = {
    "softmax": {},
    "sigmoid-groups": {"score": "sigmoid", "num_groups": 8, "group_topk": 4, "bias": True},
}
PRESETS = {
    "cpu": {"configs": list(CONFIGS), "shapes": ["16384x128"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 7},
    "gpu": {"configs": list(CONFIGS), "shapes": ["65536x256"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"configs": ["softmax"], "dtypes": ["float32"], "passes": ["fwd"]},
         "gpu": {"configs": ["softmax"], "dtypes": ["bfloat16"], "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("routing", __doc__, PRESETS, QUICK)
  parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS))
  parser.add_argument("--shapes", nargs="+", default=None, help="tokens x experts")
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=["fwd", "fwd+bwd"])
  return options.parse(parser, argv, PRESETS, QUICK)


def _aux_loss(args):
  print("\n# moe_aux_loss (jnp, no kernel) against a plain read of probs (jnp.sum)")
  for shape_text in args.shapes:
    tokens, experts = options.dims(shape_text)
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (tokens, experts)), axis=-1)
    counts = jnp.full((experts,), tokens * args.k // experts, jnp.int32)
    aux_loss = lambda p: jaxops.moe_aux_loss(p, counts, args.k, 0.01)
    loss = time_call(aux_loss, probs, runs=args.runs)
    grad = time_call(forward_or_backward("fwd+bwd", aux_loss), probs,
                     random_like((), jnp.float32), runs=args.runs)
    read = time_call(jnp.sum, probs, runs=args.runs)
    print(f"{shape_text:<10} loss {loss.ms:.3f} ms, grad {grad.ms:.3f} ms, "
          f"sum(probs) {read.ms:.3f} ms (loss / read = {loss.ms / read.ms:.2f})", flush=True)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("routing", args, argv, [("config", 15), ("shape", 10), ("dtype", 9),
                                              ("pass", 8)], ["jaxops", "xla"])
  reporter.header(f"k={args.k}; GB/s counts the logits (and their gradient) each pass must move")
  for config_name in args.configs:
    config = dict(CONFIGS[config_name])
    with_bias = config.pop("bias", False)
    for shape_text in args.shapes:
      tokens, experts = options.dims(shape_text)
      bias = jnp.linspace(-0.01, 0.01, experts) if with_bias else None
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        logits = jax.random.normal(jax.random.key(0), (tokens, experts)).astype(dtype)
        dy = random_like((tokens, args.k), jnp.float32)

        def router(impl, weights_only):
          def fn(logits):
            out = jaxops.topk_router(logits, args.k, expert_bias=bias, implementation=impl,
                                     **config)
            return out[0] if weights_only else out
          return fn

        for pass_name in args.passes:
          timings = time_implementations(
              jaxops_and_reference(lambda impl: forward_or_backward(
                  pass_name, router(impl, "bwd" in pass_name))),
              logits, dy, runs=args.runs)
          logits_bytes = logits.size * dtype.itemsize
          reporter.add([config_name, shape_text, dtype_name, pass_name],
                       Result(f"topk_router {config_name}", shape_text, dtype_name, pass_name,
                              timings, moved(logits_bytes * (1 if pass_name == "fwd" else 2))))
  if not args.quick:
    _aux_loss(args)
  return 0
