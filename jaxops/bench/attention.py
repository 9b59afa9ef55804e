"""``python -m jaxops.bench attention``: jaxops.attention vs jax.nn.dot_product_attention and
the jnp composition.

For each shape (B, S, N, H) (self-attention, T = S, K = N), dtype and mask
(full, causal): forward, forward+backward (a VJP with respect to q, k, v) and
jvp (forward mode: the output and its tangent for tangents of q, k and v), for
each implementation in the same process. Prints median ms, GFLOP/s and XLA's
peak temporary memory for the compiled program, and for the jvp pass jaxops'
JVP time over its own forward time. Flops: 4*B*N*T*S*H forward, half when
causal; the backward counts 2.5x the forward, the JVP 3x (the products of
q.k, dq.k, q.dk, and of the probabilities and their tangent with v and dv).

The implementations' runs are interleaved (one run of each in turn), so load
from other processes on a shared machine weighs on all of them alike and the
speed-ups stay meaningful when the absolute times do not. Each timed call
starts after a short pause (``timing.settle``), so the clean-up XLA does on
another thread after the previous call does not land in it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jaxops
from jaxops import reference
from jaxops.bench.timing import machine_line, settle

_IMPLS = {
    "jaxops": lambda q, k, v, causal: jaxops.attention(q, k, v, is_causal=causal),
    "jax.nn": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"),
    "jnp": lambda q, k, v, causal: reference.attention(q, k, v, is_causal=causal),
}


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench attention", description=__doc__)
  parser.add_argument("--shapes", nargs="+", default=["1x2048x8x64", "4x1024x12x64", "1x4096x8x128"],
                      help="B x S x N x H, e.g. 1x2048x8x64")
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd", "jvp"],
                      choices=["fwd", "fwd+bwd", "jvp"])
  parser.add_argument("--impls", nargs="+", default=list(_IMPLS), choices=list(_IMPLS))
  parser.add_argument("--runs", type=int, default=5)
  return parser.parse_args(argv)


def _time_interleaved(fns, args, runs):
  """(median ms, XLA temporary bytes or None) of each jitted fn, runs interleaved."""
  compiled = [jax.jit(fn).lower(*args).compile() for fn in fns]
  temps = []
  for c in compiled:
    try:
      temps.append(c.memory_analysis().temp_size_in_bytes)
    except Exception:  # not every backend reports it
      temps.append(None)
  for c in compiled:
    jax.block_until_ready(c(*args))
  times = [[] for _ in compiled]
  for _ in range(runs):
    for c, t in zip(compiled, times):
      settle()
      start = time.perf_counter()
      out = jax.block_until_ready(c(*args))
      t.append((time.perf_counter() - start) * 1e3)
      del out
  return [(statistics.median(t), temp) for t, temp in zip(times, temps)]


_FLOPS_OVER_FORWARD = {"fwd": 1.0, "fwd+bwd": 3.5, "jvp": 3.0}


def _gflops(shape, causal, pass_name, ms):
  B, S, N, H = shape
  flops = 4.0 * B * N * S * S * H * (0.5 if causal else 1.0) * _FLOPS_OVER_FORWARD[pass_name]
  return flops / (ms * 1e-3) / 1e9


def _pass(pass_name, fn, causal):
  """The timed function of (q, k, v, d) for one pass; d is the output cotangent
  (fwd+bwd), or the tangent of q (jvp; those of k and v are q and v, arrays of their
  shape already in memory)."""
  if pass_name == "fwd+bwd":
    def f(q, k, v, d):
      _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
      return vjp(d)
  elif pass_name == "jvp":
    def f(q, k, v, d):
      return jax.jvp(lambda q, k, v: fn(q, k, v, causal), (q, k, v), (d, q, v))
  else:
    def f(q, k, v, d):
      return fn(q, k, v, causal)
  return f


def main(argv=()):
  args = _parse(argv)
  print(f"# {machine_line()}")
  print(f"# median of {args.runs} interleaved runs after warm-up; GFLOP/s = 4*B*N*T*S*H (x0.5 causal, x3.5 "
        "fwd+bwd, x3 jvp) / time; temp = XLA's temporary allocation; x = speed-up of jaxops over "
        "it; jvp/fwd = jaxops' jvp time over its forward time")
  header = f"{'shape BxSxNxH':<14} {'dtype':<9} {'mask':<7} {'pass':<8}"
  for impl in args.impls:
    header += f" {impl + ' ms':>11} {'GFLOP/s':>8} {'temp MiB':>9}"
    if impl != "jaxops" and "jaxops" in args.impls:
      header += f" {'x':>6}"
  print(header)
  for shape_text in args.shapes:
    shape = tuple(int(s) for s in shape_text.split("x"))
    B, S, N, H = shape
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      keys = jax.random.split(jax.random.key(0), 4)
      q, k, v, dout = (jax.random.normal(key, (B, S, N, H), jnp.float32).astype(dtype)
                       for key in keys)
      for mask in args.masks:
        causal = mask == "causal"
        jaxops_forward_ms = None
        for pass_name in args.passes:
          line = f"{shape_text:<14} {dtype_name:<9} {mask:<7} {pass_name:<8}"
          fns = [_pass(pass_name, _IMPLS[impl], causal) for impl in args.impls]
          results = dict(zip(args.impls, _time_interleaved(fns, (q, k, v, dout), args.runs)))
          for impl in args.impls:
            ms, temp_bytes = results[impl]
            temp = "-" if temp_bytes is None else f"{temp_bytes / 2**20:.1f}"
            line += f" {ms:>11.2f} {_gflops(shape, causal, pass_name, ms):>8.1f} {temp:>9}"
            if impl != "jaxops" and "jaxops" in results:
              line += f" {ms / results['jaxops'][0]:>5.1f}x"
          if "jaxops" in results and pass_name == "fwd":
            jaxops_forward_ms = results["jaxops"][0]
          if "jaxops" in results and pass_name == "jvp" and jaxops_forward_ms:
            line += f"  jvp/fwd {results['jaxops'][0] / jaxops_forward_ms:.2f}"
          print(line, flush=True)
  return 0
