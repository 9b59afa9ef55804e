"""``python -m jaxops.demo``: train a character-level transformer LM on jaxops.

The decoder-only model of :mod:`jaxops.models.decoder` (RMSNorm, RoPE,
grouped-query flash attention, SwiGLU, tied embedding, fused cross-entropy and
AdamW, all jaxops kernels) learns to write Python from the installed standard
library's source. The first steps of the same training then run with every
op on ``implementation="xla"`` (the plain jnp code XLA compiles), from the same
start, for loss, tokens/s and peak temporary memory side by side; and the
trained model samples a few lines through a KV-cache decode loop (jit,
``fori_loop``, traced ``query_offset``).

``--serve`` then serves the trained model: a stream of prompts of different
lengths generated with continuous batching over a paged KV cache
(``jaxops.paged_attention``, ``jaxops.sample``), against the same scheduler on
the jnp reference with a contiguous cache: tokens/s and cache memory.

``--devices N`` trains data-parallel over N devices (N host CPU devices when
there is no accelerator); the losses equal the single-device run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxops.bench.timing import machine_line
from jaxops.models import checkpoint, data, decoder, generate, serving, training
from jaxops.models.config import DecoderConfig

PROMPTS = ("import", "class ", "def __", "    if")


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="training steps")
  parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
  parser.add_argument("--batch", type=int, default=16, help="sequences per step")
  parser.add_argument("--d-model", type=int, default=192)
  parser.add_argument("--layers", type=int, default=3)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--corpus-bytes", type=int, default=4 << 20,
                      help="read at most this much standard-library source")
  parser.add_argument("--devices", type=int, default=1,
                      help="train data-parallel over N devices (host CPU devices if no "
                           "accelerator); --batch must be a multiple of N")
  parser.add_argument("--checkpoint-dir", help="save the run here at the end (orbax)")
  parser.add_argument("--checkpoint-every", type=int, default=0,
                      help="also save every N steps (0: only at the end)")
  parser.add_argument("--resume", action="store_true",
                      help="continue from the latest checkpoint in --checkpoint-dir")
  parser.add_argument("--no-compare", action="store_true",
                      help="skip the implementation='xla' training run")
  parser.add_argument("--compare-steps", type=int, default=40,
                      help="steps of the implementation='xla' run, from the same start "
                           "(enough for its speed and memory; default 40)")
  parser.add_argument("--sample-tokens", type=int, default=160,
                      help="tokens to sample per prompt after training (0: no sampling)")
  parser.add_argument("--serve", action="store_true",
                      help="after training, serve a stream of prompts (continuous batching "
                           "over a paged KV cache) and compare with the jnp reference")
  parser.add_argument("--serve-requests", type=int, default=24, help="prompts to serve")
  parser.add_argument("--serve-new-tokens", type=int, default=48,
                      help="the most tokens a request generates")
  parser.add_argument("--serve-batch", type=int, default=8, help="sequences decoded together")
  parser.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
  parser.add_argument("--plot", metavar="PATH",
                      help="write the loss curve(s) as a PNG (needs matplotlib)")
  parser.add_argument("--log-json", metavar="PATH",
                      help="write the per-step losses and the measurements as JSON")
  args = parser.parse_args(argv)
  if args.devices < 1 or args.batch % args.devices:
    parser.error(f"--batch ({args.batch}) must be a positive multiple of --devices ({args.devices})")
  if args.resume and not args.checkpoint_dir:
    parser.error("--resume needs --checkpoint-dir")
  return args


def use_host_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices, as
  XLA_FLAGS=--xla_force_host_platform_device_count=N would. Either works only
  before jax starts its backends (importing jax does not start them; the
  first computation or device query does), so the demo parses its arguments
  and sets this before anything else."""
  jax.config.update("jax_num_cpu_devices", count)


