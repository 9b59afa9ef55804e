"""``python -m jaxops.demo``: the jaxops norms inside a jitted, differentiated, vmapped step.

The norm traffic of a transformer layer (add_rms_norm -> an elementwise
stand-in for the sublayer -> layer_norm), run with jaxops kernels and with
``implementation="xla"`` (the plain jnp code XLA compiles) side by side:
forward + backward under ``jax.jit``, per-example weight gradients with
``jax.vmap(jax.grad(...))``, the two implementations checked against each
other, and the speed-up printed.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jaxops
from jaxops.bench.timing import machine_line
from jaxops.testing import assert_tree_close


def block(params, x, residual, implementation):
  """One residual step: h = x + residual; out = layer_norm(tanh(rms_norm(h)) + h).

  The sublayer is elementwise so that the norms, not a matmul, are what is timed.
  """
  y, h = jaxops.add_rms_norm(x, residual, params["rms_scale"], implementation=implementation)
  z = jnp.tanh(y) + h
  return jaxops.layer_norm(z, params["ln_scale"], params["ln_bias"],
                           implementation=implementation), h


def loss(params, x, residual, implementation):
  out, h = block(params, x, residual, implementation)
  return jnp.mean(out.astype(jnp.float32) ** 2) + 1e-3 * jnp.mean(h.astype(jnp.float32))


def _median_ms(fn, *args, runs):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
    del out
  return sorted(times)[len(times) // 2] * 1e3


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m jaxops.demo", description=__doc__)
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--hidden", type=int, default=4096)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  print(f"jaxops demo on {machine_line()}")

  keys = jax.random.split(jax.random.key(0), 2)
  d = args.hidden
  params = {
      "rms_scale": jnp.ones((d,), dtype),
      "ln_scale": jnp.ones((d,), dtype),
      "ln_bias": jnp.zeros((d,), dtype),
  }
  x = jax.random.normal(keys[0], (args.tokens, d)).astype(dtype)
  residual = jax.random.normal(keys[1], (args.tokens, d)).astype(dtype)

  step = {impl: jax.jit(jax.value_and_grad(lambda p, x, r, impl=impl: loss(p, x, r, impl)))
          for impl in (None, "xla")}
  (value, grads), (value_ref, grads_ref) = (step[None](params, x, residual),
                                            step["xla"](params, x, residual))
  assert_tree_close(value, value_ref, atol=1e-4, rtol=1e-3)
  assert_tree_close(grads, grads_ref, atol=1e-4, rtol=2e-3)
  print(f"loss {float(value):.6f} (jaxops) vs {float(value_ref):.6f} (xla); gradients agree")

  # Per-example gradients of the norm weights: vmap over a batch of sequences.
  per_example = {impl: jax.jit(jax.vmap(jax.grad(lambda p, x, r, impl=impl: loss(p, x, r, impl)),
                                        in_axes=(None, 0, 0)))
                 for impl in (None, "xla")}
  xb = x.reshape(8, -1, d)[:, :64]
  rb = residual.reshape(8, -1, d)[:, :64]
  assert_tree_close(per_example[None](params, xb, rb), per_example["xla"](params, xb, rb),
                    atol=1e-4, rtol=2e-3)
  print("vmap(grad): per-example weight gradients agree")

  print(f"\nforward+backward of the block, ({args.tokens}, {d}) {dtype.name}, "
        f"median of {args.runs} runs:")
  ms = {impl: _median_ms(step[impl], params, x, residual, runs=args.runs) for impl in (None, "xla")}
  print(f"  jaxops {ms[None]:8.2f} ms")
  print(f"  xla    {ms['xla']:8.2f} ms")
  print(f"  speed-up {ms['xla'] / ms[None]:.2f}x")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
