"""Timing shared by the benchmark families: jit, warm-up, median of several runs,
the split of CPU time between user and system (page faults on fresh outputs are
system time), and XLA's compiled memory analysis."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time

import jax


@dataclasses.dataclass
class Timing:
  median_ms: float
  min_ms: float
  runs: int
  sys_share: float  # system CPU time / (user + system) during the timed runs
  temp_bytes: int | None  # XLA's temporary allocation for the compiled program


# XLA frees a program's large temporaries on another thread after its result
# is ready (jax.nn attention's 256 MiB at S=2048: ~20 ms of system time on this
# 2-core machine). Without a pause, that clean-up runs during the next timed
# call, whichever implementation it is, and halves a 2-thread kernel's speed.
SETTLE_SECONDS = 0.1


def settle() -> None:
  """Waits for the previous call's deferred clean-up before a timed call."""
  time.sleep(SETTLE_SECONDS)


def time_jitted(fn, *args, runs: int = 7, warmup: int = 2, donate_argnums=()) -> Timing:
  """Median wall time of ``jax.jit(fn)(*args)`` after warm-up.

  With ``donate_argnums`` each run gets fresh copies of those arguments (made
  outside the timed region), so donation can be measured too.
  """
  jitted = jax.jit(fn, donate_argnums=donate_argnums)
  compiled = jitted.lower(*args).compile()
  temp_bytes = _temp_bytes(compiled)

  def fresh_args():
    if not donate_argnums:
      return args
    return tuple(jax.tree.map(lambda x: jax.numpy.array(x, copy=True), a)
                 if i in donate_argnums else a for i, a in enumerate(args))

  for _ in range(warmup):
    jax.block_until_ready(compiled(*fresh_args()))
  times = []
  user = system = 0.0
  for _ in range(runs):
    call_args = jax.block_until_ready(fresh_args())
    settle()
    before = os.times()
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*call_args))
    times.append(time.perf_counter() - start)
    after = os.times()
    del out  # freeing the outputs (munmap) is not the op's time
    user += after.user - before.user
    system += after.system - before.system
  cpu = user + system
  return Timing(statistics.median(times) * 1e3, min(times) * 1e3, runs,
                system / cpu if cpu > 0 else 0.0, temp_bytes)


def _temp_bytes(compiled) -> int | None:
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # not every backend reports it
    return None
  return getattr(analysis, "temp_size_in_bytes", None)


def machine_line() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  return (f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"GLIBC_TUNABLES={tunables or '(unset)'}")
