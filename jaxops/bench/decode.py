"""``python -m jaxops.bench decode``: decoding against a KV cache, at the memory-bandwidth limit.

Decoding reads the whole KV cache for a few query rows, so its measure is the
cache's bytes (K and V read once: the bytes a step must move) over the time,
against what the machine can move: the roofline's copy bandwidth
(``jaxops.bench.roofline``), and the streaming read bandwidth measured in the
same run two ways: the best of a few jnp reductions over a 512 MiB buffer, far
larger than the caches (it prints which), and, on the CPU, a C++ loop summing
a 512 MiB buffer with every OpenMP thread (tools/stream_read_probe.cc). On a
GPU the "of stream" share is against the higher of the two; on the CPU each
case's step and the C++ probe are alternated, ``--rounds`` rounds (5 in the
cpu preset) of ``--runs`` each, and the share is the step's median rate over
the probe's median (this shared VM's probe moved 2x between minutes). Then it
times each case:
jaxops.attention with T new query tokens at the end of an S-token cache
(causal, traced query_offset = S - T), against its peers in the same run:
``cudnn`` (jax.nn.dot_product_attention(implementation="cudnn"), on a GPU in
bfloat16 and float16; a case cuDNN refuses is reported as skipped), ``jax.nn``
(the same with implementation="xla"; for T > 1 with the boolean mask of the
last T rows of a causal mask) and ``xla`` (jaxops.reference.attention under
jit). Then each bfloat16 case's time over its float32 twin's (half the bytes:
ideally 0.5).

How a step is timed on the CPU (``time_steps``): as a serving loop runs them,
back to back, and as the probes read, but never from the caches. Each case
gets enough copies of its arguments that together they are at least twice
the last-level cache; one run calls the step once per copy in turn, and its
time is the run's wall time over the copies (the median of ``runs`` runs). A
copy is therefore read after the others have evicted it. The other way, a
timed call after a pause (as ``timing.time_jitted`` does, for XLA's deferred
clean-up), measures this virtual machine waking its idle CPUs: measured, a
batch-1 float32 step with 64 cached tokens took 0.35 ms after a pause and
0.02 ms back to back, and a 4096-token one 2.1 ms after a pause (with the
cache evicted) against 1.4 ms back to back (partly from the L3). The peers
keep ``time_jitted``'s pause, which spares them the clean-up of their large
temporaries during their next call and so can only lower the speed-up. On a
GPU every implementation is timed on the device (``timing.time_on_device``;
the gpu preset's caches are far larger than its L2).

Cases are objects with a label, the cache bytes they read and a ``build()``
that gives ({implementation: function}, arguments), so other cache layouts
(the paged cache) add their own case lists to ``run_bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops import reference
from jaxops.bench import options
from jaxops.bench.attention import cudnn_applies
from jaxops.bench.results import Reporter, Result, moved
from jaxops.bench.timing import Timing, platform_of, temp_bytes, time_call, time_implementations

_STREAM_BYTES = 512 << 20
# When the machine does not say: the size of this one's (32 MiB).
_DEFAULT_LAST_LEVEL_CACHE = 32 << 20
# At most this many copies of a case's arguments (the smallest case here, int8
# pages of batch 1, needs 8).
_MAX_COPIES = 16

# Reductions XLA may lower differently (one thread or several, vector width):
# the fastest stands for the machine's streaming read bandwidth.
_STREAM_PROBES = {
    "jnp.sum": lambda x: jnp.sum(x),
    "jnp.max over rows": lambda x: jnp.max(x.reshape(-1, 4096), axis=1),
    "jnp.sum over rows": lambda x: jnp.sum(x.reshape(-1, 4096), axis=1),
}


def jnp_stream_bandwidth(runs: int) -> tuple[float, str]:
  """(GB/s, probe name) of the fastest jnp reduction reading a 512 MiB buffer."""
  x = jnp.ones((_STREAM_BYTES // 4,), jnp.float32)
  best = (0.0, "")
  for name, probe in _STREAM_PROBES.items():
    t = time_call(probe, x, runs=runs)
    best = max(best, (x.nbytes / (t.ms * 1e-3) / 1e9, name))
  return best


def cpp_stream_bandwidth(runs: int) -> float:
  """GB/s, the median of `runs` passes of the C++ probe over a 512 MiB buffer."""
  from jaxops import _jaxops_stream_probe
  return statistics.median(_jaxops_stream_probe.stream_read_gbs(_STREAM_BYTES, runs))


def last_level_cache_bytes() -> int:
  """The largest CPU cache's size, from sysfs (Linux), else 32 MiB."""
  sizes = []
  for path in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
    try:
      text = path.read_text().strip()
    except OSError:
      continue
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    digits = text.rstrip("KM")
    if digits.isdigit():
      sizes.append(int(digits) * scale)
  return max(sizes, default=_DEFAULT_LAST_LEVEL_CACHE)