class ProgressBar:
  """One line redrawn in place on a terminal; every tenth of the run otherwise
  (logs and pipes get a readable loss curve instead of carriage returns)."""

  def __init__(self, label: str, total: int, width: int = 30):
    self.label, self.total, self.width = label, total, width
    self.interactive = sys.stdout.isatty()

  def update(self, done: int, loss: float, tokens_per_s: float | None):
    speed = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s else "compiling"
    filled = self.width * done // max(self.total, 1)
    line = (f"{self.label:<7} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done:>5}/{self.total} loss {loss:6.3f}  {speed}")
    if self.interactive:
      print("\r" + line, end="\n" if done == self.total else "", flush=True)
    elif done == 1 or done == self.total or done % max(self.total // 10, 1) == 0:
      print(line, flush=True)


def train(label, config, opt, corpus, args, mesh, *, variables, opt_state, first_step,
          data_position, last_step):
  """Trains from ``first_step`` to ``last_step``; returns the run's record."""
  tx = training.make_optimizer(opt, config.implementation)
  # The step donates its state: copy, so that the next run starts from the same arrays.
  variables = training.place(jax.tree.map(jnp.copy, variables), mesh)
  opt_state = training.place(jax.tree.map(jnp.copy, opt_state), mesh)
  step_fn = training.make_train_step(config, tx, mesh)
  first_batch = training.place(data.batch_at(corpus, data_position, args.batch, args.seq_len),
                               mesh, PartitionSpec("data"))
  compiled = step_fn.lower(variables, opt_state, first_batch).compile()
  temp = training.temp_bytes(compiled)
  bar = ProgressBar(label, last_step)
  tokens_per_step = args.batch * args.seq_len
  timing = {"start": None}
  record = {"losses": [], "temp_bytes": temp, "tokens_per_s": None, "first_step": first_step}

  # Each step reads seq_len further; a checkpoint records where the next step reads.
  positions = [data_position + k * args.seq_len for k in range(last_step - first_step + 1)]
  batches = (data.batch_at(corpus, p, args.batch, args.seq_len) for p in positions[:-1])

  def on_step(i, loss, variables, opt_state):
    step = first_step + i + 1
    if timing["start"] is None:  # time from the end of the first step: warm caches
      timing["start"], timing["steps"] = time.perf_counter(), 0
      speed = None
    else:
      timing["steps"] += 1
      speed = timing["steps"] * tokens_per_step / (time.perf_counter() - timing["start"])
    record["tokens_per_s"] = speed
    bar.update(step, loss, speed)
    if args.checkpoint_dir and config.implementation is None and (
        step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0)):
      save_start = time.perf_counter()
      checkpoint.save(args.checkpoint_dir, variables=variables, opt_state=opt_state, step=step,
                      data_position=positions[i + 1])
      timing["start"] += time.perf_counter() - save_start  # tokens/s counts training only

  variables, opt_state, losses = training.run_steps(compiled, variables, opt_state,
                                                    batches, mesh=mesh, on_step=on_step)
  record["losses"] = losses
  record["variables"] = variables
  return record


def print_comparison(ours, xla):
  """Loss at the last step both ran, tokens/s and temporary memory, side by side."""
  compared = len(xla["losses"])
  loss_header = f"loss @ step {xla['first_step'] + compared}"
  print(f"\n{'':<8}{loss_header:>18}{'tokens/s':>12}{'temp MiB':>10}")
  for label, r in (("jaxops", ours), ("xla", xla)):
    temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
    print(f"{label:<8}{r['losses'][compared - 1]:>18.4f}{r['tokens_per_s'] or 0:>12,.0f}"
          f"{temp:>10}")
  ratios = []
  if ours["tokens_per_s"] and xla["tokens_per_s"]:
    ratios.append(f"{ours['tokens_per_s'] / xla['tokens_per_s']:.2f}x tokens/s")
  if ours["temp_bytes"] and xla["temp_bytes"]:
    ratios.append(f"{ours['temp_bytes'] / xla['temp_bytes']:.2f}x peak temporary memory")
  if ratios:
    print("jaxops / xla: " + ", ".join(ratios))


def print_samples(variables, config, num_tokens, seed):
  """A few lines after each prompt, sampled with the KV-cache decode loop."""
  prompts = jnp.asarray([list(p.encode()) for p in PROMPTS], jnp.int32)
  tokens = generate.generate(jax.device_get(variables), prompts, jax.random.key(seed),
                             config=config, num_new=num_tokens, temperature=0.8)
  print("\nsamples (KV-cache decode, temperature 0.8):")
  for row in jax.device_get(tokens):
    print("  | " + "\n  | ".join(data.decode_text(row).splitlines()[:4]))


