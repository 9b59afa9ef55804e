"""``python -m jaxops.bench <family> [options]``: time jaxops against the jnp/XLA reference."""

import importlib
import pkgutil
import sys

import jaxops.bench


def _families():
  return sorted(m.name for m in pkgutil.iter_modules(jaxops.bench.__path__)
                if m.name not in ("timing",) and not m.name.startswith("_"))


def main(argv):
  families = _families()
  if not argv or argv[0] not in families:
    print(f"usage: python -m jaxops.bench {{{','.join(families)}}} [--help]", file=sys.stderr)
    return 2
  return importlib.import_module(f"jaxops.bench.{argv[0]}").main(argv[1:]) or 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
