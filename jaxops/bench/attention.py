"""``python -m jaxops.bench attention``: jaxops.attention vs jax.nn.dot_product_attention and
the jnp composition.

For each shape (B, S, N, H) (self-attention, T = S, K = N), dtype and mask
(full, causal): forward, forward+backward (``jax.vjp`` with respect to q, k, v
with a random cotangent) and jvp (forward mode: the output and its tangent for
tangents of q, k and v), for each implementation in the same process:

* ``jaxops``: jaxops.attention;
* ``cudnn``: jax.nn.dot_product_attention(implementation="cudnn"), on a GPU
  only, bfloat16 and float16 (a case cuDNN refuses is reported as skipped);
* ``jax.nn``: jax.nn.dot_product_attention(implementation="xla");
* ``xla``: jaxops' jnp reference (``implementation="xla"``) under XLA;
* ``torch``: torch.nn.functional.scaled_dot_product_attention, on the CPU when
  torch imports (jaxops/bench/torch_peer.py: an optional peer, with JAX's
  thread count), on the same values as views [B, N, S, H] of the same
  [B, S, N, H] memory; fwd+bwd by torch.autograd.grad, jvp by torch.func.jvp,
  with SDPA's math backend where the default one refuses forward mode (torch
  2.13's CPU flash kernel does); a pass torch refuses is reported as skipped,
  with its reason. Each result records torch's version, threads, instruction
  set and SDPA backend (held to jaxops' variant: jaxops/bench/torch_peer.py).

Compute-bound: TFLOP/s counts 4*B*N*T*S*H forward flops, half when causal;
the backward 2.5x the forward, the JVP 3x (the products of q.k, dq.k, q.dk,
and of the probabilities and their tangent with v and dv); the roofline is
the device's matmul rate. Also XLA's temporary allocation for each compiled
program, and for the jvp pass jaxops' JVP time over its own forward time.
float32 on a GPU: jax.nn and the jnp reference run their products at XLA's
default precision (TF32).

On the CPU the implementations' runs are interleaved (one run of each in
turn), so load from other processes on a shared machine weighs on all of them
alike and the speed-ups stay meaningful when the absolute times do not.

``--context-parallel``: the sequence split over devices instead
(``python -m jaxops.bench context_parallel``: the ring, the all-gather
strategy and XLA's partitioning, time and memory per device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops
from jaxops import reference
from jaxops.bench import options, torch_peer
from jaxops.bench.results import Reporter, Result, computed
from jaxops.bench.timing import (Eager, platform_of, random_like, time_implementations,
                                  uses_device_timing)

_IMPLS = {
    "jaxops": lambda q, k, v, causal: jaxops.attention(q, k, v, is_causal=causal),
    "cudnn": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"),
    "jax.nn": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"),
    "xla": lambda q, k, v, causal: reference.attention(q, k, v, is_causal=causal),
}
_PASSES = ["fwd", "fwd+bwd", "jvp"]
_FLOPS_OVER_FORWARD = {"fwd": 1.0, "fwd+bwd": 3.5, "jvp": 3.0}
PRESETS = {
    "cpu": {"shapes": ["1x2048x8x64", "4x1024x12x64", "1x4096x8x128"],
            "dtypes": ["float32", "bfloat16"], "masks": ["full", "causal"], "passes": _PASSES,
            "runs": 5},
    "gpu": {"shapes": ["4x4096x16x64", "4x4096x16x128"], "dtypes": ["bfloat16", "float32"],
            "masks": ["causal", "full"], "passes": ["fwd", "fwd+bwd"], "runs": 3},
}
QUICK = {"cpu": {"shapes": ["1x2048x8x64"], "dtypes": ["float32"], "masks": ["causal"],
                 "passes": ["fwd"]},
         "gpu": {"shapes": ["4x4096x16x128"], "dtypes": ["bfloat16"], "masks": ["causal"],
                 "passes": ["fwd"]}}


def parse(argv):
  parser = options.parser_for("attention", __doc__, PRESETS, QUICK)
  parser.add_argument("--shapes", nargs="+", default=None, help="B x S x N x H, e.g. 1x2048x8x64")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--masks", nargs="+", default=None, choices=["full", "causal"])
  parser.add_argument("--passes", nargs="+", default=None, choices=_PASSES)
  parser.add_argument("--impls", nargs="+", default=None, choices=[*_IMPLS, torch_peer.NAME],
                      help="default: all (cudnn on a GPU only, torch on the CPU where it "
                      "imports)")
  return options.parse(parser, argv, PRESETS, QUICK)


def _flops(shape, causal, pass_name):
  B, S, N, H = shape
  return 4.0 * B * N * S * S * H * (0.5 if causal else 1.0) * _FLOPS_OVER_FORWARD[pass_name]


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


def _torch_passes(pass_name, causal) -> list:
  """torch's SDPA for one pass: [(backend, Eager peer of (q, k, v, d) as ``_pass``
  defines them)], the candidates in the order tried."""
  torch = torch_peer.torch()
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def prepare(*arrays):
    # [B, S, N, H] -> torch's [B, N, S, H]: strided views, the memory layout jaxops reads.
    q, k, v, d = (torch_peer.to_torch(a).transpose(1, 2) for a in arrays)
    if pass_name == "fwd+bwd":
      q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v, d

  if pass_name == "fwd+bwd":
    def f(q, k, v, d):
      return torch.autograd.grad(sdpa(q, k, v, is_causal=causal), (q, k, v), d)
  elif pass_name == "jvp":
    def jvp(q, k, v, d):
      return torch.func.jvp(lambda q, k, v: sdpa(q, k, v, is_causal=causal), (q, k, v),
                            (d, q, v))

    def math_jvp(q, k, v, d):
      with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return jvp(q, k, v, d)
    return [("default", Eager(jvp, prepare)), ("math", Eager(math_jvp, prepare))]
  else:
    def f(q, k, v, d):
      with torch.no_grad():
        return sdpa(q, k, v, is_causal=causal)
  return [("default", Eager(f, prepare))]


def _torch_peer(pass_name, causal, *args):
  """(Eager peer, its description) of the first candidate torch runs on ``args``,
  or (None, the first refusal)."""
  first_refusal = None
  for backend, peer in _torch_passes(pass_name, causal):
    refusal = torch_peer.refusal(peer, *args)
    if refusal is None:
      return peer, {**torch_peer.describe(), "sdpa_backend": backend}
    first_refusal = first_refusal or refusal
  return None, first_refusal


def torch_applies() -> bool:
  """Whether torch's SDPA is a peer: on the CPU, where torch imports."""
  return not uses_device_timing(platform_of(())) and torch_peer.available()