def step_copies(cache_bytes: int) -> int:
  """How many copies of a step's cache add up to twice the last-level cache."""
  return min(_MAX_COPIES, max(1, math.ceil(2 * last_level_cache_bytes() / cache_bytes)))


def step_timer(cache_bytes: int):
  """The host method of a decode step reading ``cache_bytes``: ``time_steps``."""
  def timer(fn, *args, runs: int, donate_argnums=()):
    del donate_argnums  # a decode step donates nothing
    return time_steps(fn, args, cache_bytes, runs)
  return timer


def time_steps(fn, args, cache_bytes: int, runs: int) -> Timing:
  """The median time of one call of jit(fn) in back-to-back calls over copies of args.

  step_copies(cache_bytes) copies (the first is args itself), so each call
  reads its cache from memory.
  """
  copies = step_copies(cache_bytes)
  arg_sets = [args] + [jax.tree.map(lambda x: jnp.array(x, copy=True), args)
                       for _ in range(copies - 1)]
  compiled = jax.jit(fn).lower(*args).compile()
  for _ in range(2):
    for a in arg_sets:
      jax.block_until_ready(compiled(*a))
  per_call = []
  for _ in range(runs):
    start = time.perf_counter()
    outs = [compiled(*a) for a in arg_sets]
    jax.block_until_ready(outs)
    per_call.append((time.perf_counter() - start) / len(arg_sets))
    del outs
  return Timing(statistics.median(per_call) * 1e3,
                f"host: median of {runs} runs of back-to-back calls over {copies} copies of the "
                "arguments", None, temp_bytes(compiled))


def alternated_with_probe(fn, args, cache_bytes: int, runs: int, rounds: int,
                          probe_gbs: list) -> Timing:
  """``rounds`` rounds of the C++ probe (``runs`` passes) and then the step
  (``time_steps``), alternated so that both see the machine of the same
  minute; the step's median over the rounds, each round's probe rate appended
  to ``probe_gbs``. On this kind of shared VM the probe moved by 2x between
  runs minutes apart (docs/benchmarks-log.md, the fifth pass)."""
  steps = []
  for _ in range(rounds):
    probe_gbs.append(cpp_stream_bandwidth(runs))
    steps.append(time_steps(fn, args, cache_bytes, runs))
  median = statistics.median(t.ms for t in steps)
  return dataclasses.replace(
      steps[0], ms=median,
      method=f"{steps[0].method}; median of {rounds} rounds alternated with the C++ probe")


def alternating_timer(cache_bytes: int, rounds: int, probe_gbs: list):
  """The host method of a decode step on the CPU: ``alternated_with_probe``."""
  def timer(fn, *args, runs: int, donate_argnums=()):
    del donate_argnums  # a decode step donates nothing
    return alternated_with_probe(fn, args, cache_bytes, runs, rounds, probe_gbs)
  return timer


