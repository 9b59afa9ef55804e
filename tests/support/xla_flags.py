"""XLA_FLAGS for the test session: only the flags the running XLA knows.

XLA aborts the process on a flag it does not know ("Unknown flag in XLA_FLAGS"
is fatal, not a warning), and flags come and go between jaxlib releases:
jaxlib 0.11 no longer has --xla_cpu_use_fusion_emitters, which 0.10 has. So the
flags the suite wants are first given to a subprocess that starts JAX's CPU
backend (where XLA parses XLA_FLAGS, and where it names every unknown flag at
once); the ones it names are left out. The flag table is one for the whole
build (the CUDA plugin is built from the same XLA), so the CPU backend answers
for the GPU's too. The subprocess takes 0.6-0.8 s of a core; it runs while the
caller imports jax (XLA reads XLA_FLAGS when a backend starts, not on import),
and only for flags that XLA_FLAGS does not set yet, so pytest-xdist workers,
which inherit their controller's XLA_FLAGS, mostly skip it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

_UNKNOWN_FLAGS = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_START_BACKEND = "import jax; jax.devices()"


def arguments(flags: dict[str, str]) -> list[str]:
  return [f"--{name}={value}" for name, value in flags.items()]


def names_in(xla_flags: str) -> set[str]:
  """The flag names an XLA_FLAGS value sets."""
  return {argument.lstrip("-").split("=", 1)[0] for argument in xla_flags.split()}


def missing(flags: dict[str, str]) -> dict[str, str]:
  """The entries of ``flags`` (name without dashes: value) whose names XLA_FLAGS
  does not set yet: a user's own setting wins."""
  present = names_in(os.environ.get("XLA_FLAGS", ""))
  return {name: value for name, value in flags.items() if name not in present}


class Probe:
  """Which of ``flags`` the running XLA accepts, from a subprocess started here
  and waited for by :meth:`known`."""

  def __init__(self, flags: dict[str, str]):
    self.flags = dict(flags)
    self._xla_flags = " ".join(arguments(flags))
    self._process = subprocess.Popen(
        [sys.executable, "-P", "-c", _START_BACKEND],
        env={**os.environ, "XLA_FLAGS": self._xla_flags, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) if flags else None

  def known(self) -> dict[str, str]:
    if self._process is None:
      return {}
    _, stderr = self._process.communicate(timeout=300)
    if self._process.returncode == 0:
      return dict(self.flags)
    unknown = _UNKNOWN_FLAGS.search(stderr)
    if unknown is None:
      raise RuntimeError(f"JAX did not start with XLA_FLAGS={self._xla_flags!r} (exit status "
                         f"{self._process.returncode}):\n{stderr[-4000:]}")
    rejected = names_in(unknown.group(1))
    return {name: value for name, value in self.flags.items() if name not in rejected}


def add_to_environment(flags: dict[str, str]) -> None:
  """Appends ``flags`` to XLA_FLAGS."""
  present = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join([present] * bool(present) + arguments(flags))
