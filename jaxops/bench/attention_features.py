"""``python -m jaxops.bench attention_features``: what jaxops.attention's arguments for
current models cost, each against the same call without it and against XLA's jnp
reference, in the same process.

Cases (``--cases``), on self-attention of B x S tokens, N heads, head dim H:

* ``packed``: causal attention over S tokens packed from ``--documents``
  documents of equal length (segment ids). Peers: ``causal`` (is_causal over
  the whole row, no ids: what packing without ids costs), ``separate`` (one
  jaxops call per document, the ideal), ``xla`` (the jnp reference with the
  equivalent dense [B, 1, S, S] mask: what a user without segment ids runs).
* ``soft_cap``: causal with ``logits_soft_cap=50`` (Gemma). Peers: ``plain``
  (the same call without it), ``xla`` (the reference with the cap).
* ``sinks``: causal with per-head sinks (gpt-oss). Peers: ``plain``, ``xla``.
* ``mla``: causal with H = 192 for queries and keys and Hv = 128 (DeepSeek's
  MLA); the ``H`` of the shape is ignored. Peers: ``mha128`` (H = Hv = 128),
  ``xla``. The trailer gives the FLOP rate of the MLA call over mha128's.

Passes: forward, and forward+backward (``jax.vjp`` with respect to q, k, v with
a random cotangent). TFLOP/s counts the attended work of the subject:
2*B*N*S*S*(H + Hv) forward, halved by the causal mask, divided by the
documents for ``packed``; x3.5 for forward+backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops import reference
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, computed
from jaxops.bench.timing import random_like, time_implementations

_CASES = ["packed", "soft_cap", "sinks", "mla"]
_PASSES = ["fwd", "fwd+bwd"]
PRESETS = {
    "cpu": {"shapes": ["1x4096x8x64"], "dtypes": ["float32", "bfloat16"], "cases": _CASES,
            "passes": _PASSES, "runs": 5},
    "gpu": {"shapes": ["4x8192x16x128"], "dtypes": ["bfloat16"], "cases": _CASES,
            "passes": _PASSES, "runs": 3},
}
QUICK = {"cpu": {"shapes": ["1x4096x8x64"], "dtypes": ["float32"], "cases": ["packed"],
                 "passes": ["fwd"]},
         "gpu": {"shapes": ["4x8192x16x128"], "dtypes": ["bfloat16"], "cases": ["packed"],
                 "passes": ["fwd"]}}
_SOFT_CAP = 50.0


def parse(argv):
  parser = options.parser_for("attention_features", __doc__, PRESETS, QUICK)
  parser.add_argument("--shapes", nargs="+", default=None, help="B x S x N x H, e.g. 1x4096x8x64")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--cases", nargs="+", default=None, choices=_CASES)
  parser.add_argument("--passes", nargs="+", default=None, choices=_PASSES)
  parser.add_argument("--documents", type=int, default=8,
                      help="documents packed into each row (packed)")
  return options.parse(parser, argv, PRESETS, QUICK)


def _implementations(case, S, N, documents):
  """{name: fn(q, k, v)} of a case, jaxops (the subject) first."""
  causal = functools.partial(jaxops.attention, is_causal=True)
  if case == "packed":
    ids = jnp.asarray(np.repeat(np.arange(documents, dtype=np.int32), S // documents)[None])
    dense = (ids[:, :, None] == ids[:, None, :])[:, None]
    n = S // documents

    def separate(q, k, v):
      return jnp.concatenate([causal(q[:, i * n:(i + 1) * n], k[:, i * n:(i + 1) * n],
                                     v[:, i * n:(i + 1) * n]) for i in range(documents)], axis=1)

    return {"jaxops": lambda q, k, v: causal(q, k, v, query_segment_ids=ids,
                                             key_value_segment_ids=ids),
            "causal": causal, "separate": separate,
            "xla": lambda q, k, v: reference.attention(q, k, v, mask=dense, is_causal=True)}
  if case == "soft_cap":
    return {"jaxops": lambda q, k, v: causal(q, k, v, logits_soft_cap=_SOFT_CAP),
            "plain": causal,
            "xla": lambda q, k, v: reference.attention(q, k, v, is_causal=True,
                                                       logits_soft_cap=_SOFT_CAP)}
  if case == "sinks":
    sinks = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
    return {"jaxops": lambda q, k, v: causal(q, k, v, sinks=sinks), "plain": causal,
            "xla": lambda q, k, v: reference.attention(q, k, v, is_causal=True, sinks=sinks)}
  # mla: q, k carry H = 192 and v Hv = 128; mha128 uses the first 128 of q and k.
  return {"jaxops": causal,
          "mha128": lambda q, k, v: causal(q[..., :128], k[..., :128], v),
          "xla": lambda q, k, v: reference.attention(q, k, v, is_causal=True)}


def _pass(pass_name, fn):
  if pass_name == "fwd+bwd":
    def f(q, k, v, d):
      _, vjp = jax.vjp(fn, q, k, v)
      return vjp(d)
  else:
    def f(q, k, v, d):
      return fn(q, k, v)
  return f


def _flops(case, B, S, N, H, Hv, documents, pass_name):
  attended = S * S / (documents if case == "packed" else 1)
  return 2.0 * B * N * attended * (H + Hv) * 0.5 * (3.5 if pass_name == "fwd+bwd" else 1.0)


def main(argv=()):
  args = parse(argv)
  columns = ["jaxops", "causal", "separate", "plain", "mha128", "xla"]
  reporter = Reporter("attention_features", args, argv,
                      [("shape BxSxNxH", 14), ("dtype", 9), ("case", 9), ("pass", 8)],
                      columns, ("flops",), memory=True)
  reporter.header("TFLOP/s = the subject's attended work (2*B*N*S*S*(H+Hv)/2, /documents "
                  "when packed, x3.5 fwd+bwd) / time; peers per case (module docstring)")
  for shape_text in args.shapes:
    B, S, N, H = options.dims(shape_text)
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      for case in args.cases:
        Hq, Hv = (192, 128) if case == "mla" else (H, H)
        keys = jax.random.split(jax.random.key(0), 3)
        q, k = (jax.random.normal(key, (B, S, N, Hq), jnp.float32).astype(dtype)
                for key in keys[:2])
        v = jax.random.normal(keys[2], (B, S, N, Hv), jnp.float32).astype(dtype)
        dout = random_like((B, S, N, Hv), dtype)
        impls = _implementations(case, S, N, args.documents)
        for pass_name in args.passes:
          # XLA's reference is timed on its own: interleaved, the call after
          # it pays the page faults of re-growing memory its [S, S] buffers
          # gave back (measured: ~30 ms of system time on the next call).
          fns = {name: _pass(pass_name, fn) for name, fn in impls.items()}
          xla = fns.pop("xla")
          timings = time_implementations(fns, q, k, v, dout, runs=args.runs, interleave=True)
          timings.update(time_implementations({"xla": xla}, q, k, v, dout, runs=args.runs,
                                              interleave=True))
          trailer = ""
          if case == "mla" and "mha128" in timings:
            rate = (Hq + Hv) / timings["jaxops"].ms / ((128 + 128) / timings["mha128"].ms)
            trailer = f"  FLOP rate over mha128's {rate:.2f}"
          reporter.add([shape_text, dtype_name, case, pass_name],
                       Result(f"attention {case}", shape_text, dtype_name, pass_name, timings,
                              computed(_flops(case, B, S, N, Hq, Hv, args.documents,
                                              pass_name))), trailer)
  return 0