def stream_bandwidth(runs: int) -> tuple[float, str]:
  """(GB/s, probe name): the higher of the jnp and (on the CPU) the C++ probes; prints them."""
  jnp_gbs, jnp_probe = jnp_stream_bandwidth(runs)
  mib = _STREAM_BYTES >> 20
  print(f"# streaming read, jnp: {jnp_gbs:.1f} GB/s ({jnp_probe}, {mib} MiB, best of the probes)")
  best = (jnp_gbs, f"jnp {jnp_probe}")
  if platform_of(()) == "cpu":
    cpp_gbs = cpp_stream_bandwidth(runs)
    print(f"# streaming read, C++: {cpp_gbs:.1f} GB/s (OpenMP sum, every thread, {mib} MiB, "
          f"median of {runs})")
    best = max(best, (cpp_gbs, "C++ OpenMP sum"))
  return best


class DecodeCase:
  """What a decode case's label is made of; its dataclass has the fields batch,
  kv_len, num_heads, num_kv_heads, head_dim and dtype, and an ``op``."""

  @property
  def shape(self) -> str:
    return (f"B={self.batch} S={self.kv_len} N/K={self.num_heads}/{self.num_kv_heads} "
            f"H={self.head_dim}")

  @property
  def label(self) -> str:
    return f"{self.op} {self.shape} {self.dtype}"

  @property
  def twin(self) -> str:
    """The label of the same case in float32 (for the time ratio)."""
    return f"{self.op} {self.shape} float32"


@dataclasses.dataclass(frozen=True)
class DenseDecodeCase(DecodeCase):
  """jaxops.attention decoding T tokens of B sequences against a dense [B, S, K, H] cache."""
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str

  @property
  def op(self) -> str:
    return f"dense T={self.q_len}"

  @property
  def cache_bytes(self) -> int:
    return (2 * self.batch * self.kv_len * self.num_kv_heads * self.head_dim *
            jnp.dtype(self.dtype).itemsize)

  def build(self):
    rng = np.random.default_rng(0)
    B, T, S, N, K, H = (self.batch, self.q_len, self.kv_len, self.num_heads,
                        self.num_kv_heads, self.head_dim)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), self.dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), self.dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), self.dtype)
    offset = jnp.asarray(S - T, jnp.int32)
    # jax.nn takes the causal rows of the last T positions as a mask (none for T = 1).
    mask = None if T == 1 else (jnp.arange(T)[:, None] + S - T >= jnp.arange(S)[None, :])

    def jax_nn(implementation):
      return lambda q, k, v, o: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                             implementation=implementation)

    fns = {"jaxops": lambda q, k, v, o: jaxops.attention(q, k, v, is_causal=True, query_offset=o),
           "cudnn": jax_nn("cudnn"), "jax.nn": jax_nn("xla"),
           "xla": lambda q, k, v, o: reference.attention(q, k, v, is_causal=True, query_offset=o)}
    if not cudnn_applies(self.dtype):
      del fns["cudnn"]
    return fns, (q, k, v, offset)


def dense_cases(dtypes, q_lens, batch, kv_len) -> list[DenseDecodeCase]:
  """For each dtype: B sequences decoding each of q_lens tokens, and one sequence one token."""
  cases = []
  for dtype in dtypes:
    for T in q_lens:
      cases.append(DenseDecodeCase(batch, T, kv_len, 32, 8, 128, dtype))
    cases.append(DenseDecodeCase(1, 1, kv_len, 32, 8, 128, dtype))
  return cases


def print_dtype_ratios(cases, jaxops_ms: dict[str, float]) -> None:
  for case in cases:
    if case.dtype != "float32" and case.twin in jaxops_ms and case.label in jaxops_ms:
      print(f"{case.label}: {jaxops_ms[case.label] / jaxops_ms[case.twin]:.2f}x the float32 time")


