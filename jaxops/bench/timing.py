"""Timing shared by the benchmark families, one method per platform.

The method is chosen in one place, ``uses_device_timing``, from the platform
of the devices the arguments live on:

* CPU (``time_jitted``, ``time_interleaved``): each timed call starts after a
  settle pause and is blocked on alone; the figure is the median of several
  runs, with the split of CPU time between user and system (page faults on
  fresh outputs are system time).
* GPU (``time_on_device``): calls are queued back to back and blocked on once,
  so the device never waits for the host; the figure is the minimum over
  several repetitions of (repetition time / calls). A pause or a block per call
  would time the launch and the synchronisation instead of the kernel.

Also XLA's compiled memory analysis, and the helpers that turn an op into its
forward or forward+backward pass with a random cotangent.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Timing:
  ms: float  # the figure reported: the median (host method) or the minimum (device method)
  method: str  # how ms was measured, in words (recorded with every result)
  sys_share: float | None  # system CPU time / (user + system) during the runs; None on a GPU
  temp_bytes: int | None  # XLA's temporary allocation for the compiled program


# XLA frees a program's large temporaries on another thread after its result
# is ready (jax.nn attention's 256 MiB at S=2048: ~20 ms of system time on this
# 2-core machine). Without a pause, that clean-up runs during the next timed
# call, whichever implementation it is, and halves a 2-thread kernel's speed.
SETTLE_SECONDS = 0.1

# A device repetition queues enough calls to keep the device busy this long,
# so that the launch of the first call and the final synchronisation weigh
# little in the per-call time.
REPETITION_SECONDS = 0.025
MAX_CALLS_PER_REPETITION = 1000
# Donated arguments are consumed by each call, so a repetition needs a copy of
# them per call, made before it starts; this bounds the memory those copies take.
DONATED_COPIES_BYTES = 4 << 30


def uses_device_timing(platform_name: str) -> bool:
  """Whether arrays on ``platform_name`` are timed on the device (a GPU)."""
  return platform_name in ("gpu", "cuda")


def platform_of(args) -> str:
  """The platform of the first array in ``args``, else JAX's default backend."""
  for leaf in jax.tree.leaves(args):
    if isinstance(leaf, jax.Array):
      return next(iter(leaf.devices())).platform
  return jax.default_backend()


def settle() -> None:
  """Waits for the previous call's deferred clean-up before a timed call."""
  time.sleep(SETTLE_SECONDS)


def time_call(fn, *args, runs: int, donate_argnums=(), host_timer=None) -> Timing:
  """``jax.jit(fn)(*args)`` timed by the method of the arguments' platform.

  ``host_timer`` replaces ``time_jitted`` on the CPU (a family with its own
  host method); it takes the same arguments.
  """
  if uses_device_timing(platform_of(args)):
    return time_on_device(fn, *args, runs=runs, donate_argnums=donate_argnums)
  return (host_timer or time_jitted)(fn, *args, runs=runs, donate_argnums=donate_argnums)


def jaxops_and_reference(make) -> dict:
  """``{"jaxops": make(None), "xla": make("xla")}``: an op's kernel (its
  ``implementation=None``) and its jnp reference compiled by XLA (``"xla"``)."""
  return {"jaxops": make(None), "xla": make("xla")}


