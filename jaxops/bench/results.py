"""What a family does with a result: one row of its table, one JSON line.

A result is one case (op, shape, dtype, pass) timed for jaxops and its peers
in the same process. Its table row gives each implementation's time, rate
(GB/s for bandwidth-bound work, TFLOP/s for compute-bound), share of the
roofline (``jaxops.bench.ceilings``) and, on the CPU, the system share, then
jaxops' speed-up over each peer (the peer's time over jaxops'), each figure
followed by ``x``. With ``--json PATH`` the same result is appended to PATH as
one JSON object (the schema is ``record``'s), read back by
``python -m jaxops.bench report``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import pathlib
import shlex
import subprocess

import jax
import jaxlib
import jaxops

from jaxops.bench import ceilings
from jaxops.bench.timing import Timing, host_line, machine_line

SUBJECT = "jaxops"
# The roofline ceiling of each unit of work.
CEILINGS = {"bytes": ceilings.copy_bandwidth, "flops": ceilings.matmul_rate}


@dataclasses.dataclass(frozen=True)
class Work:
  """The least a pass must do: bytes to move, or floating-point operations."""
  amount: float
  unit: str  # "bytes" or "flops"

  @property
  def rate_key(self) -> str:
    return "gb_s" if self.unit == "bytes" else "tflop_s"

  def rate(self, ms: float) -> float:
    """GB/s or TFLOP/s at ``ms`` per call."""
    return self.amount / (ms * 1e-3) / (1e9 if self.unit == "bytes" else 1e12)

  def ceiling(self) -> ceilings.Ceiling:
    return CEILINGS[self.unit]()


def moved(nbytes: float) -> Work:
  return Work(float(nbytes), "bytes")


def computed(flops: float) -> Work:
  return Work(float(flops), "flops")


@dataclasses.dataclass
class Result:
  case: str  # the op, or the family's name for the case
  shape: str
  dtype: str
  pass_name: str  # "fwd", "fwd+bwd", "jvp", "step", ...
  timings: dict  # implementation -> Timing, or the reason it was skipped; jaxops first
  work: Work | None = None
  extra: dict = dataclasses.field(default_factory=dict)  # family-specific fields

  def speedups(self) -> dict[str, float]:
    """Each timed peer's time over jaxops' time."""
    ours = self.timings.get(SUBJECT)
    if not isinstance(ours, Timing):
      return {}
    return {name: t.ms / ours.ms for name, t in self.timings.items()
            if name != SUBJECT and isinstance(t, Timing)}


@functools.cache
def _revision() -> str | None:
  """The checkout's git revision (+dirty when it has changes), if jaxops runs from one."""
  checkout = pathlib.Path(__file__).resolve().parents[2]
  if not (checkout / ".git").exists():
    return None
  try:
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain",
                              "--untracked-files=no"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+dirty" if changed else "")


