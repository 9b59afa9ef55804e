"""``python -m jaxops.bench cross_entropy``: cross-entropy and linear cross-entropy vs jnp.

cross_entropy on logits [tokens, vocab]: forward (mean loss),
forward+backward (value_and_grad) and jvp (the loss and its tangent for a
tangent of the logits), jaxops against ``implementation="xla"``. GB/s counts
the logits read once forward, read once plus their gradient written once
forward+backward, and the logits and their tangent read once for jvp.

linear_cross_entropy on x [tokens, hidden], weight [hidden, vocab]:
forward+backward, jaxops against the jnp matmul + cross-entropy; also reports
XLA's compiled temporary memory for both, as a share of the logits' size.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import machine_line, time_jitted


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench cross_entropy",
                                   description=__doc__)
  parser.add_argument("--ops", nargs="+", default=["cross_entropy", "linear_cross_entropy"],
                      choices=["cross_entropy", "linear_cross_entropy"])
  parser.add_argument("--shapes", nargs="+", default=["8192x32000"],
                      help="tokens x vocab for cross_entropy, e.g. 8192x32000")
  parser.add_argument("--linear-shapes", nargs="+", default=["8192x1024x32000"],
                      help="tokens x hidden x vocab for linear_cross_entropy")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd", "jvp"],
                      choices=["fwd", "fwd+bwd", "jvp"])
  parser.add_argument("--ignored", type=float, default=0.0,
                      help="share of tokens labelled ignore_index")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--linear-runs", type=int, default=3)
  return parser.parse_args(argv)


def _labels(tokens, vocab, ignored):
  k1, k2 = jax.random.split(jax.random.key(1))
  labels = jax.random.randint(k1, (tokens,), 0, vocab)
  return jnp.where(jax.random.bernoulli(k2, ignored, (tokens,)), -100, labels)


def _row(name, shape, dtype, pass_name, ours, xla, gbytes, extra=""):
  gbs = lambda t: gbytes / (t.median_ms * 1e-3)
  print(f"{name:<21} {shape:<16} {dtype:<9} {pass_name:<8} {ours.median_ms:>10.1f} "
        f"{gbs(ours):>6.1f} {ours.sys_share:>4.0%} {xla.median_ms:>9.1f} {gbs(xla):>6.1f} "
        f"{xla.sys_share:>4.0%} {xla.median_ms / ours.median_ms:>7.2f}x{extra}", flush=True)


def main(argv=()):
  args = _parse(argv)
  print(f"# {machine_line()}")
  print("# median ms after warm-up; GB/s: logits read once (+ gradient written once) for "
        "cross_entropy, matmul flops / 1e9 per s (GFLOP/s) for linear_cross_entropy; "
        "'sys' = share of CPU time in the kernel (page faults)")
  print(f"{'op':<21} {'shape':<16} {'dtype':<9} {'pass':<8} {'jaxops ms':>10} {'rate':>6} "
        f"{'sys':>4} {'xla ms':>9} {'rate':>6} {'sys':>4} {'speed-up':>8}")
  if "cross_entropy" in args.ops:
    for shape_text in args.shapes:
      tokens, vocab = (int(s) for s in shape_text.split("x"))
      labels = _labels(tokens, vocab, args.ignored)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        logits = (2.0 * jax.random.normal(jax.random.key(0), (tokens, vocab))).astype(dtype)
        tangent = jax.random.normal(jax.random.key(2), (tokens, vocab)).astype(dtype)
        logits_gb = logits.size * dtype.itemsize / 1e9
        for pass_name in args.passes:
          results = {}
          for impl in (None, "xla"):
            loss = lambda x, l, impl=impl: jaxops.cross_entropy(x, l, implementation=impl)
            if pass_name == "jvp":
              f = lambda x, l, t, loss=loss: jax.jvp(lambda x: loss(x, l), (x,), (t,))
            else:
              f = lambda x, l, t, loss=loss: (loss if pass_name == "fwd" else
                                              jax.value_and_grad(loss))(x, l)
            results[impl] = time_jitted(f, logits, labels, tangent, runs=args.runs)
          _row("cross_entropy", shape_text, dtype_name, pass_name, results[None], results["xla"],
               logits_gb * (1 if pass_name == "fwd" else 2))
  if "linear_cross_entropy" in args.ops:
    for shape_text in args.linear_shapes:
      tokens, hidden, vocab = (int(s) for s in shape_text.split("x"))
      labels = _labels(tokens, vocab, args.ignored)
      for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        k1, k2 = jax.random.split(jax.random.key(0))
        x = jax.random.normal(k1, (tokens, hidden)).astype(dtype)
        weight = (jax.random.normal(k2, (hidden, vocab)) / hidden ** 0.5).astype(dtype)
        logits_bytes = tokens * vocab * 4
        results = {}
        for impl in (None, "xla"):
          loss = lambda x, w, l, impl=impl: jaxops.linear_cross_entropy(x, w, l, implementation=impl)
          results[impl] = time_jitted(jax.value_and_grad(loss, (0, 1)), x, weight, labels,
                                      runs=args.linear_runs, warmup=1)
        memory = "".join(
            f"  {who} temp {results[impl].temp_bytes / logits_bytes:.0%} of logits"
            for who, impl in (("jaxops", None), ("xla", "xla"))
            if results[impl].temp_bytes is not None)
        _row("linear_cross_entropy", shape_text, dtype_name, "fwd+bwd", results[None],
             results["xla"], 3 * 2 * tokens * hidden * vocab / 1e9, memory)
  return 0
