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


def forward_or_backward(pass_name: str, fn, wrt=None):
  """``fn``'s forward pass, or forward+backward, as a function of ``(*args, dy)``.

  ``"fwd"`` (and ``"fwd don."``, the same call with donated inputs) calls
  ``fn(*args)``; a pass containing ``"bwd"`` runs a VJP with respect to the
  arguments ``wrt`` (all by default), ``dy`` the cotangent of every output.
  """
  if "bwd" not in pass_name:
    return lambda *args_dy: fn(*args_dy[:-1])

  def forward_backward(*args_dy):
    *args, dy = args_dy
    positions = range(len(args)) if wrt is None else wrt

    def of_differentiated(*diff):
      full = list(args)
      for i, d in zip(positions, diff):
        full[i] = d
      return fn(*full)

    out, vjp = jax.vjp(of_differentiated, *(args[i] for i in positions))
    return vjp(jax.tree.map(lambda o: dy, out))

  return forward_backward


def time_against_xla(make_fn, *args, runs: int, donate_argnums=()) -> tuple[Timing, Timing]:
  """Timings of ``make_fn(implementation)(*args)`` for jaxops' kernels (None)
  and for the jnp reference ("xla"), in the same process, one after the other."""
  return tuple(time_jitted(make_fn(impl), *args, runs=runs, donate_argnums=donate_argnums)
               for impl in (None, "xla"))


def comparison_columns(ours: Timing, xla: Timing, moved_bytes: float) -> str:
  """The result columns every family prints: ms, GB/s and system share of each
  implementation, then the speed-up (GB/s from the bytes the pass moves)."""
  gbs = lambda t: moved_bytes / (t.median_ms * 1e-3) / 1e9
  return (f"{ours.median_ms:>10.2f} {gbs(ours):>6.1f} {ours.sys_share:>4.0%} "
          f"{xla.median_ms:>9.2f} {gbs(xla):>6.1f} {xla.sys_share:>4.0%} "
          f"{xla.median_ms / ours.median_ms:>7.2f}x")


def print_table_header(note: str, labels: list[tuple[str, int]]) -> None:
  """The lines every family's table starts with: the machine, what the figures
  are (``note``), and the column names, the row labels (name, width) first."""
  print(f"# {machine_line()}")
  print(f"# {note}; 'sys' = share of CPU time in the kernel (page faults)")
  print(" ".join(f"{name:<{width}}" for name, width in labels) +
        f" {'jaxops ms':>10} {'GB/s':>6} {'sys':>4} {'xla ms':>9} {'GB/s':>6} {'sys':>4} "
        f"{'speed-up':>8}")