def cudnn_applies(dtype_name: str) -> bool:
  """Whether jax.nn's cuDNN attention is a peer: on a GPU, in bfloat16 and float16."""
  return uses_device_timing(platform_of(())) and dtype_name in ("bfloat16", "float16")


def main(argv=()):
  if "--context-parallel" in argv:  # the sequence split over devices: its own family
    from jaxops.bench import context_parallel
    return context_parallel.main([a for a in argv if a != "--context-parallel"])
  args = parse(argv)
  columns = args.impls or [name for name in _IMPLS
                           if name != "cudnn" or uses_device_timing(platform_of(()))]
  if args.impls is None and torch_applies():
    columns.append(torch_peer.NAME)
  if torch_peer.NAME in columns and not torch_applies():
    raise SystemExit("attention: --impls torch needs torch importable and a CPU backend")
  reporter = Reporter("attention", args, argv, [("shape BxSxNxH", 14), ("dtype", 9), ("mask", 7),
                                                ("pass", 8)], columns, ("flops",), memory=True)
  if torch_peer.NAME in columns:
    print(f"# torch peer: {torch_peer.describe()}")
  reporter.header("TFLOP/s = 4*B*N*T*S*H (x0.5 causal, x3.5 fwd+bwd, x3 jvp) / time; temp = "
                  "XLA's temporary allocation; jvp/fwd = jaxops' jvp time over its forward time")
  for shape_text in args.shapes:
    shape = options.dims(shape_text)
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype)
                 for key in jax.random.split(jax.random.key(0), 3))
      dout = random_like(shape, dtype)
      impls = [name for name in columns if name != "cudnn" or cudnn_applies(dtype_name)]
      jax_impls = [name for name in impls if name != torch_peer.NAME]
      for mask in args.masks:
        causal = mask == "causal"
        jaxops_forward_ms = None
        for pass_name in args.passes:
          fns = {impl: _pass(pass_name, _IMPLS[impl], causal) for impl in jax_impls}
          extra = {}
          if torch_peer.NAME in impls:
            peer, about = _torch_peer(pass_name, causal, q, k, v, dout)
            if peer is not None:
              fns[torch_peer.NAME] = peer
              extra[torch_peer.NAME] = about
          timings = time_implementations(fns, q, k, v, dout, runs=args.runs, interleave=True,
                                         may_refuse=("cudnn",))
          if torch_peer.NAME in impls and peer is None:
            timings[torch_peer.NAME] = about
          ours = timings.get("jaxops")
          trailer = ""
          if ours and pass_name == "fwd":
            jaxops_forward_ms = ours.ms
          if ours and pass_name == "jvp" and jaxops_forward_ms:
            trailer = f"  jvp/fwd {ours.ms / jaxops_forward_ms:.2f}"
          reporter.add([shape_text, dtype_name, mask, pass_name],
                       Result(f"attention {mask}", shape_text, dtype_name, pass_name, timings,
                              computed(_flops(shape, causal, pass_name)), extra), trailer)
  return 0
