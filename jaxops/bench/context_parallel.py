"""``python -m jaxops.bench context_parallel`` (also ``python -m jaxops.bench attention
--context-parallel``): attention over a sequence split along a mesh axis of
``--devices`` devices, time and temporary memory per device.

For each shape (B, S, N, H) (self-attention, T = S, K = N), dtype and mask
(full, causal), forward and forward+backward (``jax.vjp`` with respect to q, k,
v with a random cotangent), with q, k and v split along their sequence axis:

* ``jaxops``: ``jaxops.ring_attention(strategy="ring")`` inside ``jax.shard_map``
  (layout zigzag when causal, contiguous otherwise): K/V blocks go around the
  ring, memory O(S/P) per device;
* ``all_gather``: ``jaxops.ring_attention(strategy="all_gather")``: K/V gathered
  once per device, memory O(S);
* ``attention``: ``jaxops.attention`` under ``jit`` on the sequence-sharded
  arrays: its sharding rule keeps the sequence whole, so XLA gathers it;
* ``xla``: jaxops' jnp reference under ``jit`` on the sequence-sharded arrays:
  XLA's own partitioning of dense attention.

The memory is the figure: "temp MiB" is XLA's temporary allocation of the
compiled program, per device. On CPU host devices the time only hints at
anything: all the "devices" share the machine's cores, and a transfer is a
memory copy. TFLOP/s counts the attention FLOPs of the whole sequence,
4*B*N*S*S*H (x0.5 causal, x3.5 forward+backward), over the time. On the CPU
the host devices are made here (``--xla_force_host_platform_device_count``,
added to ``XLA_FLAGS`` before JAX starts its backend).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxops
from jaxops import reference
from jaxops.bench import options
from jaxops.bench.results import Reporter, Result, computed
from jaxops.bench.timing import forward_or_backward, random_like, time_implementations

_AXIS = "seq"
_PASSES = ["fwd", "fwd+bwd"]
_FLOPS_OVER_FORWARD = {"fwd": 1.0, "fwd+bwd": 3.5}
_IMPLS = ["jaxops", "all_gather", "attention", "xla"]
PRESETS = {
    "cpu": {"shapes": ["1x8192x4x64"], "dtypes": ["float32"],
            "masks": ["causal", "full"], "passes": _PASSES, "devices": 8, "runs": 3},
    "gpu": {"shapes": ["1x32768x32x128", "1x131072x32x128"], "dtypes": ["bfloat16"],
            "masks": ["causal", "full"], "passes": _PASSES, "devices": 8, "runs": 3},
}
QUICK = {"cpu": {"shapes": ["1x8192x4x64"], "dtypes": ["float32"], "masks": ["causal"],
                 "passes": ["fwd"]},
         "gpu": {"shapes": ["1x32768x32x128"], "dtypes": ["bfloat16"], "masks": ["causal"],
                 "passes": ["fwd"]}}
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def parse(argv):
  parser = options.parser_for("context_parallel", __doc__, PRESETS, QUICK)
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="B x S x N x H of the whole sequence, e.g. 1x8192x4x64")
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--masks", nargs="+", default=None, choices=["full", "causal"])
  parser.add_argument("--passes", nargs="+", default=None, choices=_PASSES)
  parser.add_argument("--devices", type=int, default=None,
                      help="devices the sequence is split over (the ring's size)")
  parser.add_argument("--impls", nargs="+", default=None, choices=_IMPLS,
                      help="default: all")
  return options.parse(parser, argv, PRESETS, QUICK)


def _ask_for_host_devices(argv):
  """On the CPU, enough host devices for the largest --devices asked (the CPU
  preset's 8 by default). XLA reads the flag once, when JAX starts its backend,
  so this runs before anything asks JAX for a device."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _HOST_DEVICES_FLAG in flags:
    return
  asked = [int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--devices"]
  wanted = max([PRESETS["cpu"]["devices"], *asked])
  os.environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICES_FLAG}={wanted}".strip()


def _flops(shape, causal, pass_name):
  B, S, N, H = shape
  return 4.0 * B * N * S * S * H * (0.5 if causal else 1.0) * _FLOPS_OVER_FORWARD[pass_name]


def _implementations(mesh, causal):
  """{name: fn(q, k, v)} on the whole (sequence-sharded) arrays."""
  spec = P(None, _AXIS)

  def ring(strategy):
    layout = "zigzag" if causal else "contiguous"
    body = lambda q, k, v: jaxops.ring_attention(q, k, v, axis_name=_AXIS, is_causal=causal,
                                                 layout=layout, strategy=strategy)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

  sharded = NamedSharding(mesh, spec)
  keep_sharded = lambda fn: lambda q, k, v: jax.lax.with_sharding_constraint(fn(q, k, v), sharded)
  return {
      "jaxops": ring("ring"),
      "all_gather": ring("all_gather"),
      "attention": keep_sharded(lambda q, k, v: jaxops.attention(q, k, v, is_causal=causal)),
      "xla": keep_sharded(lambda q, k, v: reference.attention(q, k, v, is_causal=causal)),
  }


def main(argv=()):
  argv = list(argv)
  _ask_for_host_devices(argv)
  args = parse(argv)
  if len(jax.devices()) < args.devices:
    raise SystemExit(f"context_parallel: --devices {args.devices} but JAX has "
                     f"{len(jax.devices())} ({jax.default_backend()}); on the CPU set "
                     f"XLA_FLAGS={_HOST_DEVICES_FLAG}={args.devices} before JAX starts")
  mesh = jax.make_mesh((args.devices,), (_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:args.devices])
  columns = args.impls or _IMPLS
  reporter = Reporter("context_parallel", args, argv,
                      [("shape BxSxNxH", 16), ("dtype", 9), ("mask", 7), ("pass", 8)], columns,
                      ("flops",), memory=True)
  reporter.header(f"sequence split over {args.devices} devices; TFLOP/s = 4*B*N*S*S*H (x0.5 "
                  "causal, x3.5 fwd+bwd) / time; temp = XLA's temporary allocation per device")
  sharded = NamedSharding(mesh, P(None, _AXIS))
  for shape_text in args.shapes:
    shape = options.dims(shape_text)
    for dtype_name in args.dtypes:
      dtype = jnp.dtype(dtype_name)
      q, k, v = (jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(dtype),
                                sharded) for key in jax.random.split(jax.random.key(0), 3))
      dout = jax.device_put(random_like(shape, dtype), sharded)
      for mask in args.masks:
        causal = mask == "causal"
        impls = _implementations(mesh, causal)
        for pass_name in args.passes:
          timings = time_implementations(
              {name: forward_or_backward(pass_name, impls[name]) for name in columns},
              q, k, v, dout, runs=args.runs, interleave=True)
          reporter.add([shape_text, dtype_name, mask, pass_name],
                       Result(f"context_parallel {mask}", shape_text, dtype_name, pass_name,
                              timings, computed(_flops(shape, causal, pass_name)),
                              extra={"devices": args.devices}))
  return 0