@functools.cache
def environment() -> dict:
  """Where and when: the fields every record of this process shares."""
  device = jax.devices()[0]
  # The CPU kernels' variant (avx512, avx2, generic; JAXOPS_CPU_ISA forces one):
  # each variant's results are a table of their own.
  isa = {"cpu_isa": jaxops.cpu_isa()} if device.platform == "cpu" else {}
  return {"platform": device.platform, "device": device.device_kind, "host": host_line(),
          **isa, "machine": machine_line(),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "jaxops_revision": _revision(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _implementation(timing, work: Work | None) -> dict:
  if not isinstance(timing, Timing):
    return {"skipped": timing}
  entry = {"ms": timing.ms, "method": timing.method}
  if work is not None:
    rate = work.rate(timing.ms)
    entry[work.rate_key] = rate
    entry["roofline_share"] = work.ceiling().share(rate)
  if timing.sys_share is not None:
    entry["sys_share"] = timing.sys_share
  if timing.temp_bytes is not None:
    entry["temp_bytes"] = timing.temp_bytes
  return entry


def record(family: str, result: Result, command: str, preset: str) -> dict:
  """The JSON object of one result."""
  work = result.work
  return {
      "family": family, "case": result.case, "shape": result.shape, "dtype": result.dtype,
      "pass": result.pass_name,
      "work": None if work is None else {work.unit: work.amount},
      "roofline": None if work is None else {work.ceiling().unit: work.ceiling().value,
                                             "what": work.ceiling().what},
      "implementations": {name: _implementation(t, work) for name, t in result.timings.items()},
      "speedup": result.speedups(),
      **result.extra, "command": command, "preset": preset, **environment(),
  }


def ceiling_record(name: str, ceiling: ceilings.Ceiling, command: str) -> dict:
  """The JSON object of a ceiling (``python -m jaxops.bench roofline --json``)."""
  return {"family": "roofline", "case": name, "shape": None, "dtype": None, "pass": None,
          "work": None, "roofline": {ceiling.unit: ceiling.value, "what": ceiling.what},
          "implementations": {}, "speedup": {}, "command": command, "preset": None,
          **environment()}


def append_record(path: str, fields: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(fields) + "\n")


def fixed(x: float) -> str:
  """``x`` with about four significant digits and no exponent."""
  if not math.isfinite(x) or x == 0:
    return f"{x:g}"
  return f"{x:.{max(0, 3 - math.floor(math.log10(abs(x))))}f}"


class Reporter:
  """A family's table and JSON lines: ``header()`` once, ``add(labels, result)`` per result.

  ``labels`` are the row-label columns (name, width); ``implementations`` the
  columns' implementations, jaxops first; ``units`` the work units of the
  family ("bytes", "flops"), whose ceilings the header prints.
  """

  def __init__(self, family: str, args, argv, labels, implementations, units=("bytes",),
               memory=False):
    self.family, self.labels, self.implementations = family, labels, list(implementations)
    self.units, self.memory = units, memory
    self.command = shlex.join(["python", "-m", "jaxops.bench", family, *argv])
    self.preset, self.json_path = args.preset, args.json
    self.with_sys = environment()["platform"] == "cpu"  # the CPU method measures it
    rate_names = {"bytes": "GB/s", "flops": "TFLOP/s"}
    self.rate_name = rate_names[units[0]] if len(units) == 1 else "rate"

  def header(self, note: str) -> None:
    print(f"# {machine_line()}")
    print(f"# {self.command} (preset {self.preset})")
    for unit in self.units:
      ceiling = CEILINGS[unit]()
      print(f"# roofline: {fixed(ceiling.value)} {ceiling.unit} ({ceiling.what})")
    print(f"# {note}; 'roof' = share of the roofline; 'x <peer>' = the peer's time over jaxops'"
          + ("; 'sys' = share of CPU time in the kernel (page faults)" if self.with_sys else ""))
    columns = [f"{name:<{width}}" for name, width in self.labels]
    for impl in self.implementations:
      columns += [f"{impl + ' ms':>11}", f"{self.rate_name:>8}", f"{'roof':>4}"]
      columns += [f"{'sys':>4}"] * self.with_sys + [f"{'temp MiB':>8}"] * self.memory
    columns += [f"{'x ' + peer:>9}" for peer in self.implementations[1:]]
    print(" ".join(columns), flush=True)

  def add(self, label_values, result: Result, trailer: str = "") -> None:
    columns = [f"{value:<{width}}" for value, (_, width) in zip(label_values, self.labels)]
    for impl in self.implementations:
      t = result.timings.get(impl)
      if not isinstance(t, Timing):
        columns += [f"{'-':>11}", f"{'-':>8}", f"{'-':>4}"]
        columns += [f"{'-':>4}"] * self.with_sys + [f"{'-':>8}"] * self.memory
        continue
      rate = result.work.rate(t.ms) if result.work else None
      columns += [f"{fixed(t.ms):>11}", f"{fixed(rate) if rate else '-':>8}",
                  f"{result.work.ceiling().share(rate):>4.0%}" if rate else f"{'-':>4}"]
      sys_share = f"{'-':>4}" if t.sys_share is None else f"{t.sys_share:>4.0%}"
      columns += [sys_share] * self.with_sys
      if self.memory:
        columns.append(f"{t.temp_bytes / 2**20:>8.1f}" if t.temp_bytes is not None else
                       f"{'-':>8}")
    speedups = result.speedups()
    columns += [f"{speedups[p]:>8.2f}x" if p in speedups else f"{'-':>9}"
                for p in self.implementations[1:]]
    print(" ".join(columns) + trailer, flush=True)
    for name, t in result.timings.items():
      if not isinstance(t, Timing):
        print(f"# {name} skipped: {t}", flush=True)
    if self.json_path:
      append_record(self.json_path, record(self.family, result, self.command, self.preset))
