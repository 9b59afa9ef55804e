"""Writes the one-page summary of a tools/gpu_check.sh run, and prints it.

    python -P tools/gpu_check_summary.py --out OUT --scratch SCRATCH [--prefix PREFIX]

Reads what the stages left (SCRATCH/env.txt, SCRATCH/stages.tsv, OUT/tests.xml,
OUT/bench.jsonl, OUT/profiles.csv, OUT/sanitizer.txt and the installed build's
jaxops/cuda_resource_usage.txt under PREFIX); a stage that did not run is
reported as missing, never guessed. The benchmark table is the one
``python -m jaxops.bench report`` makes of OUT/bench.jsonl (with OUT/bench.png).
Standard library only, so that it runs even where the build failed.
"""

from __future__ import annotations

import argparse
import csv
import io
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

FAILURES_LISTED = 60


def stages_section(scratch: pathlib.Path) -> list[str]:
  lines = ["## Stages", "", "| stage | outcome | seconds | limit (s) |", "|---|---|---|---|"]
  stages = scratch / "stages.tsv"
  rows = [line.split("\t") for line in stages.read_text().splitlines() if line] if stages.is_file() else []
  lines += [f"| {name} | {outcome} | {seconds} | {limit} |" for name, outcome, seconds, limit in rows]
  if not rows:
    lines.append("| (no stage ran) | | | |")
  return lines + [""]


def test_counts(junit: pathlib.Path) -> tuple[dict[str, int], list[str]]:
  """(counts of passed/failed/error/skipped, 'test id: first line of the message' of each
  failure and error) from pytest's JUnit XML."""
  counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  failures = []
  for case in ElementTree.parse(junit).getroot().iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    outcome = "passed"
    for child in case:
      if child.tag in ("failure", "error"):
        outcome = "failed" if child.tag == "failure" else "error"
        message = (child.get("message") or child.text or "").strip().splitlines()
        failures.append(f"{name}: {message[0][:200] if message else '(no message)'}")
        break
      if child.tag == "skipped":
        outcome = "skipped"
    counts[outcome] += 1
  return counts, failures


def tests_section(out: pathlib.Path) -> list[str]:
  junit = out / "tests.xml"
  if not junit.is_file():
    return ["## Tests", "", "No test report (the tests stage did not run or did not finish).", ""]
  counts, failures = test_counts(junit)
  lines = ["## Tests", "", ", ".join(f"{n} {k}" for k, n in counts.items()), ""]
  if failures:
    lines += ["Failures and errors:", ""]
    lines += [f"- `{f}`" for f in failures[:FAILURES_LISTED]]
    if len(failures) > FAILURES_LISTED:
      lines.append(f"- ... and {len(failures) - FAILURES_LISTED} more (tests.xml)")
    lines.append("")
  return lines


def bench_section(out: pathlib.Path, scratch: pathlib.Path) -> list[str]:
  results = out / "bench.jsonl"
  if not results.is_file() or not results.read_text().strip():
    return ["## Benchmarks", "", "No benchmark results (the bench stage did not run).", ""]
  table = scratch / "bench.md"
  report = subprocess.run(
      [sys.executable, "-P", "-m", "jaxops.bench", "report", "--input", str(results),
       "--markdown", str(table), "--plot", str(out / "bench.png")],
      capture_output=True, text=True)
  if report.returncode != 0 or not table.is_file():
    return ["## Benchmarks", "", f"`python -m jaxops.bench report` failed ({report.returncode}):",
            "", "```", (report.stderr or report.stdout).strip()[-2000:], "```", ""]
  return ["## Benchmarks", "", platform_sections(table.read_text()), ""]


def platform_sections(page: str) -> str:
  """The report's per-platform sections (its headings one level down), without
  the page's preamble on how BENCHMARKS.md is made."""
  start = page.find("\n## ")
  sections = page[start + 1:] if start >= 0 else page
  return "\n".join("#" + line if line.startswith("## ") else line
                   for line in sections.strip().splitlines())


