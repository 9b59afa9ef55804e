"""``python -m jaxops.bench model``: one training step of the decoder-only LM
(:mod:`jaxops.models.decoder`: forward, backward and the AdamW update) with
jaxops kernels vs the same model with every op on ``implementation="xla"``.

Reports the median step time of interleaved runs (one of each in turn, so
load from other processes weighs on both alike), tokens/s, and XLA's
temporary allocation for the compiled step (its peak working memory beyond
parameters, optimizer state and batch). Parameters and optimizer state are
donated, as in training; each run gets fresh copies made outside the timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from jaxops.bench.timing import machine_line, settle
from jaxops.models import data, decoder, training
from jaxops.models.config import DecoderConfig

IMPLEMENTATIONS = {"jaxops": None, "xla": "xla"}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench model", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--runs", type=int, default=5)
  return parser.parse_args(argv)


def _compiled_step(config, variables, opt_state, batch):
  tx = training.make_optimizer(training.OptimizerConfig(), config.implementation)
  return training.make_train_step(config, tx).lower(variables, opt_state, batch).compile()


def main(argv=()):
  args = _parse(argv)
  base = DecoderConfig(vocab_size=data.VOCAB_SIZE, d_model=args.d_model,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads)
  variables = decoder.init_params(base)
  opt_state = training.make_optimizer(training.OptimizerConfig(), None).init(variables)
  corpus = data.stdlib_corpus(1 << 20)
  batch = jnp.asarray(data.batch_at(corpus, 0, args.batch, args.seq_len))
  n_params = sum(x.size for x in jax.tree.leaves(variables))

  print(f"# {machine_line()}")
  print(f"# decoder LM: {n_params / 1e6:.2f}M parameters, d_model {args.d_model}, {args.layers} "
        f"layers, {args.heads} heads / {args.kv_heads} kv heads, vocab {base.vocab_size}; batch "
        f"{args.batch} x {args.seq_len} tokens, float32")
  print(f"# one training step (forward, backward, AdamW), median of {args.runs} interleaved runs "
        "after warm-up; temp = XLA's temporary allocation of the compiled step")

  compiled = {name: _compiled_step(dataclasses.replace(base, implementation=impl),
                                   variables, opt_state, batch)
              for name, impl in IMPLEMENTATIONS.items()}
  fresh = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, (variables, opt_state)))
  for step in compiled.values():
    jax.block_until_ready(step(*fresh(), batch))
  times = {name: [] for name in compiled}
  for _ in range(args.runs):
    for name, step in compiled.items():
      state = fresh()
      settle()
      start = time.perf_counter()
      out = jax.block_until_ready(step(*state, batch))
      times[name].append(time.perf_counter() - start)
      del out

  tokens = args.batch * args.seq_len
  print(f"{'implementation':<15}{'step ms':>10}{'tokens/s':>12}{'temp MiB':>10}")
  results = {}
  for name, step in compiled.items():
    ms = statistics.median(times[name]) * 1e3
    temp = training.temp_bytes(step)
    results[name] = (ms, temp)
    temp_text = "-" if temp is None else f"{temp / 2**20:.1f}"
    print(f"{name:<15}{ms:>10.1f}{tokens / ms * 1e3:>12,.0f}{temp_text:>10}")
  (ours_ms, ours_temp), (xla_ms, xla_temp) = results["jaxops"], results["xla"]
  line = f"jaxops vs xla: {xla_ms / ours_ms:.2f}x tokens/s"
  if ours_temp and xla_temp:
    line += f", {ours_temp / xla_temp:.2f}x temporary memory"
  print(line)
  return 0