def serving_requests(corpus, args):
  """Prompts cut from the corpus, of lengths 8 .. seq_len / 2, each asking for
  serve_new_tokens / 2 .. serve_new_tokens new tokens (a fixed seed)."""
  rng = np.random.default_rng(args.seed)
  longest = max(8, args.seq_len // 2)
  prompts, new_tokens = [], []
  for _ in range(args.serve_requests):
    length = int(rng.integers(8, longest + 1))
    start = int(rng.integers(0, len(corpus) - length))
    prompts.append(np.asarray(corpus[start:start + length], np.int32))
    new_tokens.append(int(rng.integers(max(1, args.serve_new_tokens // 2),
                                       args.serve_new_tokens + 1)))
  return prompts, new_tokens


def serve_stream(variables, config, corpus, args):
  """Continuous batching over a paged cache, then the jnp reference over a
  contiguous cache, on the same requests; tokens/s and cache memory."""
  prompts, new_tokens = serving_requests(corpus, args)
  max_seq_len = max(8, args.seq_len // 2) + args.serve_new_tokens
  pages_per_seq = -(-max_seq_len // args.page_size)
  # Half the pages a contiguous cache reserves: requests wait when the pool is short.
  serve_config = serving.ServeConfig(
      max_batch=args.serve_batch, page_size=args.page_size, max_seq_len=max_seq_len,
      num_pages=max(pages_per_seq, args.serve_batch * pages_per_seq // 2),
      prefill_chunk=min(32, max_seq_len))
  print(f"\nserving {len(prompts)} prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {sum(new_tokens)} new tokens, "
        f"{args.serve_batch} at a time (temperature {serve_config.temperature}, "
        f"top-k {serve_config.top_k}, top-p {serve_config.top_p})")
  runs = [("jaxops", None, True)] + ([] if args.no_compare else [("xla", "xla", False)])
  results = {}
  for label, impl, paged in runs:
    def progress(done, total, tokens, seconds, label=label):
      print(f"\r  {label:<7}{done:>4}/{total} requests {tokens:>7} tokens "
            f"{tokens / max(seconds, 1e-9):>9,.0f} tok/s", end="", flush=True)
    results[label] = serving.serve(
        jax.device_get(variables), dataclasses.replace(config, implementation=impl), prompts,
        new_tokens, serve_config=serve_config, key=jax.random.key(args.seed), paged=paged,
        progress=progress)
    print()
  print(f"{'':<8}{'cache':>12}{'tokens/s':>12}{'cache MiB':>11}{'in use MiB':>12}")
  for label, impl, paged in runs:
    r = results[label]
    print(f"{label:<8}{'paged' if paged else 'contiguous':>12}{r.tokens_per_second:>12,.0f}"
          f"{r.cache_bytes / 2**20:>11.2f}{r.peak_cache_bytes / 2**20:>12.2f}")
  if "xla" in results:
    ours, xla = results["jaxops"], results["xla"]
    print(f"jaxops / xla: {ours.tokens_per_second / xla.tokens_per_second:.2f}x tokens/s, "
          f"{ours.cache_bytes / xla.cache_bytes:.2f}x cache memory")
  first = results["jaxops"].outputs[0]
  print("  | " + data.decode_text(np.concatenate([prompts[0], first])).replace("\n", "\n  | "))
  return results


def plot(path, runs):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"--plot: matplotlib is not installed; no plot written to {path}")
    return
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, record in runs.items():
    first = record["first_step"]
    ax.plot(range(first + 1, first + 1 + len(record["losses"])), record["losses"], label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/byte)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  print(f"loss curve written to {path}")


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.devices > 1:
    use_host_devices(args.devices)
  wall_start = time.perf_counter()
  print(f"jaxops demo on {machine_line()}")
  corpus = data.stdlib_corpus(args.corpus_bytes)
  print(f"corpus: {len(corpus) / 2**20:.1f} MiB of standard-library source under "
        f"{os.path.dirname(os.__file__)}")
  config = DecoderConfig(vocab_size=data.VOCAB_SIZE, d_model=args.d_model,
                         num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.kv_heads)
  opt = training.OptimizerConfig(peak_learning_rate=args.learning_rate,
                                 total_steps=args.steps)
  mesh = training.data_mesh(args.devices) if args.devices > 1 else None
  variables = decoder.init_params(config, args.seed)
  opt_state = training.make_optimizer(opt, None).init(variables)
  n_params = sum(x.size for x in jax.tree.leaves(variables))
  print(f"model: {n_params / 1e6:.2f}M parameters, d_model {config.d_model}, "
        f"{config.num_layers} layers, {config.num_heads} heads / {config.num_kv_heads} kv heads; "
        f"batch {args.batch} x {args.seq_len} tokens"
        + (f", data-parallel over {args.devices} devices" if mesh else ""))

  first_step = data_position = 0
  if args.resume and checkpoint.latest_step(args.checkpoint_dir) is not None:
    variables, opt_state, first_step, data_position = checkpoint.restore(
        args.checkpoint_dir, variables=variables, opt_state=opt_state)
    print(f"resumed from {args.checkpoint_dir} at step {first_step}"
          + (f"; --steps {args.steps} are done already" if first_step >= args.steps else ""))

  runs = {}
  impls = [("jaxops", None)] + ([] if args.no_compare else [("xla", "xla")])
  for label, impl in impls:
    run_config = dataclasses.replace(config, implementation=impl)
    last_step = args.steps if impl is None else min(args.steps, first_step + args.compare_steps)
    runs[label] = train(label, run_config, opt, corpus, args, mesh, variables=variables,
                        opt_state=opt_state, first_step=first_step,
                        data_position=data_position, last_step=last_step)
  if "xla" in runs and runs["xla"]["losses"]:
    print_comparison(runs["jaxops"], runs["xla"])
  if args.sample_tokens > 0:
    print_samples(runs["jaxops"]["variables"], config, args.sample_tokens, args.seed)

  if args.serve:
    serve_stream(runs["jaxops"]["variables"], config, corpus, args)

  if args.plot:
    plot(args.plot, runs)
  if args.log_json:
    with open(args.log_json, "w") as f:
      json.dump({label: {"losses": r["losses"], "tokens_per_s": r["tokens_per_s"],
                         "temp_bytes": r["temp_bytes"], "first_step": r["first_step"]}
                 for label, r in runs.items()}, f)
  print(f"\ndone in {time.perf_counter() - wall_start:.0f} s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
