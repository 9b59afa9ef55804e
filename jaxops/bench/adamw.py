"""``python -m jaxops.bench adamw``: one AdamW step, jaxops.optim.adamw vs optax.adamw.

The parameters are a pytree of ``--leaves`` leaves with ``--params`` elements in
all (a few shapes). Each variant is a jitted step with the parameters and the
optimizer state donated (as a training loop does) and the gradients as an
input:

* ``optax``: ``optax.adamw(...).update`` + ``optax.apply_updates`` (XLA fuses it);
* ``update``: ``jaxops.optim.adamw(...).update`` + ``optax.apply_updates``;
* ``step``: ``jaxops.optim.adamw(...).step`` (update and application in one
  kernel per leaf, parameters and moments written in place).

Prints median ms, effective GB/s (grads, params, m, v read; params, m, v
written: 7 arrays; float32 moments) and the speed-up over optax.

Then a real train step (``--train``, on by default): the gradients come from
``jax.grad`` of a small loss in the same jit (one linear map per leaf on a
batch of ``--batch`` rows, whose gradient is a matmul output, as a model's
is), and params and state are donated. The same three variants: ``optax``
(``optax.adamw`` update + ``optax.apply_updates``), ``update`` (jaxops'
update + ``optax.apply_updates``, the drop-in pattern) and ``step``
(``tx.step``).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import optax

import jaxops
from jaxops.bench.timing import machine_line, time_jitted


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench adamw", description=__doc__)
  parser.add_argument("--params", type=float, default=100e6, help="parameters in all")
  parser.add_argument("--leaves", type=int, default=64)
  parser.add_argument("--dtypes", nargs="+", default=["float32"])
  parser.add_argument("--runs", type=int, default=7)
  parser.add_argument("--rounds", type=int, default=3,
                      help="interleaved rounds of the train-step variants (median over rounds)")
  parser.add_argument("--batch", type=int, default=4, help="rows of the train step's batch")
  parser.add_argument("--no-train", dest="train", action="store_false",
                      help="skip the train-step table")
  parser.add_argument("--no-update", dest="update", action="store_false",
                      help="skip the table with the gradients as inputs")
  return parser.parse_args(argv)


def _tree(total, leaves, dtype):
  """`leaves` 2-D leaves of the same width, a mix of row counts, `total` in all."""
  width = 1024
  rows = max(1, int(total) // (leaves * width))
  keys = jax.random.split(jax.random.key(0), leaves)
  return {f"layer{i:03d}": jax.random.normal(k, (rows + (i % 3), width), jnp.float32).astype(dtype)
          for i, k in enumerate(keys)}


def _problem(args, dtype_name):
  """The parameters, their count, and the two optimizers every table compares."""
  params = _tree(args.params, args.leaves, jnp.dtype(dtype_name))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
  return (params, sum(p.size for p in jax.tree.leaves(params)),
          jaxops.optim.adamw(schedule, weight_decay=0.01), optax.adamw(schedule, weight_decay=0.01))


def _train_step_table(args):
  """A jitted train step per variant: loss, gradients, AdamW update, applied."""
  print(f"# train step: grads = jax.grad(loss) in the same jit (loss: one [{args.batch}, rows] "
        "x [rows, 1024] matmul per leaf), params and state donated; median of "
        f"{args.runs} runs per round, median over {args.rounds} interleaved rounds")
  print(f"{'variant':<8} {'params':>10} {'leaves':>6} {'dtype':<9} {'ms':>9} {'sys':>4} "
        f"{'vs optax':>8}")
  for dtype_name in args.dtypes:
    params, count, ours, theirs = _problem(args, dtype_name)
    batch = jax.tree.map(lambda p: jax.random.normal(
        jax.random.key(1), (args.batch, p.shape[0]), p.dtype), params)

    def loss(params, batch):
      # A cheap model: the gradient of each leaf is one small-batch matmul.
      return sum(jnp.mean(jnp.square(x @ w).astype(jnp.float32))
                 for x, w in zip(jax.tree.leaves(batch), jax.tree.leaves(params)))

    def apply_step(tx):
      def train_step(params, state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
      return train_step

    def fused_step(params, state, batch):
      return ours.step(jax.grad(loss)(params, batch), state, params)

    variants = (("optax", apply_step(theirs), theirs), ("update", apply_step(ours), ours),
                ("step", fused_step, ours))
    # Interleaved rounds: on a shared machine the load drifts between variants;
    # each round times every variant, and the table gives the median over rounds.
    medians = {name: [] for name, _, _ in variants}
    sys_shares = {name: [] for name, _, _ in variants}
    for _ in range(args.rounds):
      for name, fn, tx in variants:
        t = time_jitted(fn, params, tx.init(params), batch, runs=args.runs, donate_argnums=(0, 1))
        medians[name].append(t.median_ms)
        sys_shares[name].append(t.sys_share)
    optax_ms = statistics.median(medians["optax"])
    for name, _, _ in variants:
      ms = statistics.median(medians[name])
      rounds = " ".join(f"{x:.1f}" for x in medians[name])
      print(f"{name:<8} {count:>10} {args.leaves:>6} {dtype_name:<9} {ms:>9.2f} "
            f"{statistics.median(sys_shares[name]):>4.0%} {optax_ms / ms:>7.2f}x   rounds: {rounds}",
            flush=True)


def main(argv=()):
  args = _parse(argv)
  print(f"# {machine_line()}")
  if args.train:
    _train_step_table(args)
  if not args.update:
    return 0
  print(f"# median of {args.runs} runs after warm-up; params and state donated; GB/s counts "
        "7 arrays (grads, params, m, v read; params, m, v written), moments float32")
  print(f"{'variant':<8} {'params':>10} {'leaves':>6} {'dtype':<9} {'ms':>9} {'GB/s':>6} "
        f"{'sys':>4} {'vs optax':>8}")
  for dtype_name in args.dtypes:
    params, count, ours, theirs = _problem(args, dtype_name)
    grads = jax.tree.map(lambda p: (0.01 * p).astype(p.dtype), params)
    moved = count * (3 * jnp.dtype(dtype_name).itemsize + 4 * 4)

    # Arguments in the order of the results (params, state): jit pairs donated
    # buffers with results of the same shape in order, so this pairs each
    # buffer with its own update and nothing is copied.
    def optax_step(grads, params, state):
      updates, state = theirs.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    def update_step(grads, params, state):
      updates, state = ours.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    def fused_step(grads, params, state):
      return ours.step(grads, state, params)

    results = {}
    for name, fn, tx in (("optax", optax_step, theirs), ("update", update_step, ours),
                         ("step", fused_step, ours)):
      # time_jitted copies the donated arguments before each run.
      results[name] = time_jitted(fn, grads, params, tx.init(params), runs=args.runs,
                                  donate_argnums=(1, 2))
      t = results[name]
      print(f"{name:<8} {count:>10} {args.leaves:>6} {dtype_name:<9} {t.median_ms:>9.2f} "
            f"{moved / (t.median_ms * 1e-3) / 1e9:>6.1f} {t.sys_share:>4.0%} "
            f"{results['optax'].median_ms / t.median_ms:>7.2f}x", flush=True)
  return 0