def time_implementations(fns: dict, *args, runs: int, donate_argnums=(), interleave=False,
                         may_refuse=(), host_timers=None) -> dict:
  """``{name: Timing}`` of each of ``fns`` on ``args`` in the same process, by
  the method of the arguments' platform; on the CPU, with ``interleave``, one
  run of each in turn (``time_interleaved``), else each by ``time_jitted`` or
  its own ``host_timers[name]``. Timed one after the other, the
  implementations named in ``may_refuse`` (cuDNN) may fail on a case: theirs is
  then the reason, a string, instead of a Timing."""
  if interleave and not uses_device_timing(platform_of(args)):
    return time_interleaved(fns, *args, runs=runs, donate_argnums=donate_argnums)
  timings = {}
  for name, fn in fns.items():
    try:
      timings[name] = time_call(fn, *args, runs=runs, donate_argnums=donate_argnums,
                                host_timer=(host_timers or {}).get(name))
    except Exception as error:  # noqa: BLE001  (cuDNN's refusals have no common type)
      if name not in may_refuse:
        raise
      timings[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
  return timings


@dataclasses.dataclass(frozen=True)
class Eager:
  """A peer outside JAX (PyTorch, jaxops/bench/torch_peer.py) among the functions
  ``time_interleaved`` times: nothing is compiled; ``prepare(*args)`` turns the
  JAX arguments into the peer's own once, untimed, and each run calls
  ``fn(*prepared)``, which must return when its work is done (as CPU torch does)."""
  fn: Callable
  prepare: Callable


class _EagerRun:
  """An ``Eager`` with its prepared arguments, called like a compiled program."""

  def __init__(self, eager: Eager, args):
    self._fn, self._args = eager.fn, eager.prepare(*args)

  def __call__(self, *_jax_args):
    return self._fn(*self._args)


def _compile(fn, args, donate_argnums=()):
  if isinstance(fn, Eager):
    if donate_argnums:
      raise ValueError("an Eager peer cannot be timed with donated arguments")
    return _EagerRun(fn, args)
  return jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()


def _copier(args, donate_argnums):
  """A function giving arguments for one call: fresh copies of the donated ones."""
  def fresh_args():
    if not donate_argnums:
      return args
    return tuple(jax.tree.map(lambda x: jnp.array(x, copy=True), a)
                 if i in donate_argnums else a for i, a in enumerate(args))
  return fresh_args


def time_jitted(fn, *args, runs: int = 7, warmup: int = 2, donate_argnums=()) -> Timing:
  """Host method: the median wall time of ``jax.jit(fn)(*args)`` after warm-up,
  each call after a settle pause.

  With ``donate_argnums`` each run gets fresh copies of those arguments (made
  outside the timed region), so donation can be measured too.
  """
  return time_interleaved({"fn": fn}, *args, runs=runs, warmup=warmup,
                          donate_argnums=donate_argnums)["fn"]


def time_interleaved(fns: dict, *args, runs: int, warmup: int = 1, donate_argnums=()) -> dict:
  """Host method over several implementations: one settled run of each in turn,
  so load from other processes on a shared machine weighs on all alike; the
  median of each's runs. Donated arguments are copied before each run. A
  function may be an ``Eager`` peer (torch), timed by the same runs."""
  compiled = {name: _compile(fn, args, donate_argnums) for name, fn in fns.items()}
  fresh_args = _copier(args, donate_argnums)
  for _ in range(warmup):
    for c in compiled.values():
      jax.block_until_ready(c(*fresh_args()))
  times = {name: [] for name in compiled}
  system = {name: 0.0 for name in compiled}
  cpu = {name: 0.0 for name in compiled}
  for _ in range(runs):
    for name, c in compiled.items():
      call_args = jax.block_until_ready(fresh_args())
      settle()
      before = os.times()
      start = time.perf_counter()
      out = jax.block_until_ready(c(*call_args))
      times[name].append(time.perf_counter() - start)
      after = os.times()
      del out  # freeing the outputs (munmap) is not the op's time
      system[name] += after.system - before.system
      cpu[name] += after.user - before.user + after.system - before.system
  calls = f"{runs} interleaved calls" if len(fns) > 1 else f"{runs} calls"
  return {name: Timing(statistics.median(times[name]) * 1e3,
                       f"host: median of {calls}, each after a {SETTLE_SECONDS:g} s pause",
                       system[name] / cpu[name] if cpu[name] > 0 else 0.0, temp_bytes(c))
          for name, c in compiled.items()}


def time_on_device(fn, *args, runs: int = 3, warmup: int = 1, donate_argnums=()) -> Timing:
  """Device method: the minimum over ``runs`` repetitions of the time of many
  back-to-back calls of ``jax.jit(fn)(*args)``, blocked on once, per call.

  A call's time after warm-up sets the calls per repetition (enough for
  ``REPETITION_SECONDS``). Each call's donated arguments are copied before the
  repetition starts, within ``DONATED_COPIES_BYTES``. The host queues a call in
  about 10 us, which bounds what this can time: the gpu presets' smallest
  kernels take several times that.
  """
  compiled = _compile(fn, args, donate_argnums)
  fresh_args = _copier(args, donate_argnums)
  for _ in range(warmup):
    jax.block_until_ready(compiled(*fresh_args()))
  call_args = jax.block_until_ready(fresh_args())
  start = time.perf_counter()
  jax.block_until_ready(compiled(*call_args))
  once = time.perf_counter() - start
  calls = min(MAX_CALLS_PER_REPETITION, max(2, math.ceil(REPETITION_SECONDS / max(once, 1e-6))))
  if donate_argnums:
    donated = sum(leaf.nbytes for i in donate_argnums for leaf in jax.tree.leaves(args[i]))
    calls = max(1, min(calls, DONATED_COPIES_BYTES // max(donated, 1)))
  per_call = []
  for _ in range(runs):
    arg_sets = jax.block_until_ready([fresh_args() for _ in range(calls)])
    start = time.perf_counter()
    for call_args in arg_sets:
      out = compiled(*call_args)  # the previous output is released as this one is queued
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / calls)
    del out, arg_sets
  return Timing(min(per_call) * 1e3, f"device: min over {runs} repetitions of {calls} "
                "back-to-back calls", None, temp_bytes(compiled))


def temp_bytes(compiled) -> int | None:
  """XLA's temporary allocation for a compiled program, where the backend says."""
  if isinstance(compiled, _EagerRun):
    return None
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # noqa: BLE001  (not every backend reports it)
    return None
  return getattr(analysis, "temp_size_in_bytes", None)


def _amd_core(family: int, model: int) -> str | None:
  """The Zen generation of an AMD family/model pair (AMD's processor programming references)."""
  if family == 0x17:
    return "Zen 2" if model >= 0x30 else "Zen/Zen+"
  if family == 0x19:
    return "Zen 4" if 0x10 <= model <= 0x1f or 0x60 <= model <= 0xaf else "Zen 3"
  if family == 0x1a:
    return "Zen 5"
  return None


def host_line() -> str:
  """The host's CPU model and core count.

  A VM often names its CPU only "AMD EPYC", which spans AVX2-only Zen 2 and Zen 3 and
  AVX-512 Zen 4: the family and model numbers (and for AMD the core generation) are added,
  so that results from different machines stay apart in the report.
  """
  cpu = platform.processor() or platform.machine()
  fields = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model", "vendor_id") and key not in fields:
          fields[key] = value.strip()
        if not line.strip():
          break  # the first processor's block is enough
  except OSError:
    pass
  cpu = fields.get("model name", cpu)
  try:
    family, model = int(fields["cpu family"]), int(fields["model"])
  except (KeyError, ValueError):
    return f"{cpu}, {os.cpu_count()} cores"
  core = _amd_core(family, model) if fields.get("vendor_id") == "AuthenticAMD" else None
  ident = f"family {family} model {model}" + (f", {core}" if core else "")
  return f"{cpu} ({ident}), {os.cpu_count()} cores"


def machine_line() -> str:
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  device = jax.devices()[0]
  on = "" if device.platform == "cpu" else f", device {device.device_kind}"
  if device.platform == "cpu":
    import jaxops  # (here: the bench's modules import timing before jaxops is needed)
    on = f", jaxops {jaxops.cpu_isa()} kernels"
  return (f"{host_line()}, jax {jax.__version__}, backend {jax.default_backend()}{on}, "
          f"GLIBC_TUNABLES={tunables or '(unset)'}")


def random_like(shape, dtype, seed: int = 7):
  """Standard normal values of ``shape`` in ``dtype``: a cotangent or tangent.

  Never ones: XLA folds a constant all-ones cotangent into its fusion, where a
  custom call must read a materialised one, which biases the comparison."""
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def forward_or_backward(pass_name: str, fn, wrt=None):
  """``fn``'s forward pass, or forward+backward, as a function of ``(*args, dy)``.

  ``"fwd"`` (and ``"fwd don."``, the same call with donated inputs) calls
  ``fn(*args)``; a pass containing ``"bwd"`` runs ``jax.vjp`` with respect to
  the arguments ``wrt`` (all by default), ``dy`` (a ``random_like`` array) the
  cotangent of every output.
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
