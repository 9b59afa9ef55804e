"""A/B timing of two jaxops builds: the same benchmark run alternately with each.

Two builds cannot share a process (they register the same FFI targets), so
each round runs ``<python> -P -m jaxops.bench <args>`` once with the "before"
interpreter and once with the "after" one, alternating, and compares the
medians (and minima: noise only ever adds time) over the rounds of each result
line's first timing column (jaxops' time in every family's table). Alternating spreads the machine's slow and fast
periods over both builds; each run's own jaxops/XLA ratio is also printed, as
XLA is the same in both and so measures the drift between runs.

  python tools/compare_builds.py --before /tmp/old/.venv/bin/python \\
      --after .venv/bin/python --rounds 3 -- norms --runs 5
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

_NUMBER = re.compile(r"^-?\d+(\.\d+)?x?$")


def _rows(output: str) -> dict[str, tuple[float, float | None]]:
  """Result line label -> (first timing, last column's speed-up over XLA or None)."""
  rows = {}
  for line in output.splitlines():
    if line.startswith("#") or not line.strip():
      continue
    tokens = line.split()
    numeric = [i for i, t in enumerate(tokens) if _NUMBER.match(t)]
    if not numeric:
      continue  # a header
    label = " ".join(tokens[:numeric[0]])
    speedups = [t for t in tokens if re.match(r"^\d+(\.\d+)?x$", t)]
    rows[label] = (float(tokens[numeric[0]].rstrip("x")),
                   float(speedups[0][:-1]) if speedups else None)
  return rows


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--before", required=True, help="python of the build to compare against")
  parser.add_argument("--after", required=True, help="python of the new build")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- <family> [bench options]")
  args = parser.parse_args(argv)
  bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
  runs = {"before": [], "after": []}
  for round_ in range(args.rounds):
    for name in ("before", "after"):
      python = getattr(args, name)
      output = subprocess.run([python, "-P", "-m", "jaxops.bench", *bench], check=True,
                              capture_output=True, text=True).stdout
      if round_ == 0 and name == "before":
        print(next(l for l in output.splitlines() if l.startswith("#")))
      runs[name].append(_rows(output))
  labels = list(runs["after"][0])
  print(f"# {' '.join(bench)}: over {args.rounds} alternating rounds, the median and the "
        "minimum of each build's time (each run's own figure is already a median of its calls); "
        "'vs xla' = each build's own speed-up over XLA (median)")
  print(f"{'result':<44} {'before ms':>10} {'after ms':>9} {'after/before':>12} "
        f"{'min before':>10} {'min after':>9} {'min a/b':>8} {'vs xla before':>13} "
        f"{'vs xla after':>12}")
  for label in labels:
    def values(name, i):
      return [r[label][i] for r in runs[name] if label in r and r[label][i] is not None]

    def stat(fn, name, i):
      found = values(name, i)
      return fn(found) if found else float("nan")

    before, after = stat(statistics.median, "before", 0), stat(statistics.median, "after", 0)
    low_before, low_after = stat(min, "before", 0), stat(min, "after", 0)
    print(f"{label:<44} {before:>10.2f} {after:>9.2f} {after / before:>12.3f} "
          f"{low_before:>10.2f} {low_after:>9.2f} {low_after / low_before:>8.3f} "
          f"{stat(statistics.median, 'before', 1):>12.2f}x "
          f"{stat(statistics.median, 'after', 1):>11.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
