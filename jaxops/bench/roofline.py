"""``python -m jaxops.bench roofline``: the device's ceilings, measured as every
family measures them (``jaxops.bench.ceilings``): the copy bandwidth and the
matmul rate. With ``--json PATH`` each is appended to PATH as a record of the
family "roofline" (no implementations), which the report lists with the
ceilings of its platform.
"""

from __future__ import annotations

import argparse
import shlex

from jaxops.bench import ceilings, results
from jaxops.bench.timing import machine_line


def main(argv=()):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench roofline", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="append each ceiling to PATH as one JSON object (JSON lines)")
  args = parser.parse_args(list(argv))
  print(f"# {machine_line()}")
  for name, ceiling in (("copy bandwidth", ceilings.copy_bandwidth()),
                        ("matmul rate", ceilings.matmul_rate())):
    print(f"{name:<15} {ceiling.value:>9.1f} {ceiling.unit:<8} {ceiling.what}", flush=True)
    if args.json:
      results.append_record(args.json, results.ceiling_record(
          name, ceiling, shlex.join(["python", "-m", "jaxops.bench", "roofline", *argv])))
  return 0