def run_bench(family: str, args, argv, cases) -> None:
  """The ceilings, then every case against them, in one run: one row and JSON line each."""
  built = [(case, *case.build()) for case in cases]
  columns = list(dict.fromkeys(name for _, fns, _ in built for name in fns))
  reporter = Reporter(family, args, argv, [("case", 52)], columns)
  start = time.perf_counter()
  reporter.header("GB/s counts the K/V cache bytes read; 'of stream' = jaxops' share of the "
                  "streaming read bandwidth")
  stream_gbs, probe = stream_bandwidth(args.runs)
  # On the CPU each case's step alternates with the C++ probe (medians of the
  # rounds; the share is the step's median rate over the probe's median).
  rounds = getattr(args, "rounds", 1) if platform_of(()) == "cpu" else 0
  if rounds:
    print(f"# 'of stream': each case against the C++ probe, alternated with it in {rounds} "
          "rounds (medians of each)", flush=True)
  else:
    print(f"# 'of stream' against the higher: {stream_gbs:.1f} GB/s ({probe})", flush=True)
  jaxops_ms = {}
  for case, fns, call_args in built:
    probe_gbs = []
    timer = (alternating_timer(case.cache_bytes, rounds, probe_gbs) if rounds
             else step_timer(case.cache_bytes))
    timings = time_implementations(fns, *call_args, runs=args.runs, may_refuse=("cudnn",),
                                   host_timers={"jaxops": timer})
    work = moved(case.cache_bytes)
    jaxops_ms[case.label] = timings["jaxops"].ms
    rate = work.rate(timings["jaxops"].ms)
    if probe_gbs:
      probe_median = statistics.median(probe_gbs)
      note = f"  {rate / probe_median:.0%} of the probe's {probe_median:.1f} GB/s"
    else:
      note = f"  {rate / stream_gbs:.0%} of stream"
    reporter.add([case.label], Result(case.op, case.shape, case.dtype, "fwd", timings, work), note)
  print_dtype_ratios(cases, jaxops_ms)
  print(f"# {time.perf_counter() - start:.0f} s")


PRESETS = {
    "cpu": {"dtypes": ["float32", "bfloat16"], "q_lens": [1, 4], "batch": 8, "kv_len": 4096,
            "paged": True, "runs": 3, "rounds": 5},
    "gpu": {"dtypes": ["bfloat16", "float32"], "q_lens": [1, 4], "batch": 32, "kv_len": 8192,
            "paged": False, "runs": 3, "rounds": 1},
}
QUICK = {"cpu": {"dtypes": ["float32"], "q_lens": [1], "paged": False, "rounds": 1},
         "gpu": {"dtypes": ["bfloat16"], "q_lens": [1], "paged": False}}


def parse(argv):
  parser = options.parser_for("decode", __doc__, PRESETS, QUICK)
  parser.add_argument("--dtypes", nargs="+", default=None)
  parser.add_argument("--q-lens", nargs="+", type=int, default=None)
  parser.add_argument("--batch", type=int, default=None,
                      help="sequences of the batched cases (a batch-1 case is always added)")
  parser.add_argument("--kv-len", type=int, default=None, help="cached tokens per sequence")
  parser.add_argument("--rounds", type=int, default=None,
                      help="on the CPU, rounds of each case's step alternated with the C++ "
                      "streaming probe (--runs each; the shares are of the medians)")
  parser.add_argument("--paged", action=argparse.BooleanOptionalAction, default=None,
                      help="also the paged cache's cases (python -m jaxops.bench paged_attention)")
  return options.parse(parser, argv, PRESETS, QUICK)


def main(argv=()):
  args = parse(argv)
  cases = dense_cases(args.dtypes, args.q_lens, args.batch, args.kv_len)
  if args.paged:
    # The paged cache's decode (jaxops/bench/paged_attention.py) in the same run,
    # against the same bandwidth: the same dtypes and int8 pages, batch B and 1.
    from jaxops.bench.paged_attention import paged_cases
    cases += paged_cases(args.dtypes + ["int8"], [args.batch, 1], args.kv_len)
  run_bench("decode", args, argv, cases)
  return 0
