"""``python -m jaxops.bench decode``: decoding against a KV cache, at the memory-bandwidth limit.

Decoding reads the whole KV cache for a few query rows, so its measure is the
cache's bytes over the time, against what the machine can stream. The bench
first measures the streaming read bandwidth in the same run, two ways: the
best of a few jnp reductions over a 512 MiB buffer, far larger than the
caches (it prints which), and a C++ loop summing a 512 MiB buffer with every
OpenMP thread (tools/stream_read_probe.cc); the shares are computed against the
higher of the two. Then it times each case: jaxops.attention with T new query tokens
at the end of an S-token cache (causal, traced query_offset = S - T), against
the jnp reference (jaxops.reference.attention under jit). Per case: median ms,
cache GB/s (K and V bytes / time), % of the streaming bandwidth, the
reference's ms and the speed-up; then each bfloat16 case's time over its
float32 twin's (half the bytes: ideally 0.5).

How a step is timed (``time_steps``): as a serving loop runs them, back to
back, and as the probes read, but never from the caches. Each case gets
enough copies of its arguments that together they are at least twice the
last-level cache; one run calls the step once per copy in turn, and its time
is the run's wall time over the copies (the median of ``runs`` runs). A copy
is therefore read after the others have evicted it. The other way, a timed
call after a pause (as ``timing.time_jitted`` does, for XLA's deferred
clean-up), measures this virtual machine waking its idle CPUs: measured, a
batch-1 float32 step with 64 cached tokens took 0.35 ms after a pause and
0.02 ms back to back, and a 4096-token one 2.1 ms after a pause (with the
cache evicted) against 1.4 ms back to back (partly from the L3). The
reference keeps ``time_jitted``'s pause, which spares it the clean-up of its
large temporaries during its next call and so can only lower the speed-up.

Cases are objects with a label, the cache bytes they read and a ``build()``
that gives (jaxops function, reference function, arguments), so other cache
layouts (the paged cache) add their own case lists to ``run_cases``.
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
from jaxops.bench.timing import machine_line, time_jitted

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
    t = time_jitted(probe, x, runs=runs)
    best = max(best, (x.nbytes / (t.median_ms * 1e-3) / 1e9, name))
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


def time_steps(fn, args, cache_bytes: int, runs: int) -> float:
  """Median ms of one call of jit(fn) in back-to-back calls over copies of args.

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
  return statistics.median(per_call) * 1e3


def stream_bandwidth(runs: int) -> tuple[float, str]:
  """(GB/s, probe name): the higher of the jnp and the C++ probes; prints both."""
  jnp_gbs, jnp_probe = jnp_stream_bandwidth(runs)
  cpp_gbs = cpp_stream_bandwidth(runs)
  mib = _STREAM_BYTES >> 20
  print(f"# streaming read, jnp: {jnp_gbs:.1f} GB/s ({jnp_probe}, {mib} MiB, median of {runs})")
  print(f"# streaming read, C++: {cpp_gbs:.1f} GB/s (OpenMP sum, every thread, {mib} MiB, "
        f"median of {runs})")
  return max((jnp_gbs, f"jnp {jnp_probe}"), (cpp_gbs, "C++ OpenMP sum"))


@dataclasses.dataclass(frozen=True)
class DenseDecodeCase:
  """jaxops.attention decoding T tokens of B sequences against a dense [B, S, K, H] cache."""
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str

  @property
  def label(self) -> str:
    return (f"dense B={self.batch} T={self.q_len} S={self.kv_len} "
            f"N/K={self.num_heads}/{self.num_kv_heads} H={self.head_dim} {self.dtype}")

  @property
  def twin(self) -> str:
    """The label of the same case in float32 (for the bf16/f32 time ratio)."""
    return self.label.rsplit(" ", 1)[0] + " float32"

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
    ours = lambda q, k, v, o: jaxops.attention(q, k, v, is_causal=True, query_offset=o)
    ref = lambda q, k, v, o: reference.attention(q, k, v, is_causal=True, query_offset=o)
    return ours, ref, (q, k, v, offset)


def dense_cases(dtypes, q_lens) -> list[DenseDecodeCase]:
  cases = []
  for dtype in dtypes:
    for T in q_lens:
      cases.append(DenseDecodeCase(8, T, 4096, 32, 8, 128, dtype))
    cases.append(DenseDecodeCase(1, 1, 4096, 32, 8, 128, dtype))
  return cases


def run_cases(cases, stream_gbs: float, runs: int) -> dict[str, float]:
  """Times every case, prints its row; returns each label's median ms."""
  print(f"{'case':<52} {'jaxops ms':>9} {'GB/s':>6} {'stream':>6} {'ref ms':>8} {'speed-up':>8}")
  medians = {}
  for case in cases:
    ours, ref, args = case.build()
    ours_ms = time_steps(ours, args, case.cache_bytes, runs)
    ref_ms = time_jitted(ref, *args, runs=runs).median_ms
    gbs = case.cache_bytes / (ours_ms * 1e-3) / 1e9
    medians[case.label] = ours_ms
    print(f"{case.label:<52} {ours_ms:>9.2f} {gbs:>6.1f} {gbs / stream_gbs:>6.0%} "
          f"{ref_ms:>8.2f} {ref_ms / ours_ms:>7.2f}x", flush=True)
  return medians


def print_dtype_ratios(cases, medians: dict[str, float]) -> None:
  for case in cases:
    if case.dtype != "float32" and case.twin in medians:
      print(f"{case.label}: {medians[case.label] / medians[case.twin]:.2f}x the float32 time")


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench decode", description=__doc__)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--q-lens", nargs="+", type=int, default=[1, 4])
  parser.add_argument("--runs", type=int, default=9)
  parser.add_argument("--no-paged", action="store_true",
                      help="only jaxops.attention, not the paged cache's cases")
  return parser.parse_args(argv)


def run_bench(cases, runs: int) -> None:
  """The streaming bandwidth, then every case against it, in one run."""
  print(f"# {machine_line()}")
  start = time.perf_counter()
  stream_gbs, probe = stream_bandwidth(runs)
  print(f"# shares against the higher: {stream_gbs:.1f} GB/s ({probe})")
  medians = run_cases(cases, stream_gbs, runs)
  print_dtype_ratios(cases, medians)
  print(f"# {time.perf_counter() - start:.0f} s")


def main(argv):
  args = _parse(argv)
  cases = dense_cases(args.dtypes, args.q_lens)
  if not args.no_paged:
    # The paged cache's decode (jaxops/bench/paged_attention.py) in the same run,
    # against the same bandwidth: float32, bfloat16 and int8 pages, batch 8 and 1.
    from jaxops.bench.paged_attention import paged_cases
    cases += paged_cases(args.dtypes + ["int8"], [8, 1])
  run_bench(cases, args.runs)
  return 0
