"""``python -m jaxops.bench adamw``: one AdamW step, jaxops.optim.adamw vs optax.adamw.

The parameters are a pytree of ``--leaves`` leaves with ``--params`` elements in
all (a few shapes). Every variant is a jitted step with the parameters and the
optimizer state donated (as a training loop does), against optax in the same
process:

* ``optax`` (the peer): ``optax.adamw(...).update`` + ``optax.apply_updates``
  (XLA fuses them);
* ``update``: ``jaxops.optim.adamw(...).update`` + ``optax.apply_updates``
  (the drop-in pattern: the jnp form under implementation=None, which XLA
  fuses with the application as it does optax's, so it should tie optax);
* ``step``: ``jaxops.optim.adamw(...).step`` (update and application in one
  kernel call for all leaves, parameters and moments written in place).

First a real train step (``--train``, on by default): the gradients come from
``jax.grad`` of a small loss in the same jit (one linear map per leaf on a
batch of ``--batch`` rows, whose gradient is a matmul output, as a model's
is). On the CPU the variants are timed in ``--rounds`` interleaved rounds (the
median over rounds: on a shared machine the load drifts between variants).

Then the update alone, with the gradients as an input. Bytes it must move:
the gradients read, the parameters and both moments read and written (in
their dtypes, as ``init`` makes them).
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import optax

import jaxops
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import time_call

_LABELS = [("variant", 8), ("params", 10), ("leaves", 6), ("dtype", 9)]
PRESETS = {
    "cpu": {"params": 100e6, "dtypes": ["float32"], "runs": 7, "rounds": 3},
    "gpu": {"params": 100e6, "dtypes": ["float32", "bfloat16"], "runs": 3, "rounds": 1},
}
QUICK = {"cpu": {"rounds": 1}, "gpu": {"dtypes": ["float32"]}}


def parse(argv):
  parser = options.parser_for("adamw", __doc__, PRESETS, QUICK)
  parser.add_argument("--params", type=float, default=None, help="parameters in all")
  parser.add_argument("--leaves", type=int, default=64)
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--rounds", type=int, default=None,
                      help="interleaved rounds of the train-step variants (median over rounds)")
  parser.add_argument("--batch", type=int, default=4, help="rows of the train step's batch")
  parser.add_argument("--no-train", dest="train", action="store_false",
                      help="skip the train-step table")
  parser.add_argument("--no-update", dest="update", action="store_false",
                      help="skip the table with the gradients as inputs")
  args = options.parse(parser, argv, PRESETS, QUICK)
  if args.quick:
    args.train = False  # the update alone is the representative case
  return args


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


def _applied(tx):
  """``tx.update`` then ``optax.apply_updates``, as a step of (grads, params, state)."""
  def step(grads, params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _fused(tx):
  return lambda grads, params, state: tx.step(grads, state, params)


_VARIANTS = {"update": "tx.update + apply_updates", "step": "tx.step"}


def _report(reporter, count, args, dtype_name, timings, table, work=None):
  """One row per jaxops variant, each against optax's timing."""
  for variant, call in _VARIANTS.items():
    reporter.add([variant, count, args.leaves, dtype_name],
                 Result(f"{table}: {call}", f"{count / 1e6:.1f}M params in {args.leaves} leaves",
                        dtype_name, "step",
                        {"jaxops": timings[variant], "optax": timings["optax"]}, work))


def _train_step_table(args, reporter):
  """A jitted train step per variant: loss, gradients, AdamW update, applied."""
  reporter.header(f"train step: grads = jax.grad(loss) in the same jit (loss: one [{args.batch}, "
                  "rows] x [rows, 1024] matmul per leaf), params and state donated; the median "
                  f"over {args.rounds} interleaved rounds")
  for dtype_name in args.dtypes:
    params, count, ours, theirs = _problem(args, dtype_name)
    batch = jax.tree.map(lambda p: jax.random.normal(
        jax.random.key(1), (args.batch, p.shape[0]), p.dtype), params)

    def loss(params, batch):
      # A cheap model: the gradient of each leaf is one small-batch matmul.
      return sum(jnp.mean(jnp.square(x @ w).astype(jnp.float32))
                 for x, w in zip(jax.tree.leaves(batch), jax.tree.leaves(params)))

    def train_step(step, tx):
      return lambda params, state, batch: step(jax.grad(loss)(params, batch), params, state)

    variants = {"optax": (train_step(_applied(theirs), theirs), theirs),
                "update": (train_step(_applied(ours), ours), ours),
                "step": (train_step(_fused(ours), ours), ours)}
    rounds = {name: [] for name in variants}
    for _ in range(args.rounds):
      for name, (fn, tx) in variants.items():
        rounds[name].append(time_call(fn, params, tx.init(params), batch, runs=args.runs,
                                      donate_argnums=(0, 1)))
    timings = {name: dataclasses.replace(
        ts[0], ms=statistics.median(t.ms for t in ts),
        method=f"{ts[0].method}; median over {args.rounds} interleaved rounds")
        for name, ts in rounds.items()}
    _report(reporter, count, args, dtype_name, timings, "train step")


def _update_table(args, reporter):
  reporter.header("the update alone: params and state donated; GB/s counts the gradients read, "
                  "the parameters and moments read and written")
  for dtype_name in args.dtypes:
    params, count, ours, theirs = _problem(args, dtype_name)
    grads = jax.tree.map(lambda p: (0.01 * p).astype(p.dtype), params)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(ours.init(params)))
    params_bytes = sum(p.nbytes for p in jax.tree.leaves(params))
    work = moved(params_bytes + 2 * (params_bytes + state_bytes))
    # Arguments in the order of the results (params, state): jit pairs donated
    # buffers with results of the same shape in order, so this pairs each
    # buffer with its own update and nothing is copied.
    timings = {name: time_call(fn, grads, params, tx.init(params), runs=args.runs,
                               donate_argnums=(1, 2))
               for name, fn, tx in (("optax", _applied(theirs), theirs),
                                    ("update", _applied(ours), ours), ("step", _fused(ours), ours))}
    _report(reporter, count, args, dtype_name, timings, "update alone", work)


def main(argv=()):
  args = parse(argv)
  reporter = Reporter("adamw", args, argv, _LABELS, ["jaxops", "optax"])
  if args.train:
    _train_step_table(args, reporter)
  if args.update:
    _update_table(args, reporter)
  return 0
