"""The options every family takes, and its sizes by preset.

* ``--preset {cpu,gpu}``: the family's default sizes for a machine of that kind
  (default: ``gpu`` when JAX's default backend is the GPU, else ``cpu``). The
  cpu preset is sized for a few CPU cores, the gpu preset fills an H100/H200.
* ``--quick``: one representative case of the preset (a smoke run).
* ``--json PATH``: append one JSON object per result to PATH (JSON lines,
  ``jaxops.bench.results``), as input to ``python -m jaxops.bench report``.
* ``--runs``: runs (CPU: the median's) or repetitions (GPU: the minimum's).

A family declares each option whose default depends on the preset with
``default=None`` and gives its values in ``presets`` (and the ``--quick``
overrides in ``quick``); an option given on the command line always wins.
"""

from __future__ import annotations

import argparse

import jax

PRESETS = ("cpu", "gpu")


def default_preset() -> str:
  return "gpu" if jax.default_backend() == "gpu" else "cpu"


def dims(text: str) -> tuple[int, ...]:
  """A shape as the command line gives it: "8192x4096" -> (8192, 4096)."""
  return tuple(int(s) for s in text.split("x"))


def _as_flags(settings: dict) -> str:
  """Settings as the command line would give them."""
  def flag(name, value):
    name = name.replace("_", "-")
    if isinstance(value, bool):
      return f"--{name}" if value else f"--no-{name}"
    return f"--{name} " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))
  return " ".join(flag(name, value) for name, value in settings.items())


def parser_for(family: str, doc: str, presets: dict, quick: dict) -> argparse.ArgumentParser:
  """A parser with the common options; its epilog lists what each preset sets."""
  epilog = "\n".join([f"--preset {name}: {_as_flags(presets[name])}" for name in PRESETS] +
                     [f"--quick with --preset {name}: {_as_flags(quick[name])}"
                      for name in PRESETS])
  parser = argparse.ArgumentParser(prog=f"python -m jaxops.bench {family}", description=doc,
                                   epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", choices=PRESETS, default=None,
                      help="default sizes for this kind of machine (default: gpu when JAX's "
                      "default backend is the GPU, else cpu); explicit options override it")
  parser.add_argument("--quick", action="store_true",
                      help="one representative case of the preset (a smoke run)")
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="append one JSON object per result to PATH (JSON lines)")
  parser.add_argument("--runs", type=int, default=None,
                      help="runs per timing (CPU: median of) or repetitions (GPU: minimum of)")
  return parser


def parse(parser: argparse.ArgumentParser, argv, presets: dict, quick: dict) -> argparse.Namespace:
  """The parsed options, each left unset filled in from the preset (and --quick)."""
  args = parser.parse_args(list(argv))
  args.preset = args.preset or default_preset()
  settings = dict(presets[args.preset])
  if args.quick:
    settings.update(quick[args.preset])
  for name, value in settings.items():
    if getattr(args, name) is None:
      setattr(args, name, list(value) if isinstance(value, (list, tuple)) else value)
  return args