# ncu metrics worth a column, by the names ncu's "details" page gives them.
PROFILE_METRICS = ("Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput",
                   "Registers Per Thread", "Dynamic Shared Memory Per Block",
                   "Theoretical Occupancy", "Achieved Occupancy")


def kernel_base_name(demangled: str) -> str:
  """'void ns::(anonymous namespace)::name<T, 4>(const T *)' -> 'name'."""
  name = demangled.replace("(anonymous namespace)", "anonymous")
  name = re.split(r"[(<]", name, maxsplit=1)[0]
  return name.split("::")[-1].split()[-1] if name.strip() else demangled


def profile_rows(text: str) -> dict[str, dict[str, str]]:
  """{kernel: {metric: 'value unit'}} from ncu's CSV (several runs' files
  concatenated, each with its header line; the first launch of a kernel kept)."""
  kernels: dict[str, dict[str, str]] = {}
  header = None
  for row in csv.reader(io.StringIO(text)):
    if not row or row[0].startswith("=="):
      continue
    if row[0] == "ID":
      header = row
      continue
    if header is None or len(row) != len(header):
      continue
    fields = dict(zip(header, row))
    kernel = kernel_base_name(fields.get("Kernel Name", "?"))
    metrics = kernels.setdefault(kernel, {"Block Size": fields.get("Block Size", ""),
                                          "Grid Size": fields.get("Grid Size", "")})
    name = fields.get("Metric Name", "")
    if name in PROFILE_METRICS and name not in metrics:
      metrics[name] = f"{fields.get('Metric Value', '')} {fields.get('Metric Unit', '')}".strip()
  return kernels


def profiles_section(out: pathlib.Path) -> list[str]:
  profiles = out / "profiles.csv"
  if not profiles.is_file():
    return []
  kernels = profile_rows(profiles.read_text(errors="replace"))
  columns = ("Block Size", "Grid Size") + PROFILE_METRICS
  lines = ["## Profiles (ncu, one launch each)", "",
           "| kernel | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
  lines += [f"| {k} | " + " | ".join(m.get(c, "") for c in columns) + " |"
            for k, m in kernels.items()]
  if not kernels:
    lines.append("| (ncu reported no kernel: see log.txt) |" + " |" * len(columns))
  return lines + [""]


def sanitizer_section(out: pathlib.Path) -> list[str]:
  log = out / "sanitizer.txt"
  if not log.is_file():
    return []
  text = log.read_text(errors="replace")
  summary = re.findall(r"ERROR SUMMARY: .*", text)
  errors = [line for line in text.splitlines() if re.search(r"Invalid|out of bounds|misaligned", line)]
  lines = ["## compute-sanitizer memcheck", "", summary[-1] if summary else
           "No ERROR SUMMARY line (the run did not finish: see log.txt)."]
  lines += [f"- `{line.strip()}`" for line in errors[:20]]
  return lines + [""]


def resources_section(prefix: pathlib.Path | None) -> list[str]:
  table = prefix / "jaxops" / "cuda_resource_usage.txt" if prefix else None
  if table is None or not table.is_file():
    return ["## CUDA kernel resources", "", "No resource table (no CUDA build).", ""]
  return ["## CUDA kernel resources", "", "```", table.read_text().rstrip(), "```", ""]


def summary(out: pathlib.Path, scratch: pathlib.Path, prefix: pathlib.Path | None) -> str:
  env = scratch / "env.txt"
  lines = ["# jaxops GPU check", "", "```",
           env.read_text().rstrip() if env.is_file() else "(no environment report)", "```", ""]
  lines += stages_section(scratch)
  lines += tests_section(out)
  lines += bench_section(out, scratch)
  lines += profiles_section(out)
  lines += sanitizer_section(out)
  lines += resources_section(prefix)
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--scratch", type=pathlib.Path, required=True)
  parser.add_argument("--prefix", type=pathlib.Path)
  args = parser.parse_args(argv)
  text = summary(args.out, args.scratch, args.prefix)
  (args.out / "summary.md").write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
