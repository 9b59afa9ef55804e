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
"""

from __future__ import annotations

import argparse

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
  return parser.parse_args(argv)


def _tree(total, leaves, dtype):
  """`leaves` 2-D leaves of the same width, a mix of row counts, `total` in all."""
  width = 1024
  rows = max(1, int(total) // (leaves * width))
  keys = jax.random.split(jax.random.key(0), leaves)
  return {f"layer{i:03d}": jax.random.normal(k, (rows + (i % 3), width), jnp.float32).astype(dtype)
          for i, k in enumerate(keys)}


def main(argv=()):
  args = _parse(argv)
  print(f"# {machine_line()}")
  print(f"# median of {args.runs} runs after warm-up; params and state donated; GB/s counts "
        "7 arrays (grads, params, m, v read; params, m, v written), moments float32")
  print(f"{'variant':<8} {'params':>10} {'leaves':>6} {'dtype':<9} {'ms':>9} {'GB/s':>6} "
        f"{'sys':>4} {'vs optax':>8}")
  for dtype_name in args.dtypes:
    dtype = jnp.dtype(dtype_name)
    params = _tree(args.params, args.leaves, dtype)
    count = sum(p.size for p in jax.tree.leaves(params))
    grads = jax.tree.map(lambda p: (0.01 * p).astype(p.dtype), params)
    moved = count * (3 * dtype.itemsize + 4 * 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
    ours = jaxops.optim.adamw(schedule, weight_decay=0.01)
    theirs = optax.adamw(schedule, weight_decay=0.01)

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
