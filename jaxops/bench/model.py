"""``python -m jaxops.bench model``: one training step of the decoder-only LM
(:mod:`jaxops.models.decoder`: forward, backward and the AdamW update) with
jaxops kernels vs the same model with every op on ``implementation="xla"``.

Reports the step time (on the CPU the median of interleaved runs, one of each
in turn, so load from other processes weighs on both alike), tokens/s, and
XLA's temporary allocation for the compiled step (its peak working memory
beyond parameters, optimizer state and batch). Parameters and optimizer state
are donated, as in training; each run gets fresh copies made outside the
timing. No roofline: a step mixes compute- and bandwidth-bound work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxops.bench import options
from jaxops.bench.results import Reporter, Result
from jaxops.bench.timing import time_implementations
from jaxops.models import data, decoder, training
from jaxops.models.config import DecoderConfig

IMPLEMENTATIONS = {"jaxops": None, "xla": "xla"}
PRESETS = {
    "cpu": {"seq_len": 1024, "batch": 2, "d_model": 256, "layers": 4, "heads": 4, "kv_heads": 2,
            "runs": 5},
    "gpu": {"seq_len": 2048, "batch": 8, "d_model": 1024, "layers": 8, "heads": 16,
            "kv_heads": 4, "runs": 3},
}
QUICK = {"cpu": {"layers": 1}, "gpu": {"layers": 2}}


def parse(argv):
  parser = options.parser_for("model", __doc__, PRESETS, QUICK)
  parser.add_argument("--seq-len", type=int, default=None)
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--d-model", type=int, default=None)
  parser.add_argument("--layers", type=int, default=None)
  parser.add_argument("--heads", type=int, default=None)
  parser.add_argument("--kv-heads", type=int, default=None)
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  base = DecoderConfig(vocab_size=data.VOCAB_SIZE, d_model=args.d_model,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads)
  variables = decoder.init_params(base)
  opt_state = training.make_optimizer(training.OptimizerConfig(), None).init(variables)
  corpus = data.stdlib_corpus(1 << 20)
  batch = jnp.asarray(data.batch_at(corpus, 0, args.batch, args.seq_len))
  n_params = sum(x.size for x in jax.tree.leaves(variables))

  steps = {}
  for name, impl in IMPLEMENTATIONS.items():
    config = dataclasses.replace(base, implementation=impl)
    tx = training.make_optimizer(training.OptimizerConfig(), config.implementation)
    steps[name] = training.make_train_step(config, tx)
  reporter = Reporter("model", args, argv, [("model", 40)], list(IMPLEMENTATIONS), units=(),
                      memory=True)
  reporter.header(f"decoder LM: {n_params / 1e6:.2f}M parameters, d_model {args.d_model}, "
                  f"{args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, vocab "
                  f"{base.vocab_size}; batch {args.batch} x {args.seq_len} tokens, float32; one "
                  "training step (forward, backward, AdamW); temp = XLA's temporary allocation")
  timings = time_implementations(steps, variables, opt_state, batch, runs=args.runs,
                                 donate_argnums=(0, 1), interleave=True)
  tokens = args.batch * args.seq_len
  tokens_per_s = {name: tokens / (t.ms * 1e-3) for name, t in timings.items()}
  shape = f"{n_params / 1e6:.2f}M params, {args.batch}x{args.seq_len} tokens"
  reporter.add([f"{args.layers} layers d_model {args.d_model}"],
               Result("decoder LM train step", shape, "float32", "step", timings,
                      extra={"tokens_per_s": tokens_per_s}),
               "  tokens/s " + ", ".join(f"{name} {rate:,.0f}" for name, rate in
                                         tokens_per_s.items()))
  return 0
