"""``python -m jaxops.bench <family> [options]``: time jaxops against its peers;
``python -m jaxops.bench roofline``: the device's ceilings; ``python -m
jaxops.bench report``: the one-page report from the families' JSON lines."""

import importlib
import pkgutil
import sys

import jaxops.bench

# Modules the commands share, not commands themselves.
_HELPERS = ("ceilings", "options", "report_plot", "results", "timing", "torch_peer")
TOOLS = ("report", "roofline")


def commands():
  """Every family, then the tools: each a module of jaxops.bench with a ``main(argv)``."""
  modules = {m.name for m in pkgutil.iter_modules(jaxops.bench.__path__)
             if m.name not in _HELPERS and not m.name.startswith("_")}
  return sorted(modules - set(TOOLS)) + [t for t in TOOLS if t in modules]


def main(argv):
  names = commands()
  if not argv or argv[0] not in names:
    families = ",".join(n for n in names if n not in TOOLS)
    print(f"usage: python -m jaxops.bench {{{families}}} [--preset {{cpu,gpu}}] [--quick] "
          "[--json PATH] [--help]\n"
          "       python -m jaxops.bench roofline\n"
          "       python -m jaxops.bench report --input A.jsonl [B.jsonl ...] --markdown PATH "
          "[--plot PATH.png]", file=sys.stderr)
    return 2
  return importlib.import_module(f"jaxops.bench.{argv[0]}").main(argv[1:]) or 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
