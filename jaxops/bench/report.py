"""``python -m jaxops.bench report``: the one-page benchmark report (BENCHMARKS.md).

Reads the JSON lines the families write with ``--json`` (``jaxops.bench.results``)
and writes a markdown page: per platform (each CPU machine, each GPU) the
machine, versions, dates and commands, then one table of every op's speed-up
over each of its peers and its share of the roofline; and a PNG plot of the
speed-ups (``--plot``; needs matplotlib, the ``bench`` extra: without it the
page says the plot was skipped). A row sums up one op, dtype and pass over the
shapes measured: the geometric mean of the speed-ups, with their range.

  python -m jaxops.bench report --input docs/bench-results/cpu.jsonl \\
      --notes docs/bench-results/notes.md --markdown BENCHMARKS.md \\
      --plot docs/bench-results/speedups.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex

from jaxops.bench import report_plot

SUBJECT = "jaxops"
_GPU_MISSING = (
    "No GPU results yet. On a machine with an NVIDIA GPU, `tools/gpu_check.sh` runs the "
    "families with `--preset gpu --json` and leaves the JSON lines in its output folder; "
    "commit that file as `docs/bench-results/gpu.jsonl` and regenerate this page with it "
    "added to `--input`. The first, hand-assembled GPU run (2026-11-27, H200) is in "
    "[docs/benchmarks-log.md](docs/benchmarks-log.md) with the caveats of its method.")


def parse(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxops.bench report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", nargs="+", required=True, metavar="JSONL",
                      help="JSON lines written by the families' --json")
  parser.add_argument("--markdown", required=True, metavar="PATH", help="the page to write")
  parser.add_argument("--plot", metavar="PATH.png", default=None,
                      help="the speed-up plot to write (needs matplotlib)")
  parser.add_argument("--notes", metavar="PATH", default=None,
                      help="markdown to put under the page's header (how the runs were made: "
                      "load, reduced shapes), kept in a file beside the results")
  return parser.parse_args(list(argv))


def read_records(paths) -> list[dict]:
  """Every record of the files, grouped by family (in name order), else as written."""
  records = []
  for path in paths:
    with open(path) as f:
      records += [json.loads(line) for line in f if line.strip()]
  return sorted(records, key=lambda r: r["family"])


def platform_title(record: dict) -> str:
  if record["platform"] == "cpu":
    # Records before the variant was recorded, and avx512 ones, are the
    # machine's widest variant; a narrower one forced with JAXOPS_CPU_ISA is a
    # table of its own.
    isa = record.get("cpu_isa")
    return f"CPU: {record['host']}" + (f", {isa} variant" if isa and isa != "avx512" else "")
  return f"GPU: {record['device']}"


def by_platform(records: list[dict]) -> dict[str, list[dict]]:
  grouped = {}
  for r in records:
    grouped.setdefault(platform_title(r), []).append(r)
  return grouped


def geometric_mean(values) -> float:
  return math.exp(sum(math.log(v) for v in values) / len(values))


def _summary(values, text) -> str:
  """One figure for several shapes: the geometric mean, and the range when they differ."""
  middle = text(geometric_mean(values))
  if len(values) > 1 and text(min(values)) != text(max(values)):
    return f"{middle} ({text(min(values))}–{text(max(values))})"
  return middle


def _speedup_text(x: float) -> str:
  return f"{x:.2f}x"


def _share_text(x: float) -> str:
  return f"{x:.0%}"


def rows(records: list[dict]) -> list[dict]:
  """One row per (family, op, dtype, pass), over its shapes, in the order first met
  (the roofline command's records are ceilings, not rows)."""
  grouped = {}
  for r in records:
    if r["family"] == "roofline":
      continue
    key = (r["family"], r["case"], r["dtype"], r["pass"])
    grouped.setdefault(key, []).append(r)
  out = []
  for (family, case, dtype, pass_name), group in grouped.items():
    peers = {}
    for r in group:
      for peer, x in r["speedup"].items():
        peers.setdefault(peer, []).append(x)
    fastest = [min(r["speedup"].values()) for r in group if r["speedup"]]
    shares = [r["implementations"][SUBJECT]["roofline_share"] for r in group
              if "roofline_share" in r["implementations"].get(SUBJECT, {})]
    out.append({"family": family, "op": case, "dtype": dtype, "pass": pass_name,
                "shapes": list(dict.fromkeys(r["shape"] for r in group)), "peers": peers,
                "fastest": geometric_mean(fastest) if fastest else None,
                "fastest_text": _summary(fastest, _speedup_text) if fastest else "–",
                "share_text": _summary(shares, _share_text) if shares else "–"})
  return out


def _escape(text: str) -> str:
  return str(text).replace("|", "\\|")


def table(platform_rows: list[dict]) -> list[str]:
  lines = ["| family | op | dtype | pass | shapes | jaxops' share of the roofline | "
           "speed-up over the fastest peer | speed-up over each peer |",
           "|---|---|---|---|---|---|---|---|"]
  for row in platform_rows:
    peers = "; ".join(f"{peer} {_summary(xs, _speedup_text)}" for peer, xs in row["peers"].items())
    lines.append("| " + " | ".join(_escape(cell) for cell in (
        row["family"], row["op"], row["dtype"], row["pass"], ", ".join(row["shapes"]),
        row["share_text"], row["fastest_text"], peers or "–")) + " |")
  return lines


def ceilings_text(records: list[dict]) -> str:
  """The range of each ceiling over the runs (each process measures its own)."""
  values = {}
  for r in records:
    for unit, value in (r.get("roofline") or {}).items():
      if unit != "what":
        values.setdefault(unit, set()).add(value)
  names = {"GB/s": "copy bandwidth", "TFLOP/s": "matmul rate"}
  return "; ".join(f"{names.get(unit, unit)} " + (
      f"{min(vs):.4g}–{max(vs):.4g}" if len(vs) > 1 else f"{min(vs):.4g}") + f" {unit}"
      for unit, vs in values.items()) or "none recorded"


def platform_section(title: str, records: list[dict]) -> list[str]:
  first = records[0]
  dates = sorted(r["date"] for r in records)
  revisions = sorted({str(r.get("jaxops_revision")) for r in records})
  commands = list(dict.fromkeys(
      f"`{r['command']}`" + ("" if "--preset" in r["command"] or not r["preset"] else
                             f" (preset {r['preset']})") for r in records))
  return [f"## {title}", "",
          f"- Machine: {first['machine']}",
          f"- jax {first['jax']}, jaxlib {first['jaxlib']}; jaxops {', '.join(revisions)}",
          f"- Dates: {dates[0]} to {dates[-1]} (UTC)",
          f"- Roofline ceilings, as each run measured them: {ceilings_text(records)}",
          "- Commands:", *(f"  - {c}" for c in commands), "",
          *table(rows(records)), ""]


def markdown(records: list[dict], command: str, plot_line: str, notes: str) -> str:
  lines = [
      "# Benchmarks", "",
      "What jaxops is worth against its peers on each platform it was measured on. This page "
      "is generated, not edited: `python -m jaxops.bench <family> --json FILE` records each "
      "result as a JSON line (the files are in `docs/bench-results/`), and", "",
      f"    {command}", "",
      "writes this page and its plot from them. The dated history of measurements, with the "
      "analysis behind the kernels, is [docs/benchmarks-log.md](docs/benchmarks-log.md).", "",
      "How to read it: a speed-up is a peer's time over jaxops' time in the same process (above "
      "1: jaxops is faster); the peers are XLA's compiled jnp reference (`xla`, "
      "`implementation=\"xla\"`) and, where they exist, jax.nn (`jax.nn`, `cudnn`), optax, or "
      "XLA's dense dot. A row sums up the shapes measured: the geometric mean, and the range. "
      "The roofline share is jaxops' rate over the device's ceiling measured in the same run "
      "(`python -m jaxops.bench roofline`): the bytes the pass must move over the copy "
      "bandwidth for bandwidth-bound ops, the FLOP rate over the matmul rate for attention, "
      "linear cross-entropy, patch embedding and the prefill GEMM (each family's docstring "
      "documents its bytes and flops). CPU times are medians of calls made after a settle "
      "pause (default allocation: fresh outputs are faulted in); GPU times are the minimum over "
      "repetitions of back-to-back calls.", "",
      *([notes.strip(), ""] if notes else []),
      plot_line, ""]
  for title, platform_records in by_platform(records).items():
    lines += platform_section(title, platform_records)
  if not any(r["platform"] != "cpu" for r in records):
    lines += ["## GPU", "", _GPU_MISSING, ""]
  return "\n".join(lines)


def plot_rows(records: list[dict]) -> dict[str, list[dict]]:
  return {title: [row for row in rows(rs) if row["fastest"] is not None]
          for title, rs in by_platform(records).items()}


def main(argv=()):
  args = parse(argv)
  records = read_records(args.input)
  command = shlex.join(["python", "-m", "jaxops.bench", "report", *argv])
  plot_line = "No plot was asked for (`--plot PATH.png`)."
  if args.plot:
    skipped = report_plot.write(plot_rows(records), args.plot)
    if skipped:
      plot_line = f"The plot was skipped: {skipped}."
      print(f"plot skipped: {skipped}")
    else:
      relative = os.path.relpath(args.plot, pathlib.Path(args.markdown).resolve().parent)
      plot_line = (f"![Speed-up of jaxops over the fastest peer, per op]({relative})")
  notes = pathlib.Path(args.notes).read_text() if args.notes else ""
  pathlib.Path(args.markdown).write_text(markdown(records, command, plot_line, notes))
  print(f"wrote {args.markdown} ({len(records)} results)")
  return 0
