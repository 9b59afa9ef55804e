"""``python -m jaxops.bench cross_entropy``: cross-entropy and linear cross-entropy vs jnp.

cross_entropy on logits [tokens, vocab] with per-token losses
(``reduction="none"``): forward, forward+backward (``jax.vjp`` with a random
per-token cotangent) and jvp (the losses and their tangent for a tangent of
the logits), jaxops against ``implementation="xla"`` (XLA's compiled jnp
reference). Bytes each pass must move (the labels and per-token vectors are
negligible): fwd the logits read once; fwd+bwd the logits read and their
gradient written; jvp the logits and their tangent read.

linear_cross_entropy on x [tokens, hidden], weight [hidden, vocab]:
forward+backward with respect to x and the weight, jaxops against the jnp
matmul + cross-entropy, in two forms: the per-token losses (``jax.vjp`` with a
random per-token cotangent; case ``linear_cross_entropy``) and the mean loss
of training (a random scalar cotangent; case ``linear_cross_entropy mean``).
Compute-bound: three products of 2 * tokens * hidden * vocab flops (the
logits, then the gradients of x and of the weight). The mean loss's gradient
is computed in the forward sweep (three products); the per-token form's
cotangent is known only after the forward, so its backward computes each
block's logits again (four products) where XLA keeps all of them. Also
reports XLA's compiled temporary memory for both, as a share of the float32
logits' size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, computed, moved
from jaxops.bench.timing import (forward_or_backward, jaxops_and_reference, random_like,
                                  time_implementations)

_OPS = ["cross_entropy", "linear_cross_entropy"]
_PASSES = ["fwd", "fwd+bwd", "jvp"]
PRESETS = {
    "cpu": {"ops": _OPS, "shapes": ["8192x32000"], "linear_shapes": ["8192x1024x32000"],
            "dtypes": ["float32", "bfloat16"], "passes": _PASSES, "runs": 5, "linear_runs": 3},
    "gpu": {"ops": _OPS, "shapes": ["8192x32000", "8192x128256"],
            "linear_shapes": ["8192x2048x32000"], "dtypes": ["float32", "bfloat16"],
            "passes": ["fwd", "fwd+bwd"], "runs": 3, "linear_runs": 3},
}
QUICK = {"cpu": {"ops": ["cross_entropy"], "dtypes": ["float32"], "passes": ["fwd"]},
         "gpu": {"ops": ["cross_entropy"], "shapes": ["8192x32000"], "dtypes": ["bfloat16"],
                 "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("cross_entropy", __doc__, PRESETS, QUICK)
  parser.add_argument("--ops", nargs="+", default=None, choices=_OPS)
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="tokens x vocab for cross_entropy, e.g. 8192x32000")
  parser.add_argument("--linear-shapes", nargs="+", default=None,
                      help="tokens x hidden x vocab for linear_cross_entropy")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--passes", nargs="+", default=None, choices=_PASSES,
                      help="of cross_entropy (linear_cross_entropy: fwd+bwd)")
  parser.add_argument("--ignored", type=float, default=0.0,
                      help="share of tokens labelled ignore_index")
  parser.add_argument("--linear-runs", type=int, default=None)
  return options.parse(parser, argv, PRESETS, QUICK)


def _labels(tokens, vocab, ignored):
  k1, k2 = jax.random.split(jax.random.key(1))
  labels = jax.random.randint(k1, (tokens,), 0, vocab)
  return jnp.where(jax.random.bernoulli(k2, ignored, (tokens,)), -100, labels)


def _cross_entropy(args, reporter):
  for shape_text in args.shapes:
    tokens, vocab = options.dims(shape_text)
    labels = _labels(tokens, vocab, args.ignored)
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      logits = (2.0 * jax.random.normal(jax.random.key(0), (tokens, vocab))).astype(dtype)
      logits_bytes = logits.size * dtype.itemsize
      for pass_name in args.passes:
        def make(impl):
          losses = lambda x, l: jaxops.cross_entropy(x, l, reduction="none", implementation=impl)
          if pass_name == "jvp":
            # The logits' tangent: a random array of their shape.
            return lambda x, l, t: jax.jvp(lambda x: losses(x, l), (x,), (t,))
          return forward_or_backward(pass_name, losses, wrt=(0,))

        # The last argument is the pass's cotangent (per token) or tangent (per logit).
        last = random_like(logits.shape if pass_name == "jvp" else (tokens,), dtype)
        timings = time_implementations(jaxops_and_reference(make), logits, labels, last,
                                       runs=args.runs)
        reporter.add(["cross_entropy", shape_text, dtype_name, pass_name],
                     Result("cross_entropy", shape_text, dtype_name, pass_name, timings,
                            moved(logits_bytes * (1 if pass_name == "fwd" else 2))))


def _linear_cross_entropy(args, reporter):
  for shape_text in args.linear_shapes:
    tokens, hidden, vocab = options.dims(shape_text)
    labels = _labels(tokens, vocab, args.ignored)
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      k1, k2 = jax.random.split(jax.random.key(0))
      x = jax.random.normal(k1, (tokens, hidden)).astype(dtype)
      weight = (jax.random.normal(k2, (hidden, vocab)) / hidden ** 0.5).astype(dtype)
      # (case, reduction, the cotangent's shape)
      for case, reduction, cotangent in (("linear_cross_entropy", "none", (tokens,)),
                                         ("linear_cross_entropy mean", "mean", ())):
        fns = jaxops_and_reference(lambda impl, reduction=reduction: forward_or_backward(
            "fwd+bwd", lambda x, w, l: jaxops.linear_cross_entropy(
                x, w, l, reduction=reduction, implementation=impl), wrt=(0, 1)))
        timings = time_implementations(fns, x, weight, labels, random_like(cotangent, dtype),
                                       runs=args.linear_runs)
        logits_bytes = tokens * vocab * 4
        temp_share = {name: t.temp_bytes / logits_bytes for name, t in timings.items()
                      if t.temp_bytes is not None}
        reporter.add([case, shape_text, dtype_name, "fwd+bwd"],
                     Result(case, shape_text, dtype_name, "fwd+bwd", timings,
                            computed(3 * 2 * tokens * hidden * vocab),
                            {"temp_share_of_logits": temp_share}),
                     "".join(f"  {name} temp {share:.0%} of logits"
                             for name, share in temp_share.items()))


def main(argv=()):
  args = parse(argv)
  units = ("bytes",) * ("cross_entropy" in args.ops) + ("flops",) * (
      "linear_cross_entropy" in args.ops)
  reporter = Reporter("cross_entropy", args, argv, [("op", 26), ("shape", 16), ("dtype", 9),
                                                    ("pass", 8)], ["jaxops", "xla"], units)
  reporter.header("rate: GB/s for cross_entropy (the bytes the pass must move), TFLOP/s for "
                  "linear_cross_entropy (its three products)")
  if "cross_entropy" in args.ops:
    _cross_entropy(args, reporter)
  if "linear_cross_entropy" in args.ops:
    _linear_cross_entropy(args, reporter)
  return 0
