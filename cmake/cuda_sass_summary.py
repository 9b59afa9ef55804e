"""Count the instructions that matter for speed in every CUDA kernel's SASS.

Run by the build after the CUDA kernel library is archived (cmake/cuda.cmake):

    python cuda_sass_summary.py CUOBJDUMP NVDISASM_DIR LIBRARY OUTPUT

It reads `cuobjdump -sass LIBRARY` (cuobjdump disassembles through nvdisasm,
found on PATH; NVDISASM_DIR is put first on it, "" for none), folds the
template instantiations of each kernel into one row as the resource table
does (cmake/cuda_resource_table.py) and writes, per architecture, the fewest
and most of each counted instruction over the instantiations:
  HMMA   tensor-core products (mma.sync, wmma)
  LDSM   ldmatrix
  LDGSTS cp.async (global to shared, asynchronous)
  BAR    barriers (__syncthreads)
  MUFU   the special-function unit (exp2, reciprocals)
  LDL/STL local memory (spills; none can be there, the build makes them errors)
  all    every instruction
tests/test_cuda_sass.py reads it: the tensor-core attention kernels must
hold HMMA, LDSM and LDGSTS on every architecture built.
"""

import collections
import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cuda_resource_table import ARCH, MEMBER, demangle, kernel_name  # noqa: E402

FUNCTION = re.compile(r"^\s+Function : (?P<name>\S+)\s*$")
# "/*0040*/  @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x... */"
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?(?P<op>[A-Z][A-Z0-9_]*)")
COUNTED = ("HMMA", "LDSM", "LDGSTS", "BAR", "MUFU", "LDL", "STL")


def parse(text):
  """[(source, arch, mangled name, Counter of opcodes)] from cuobjdump -sass."""
  rows, source, arch, function, counts = [], "?", "?", None, None
  for line in text.splitlines():
    if m := MEMBER.match(line):
      source = m["object"]
    elif m := ARCH.match(line.strip()):
      arch = m["arch"]
    elif m := FUNCTION.match(line):
      function, counts = m["name"], collections.Counter()
      rows.append((source, arch, function, counts))
    elif counts is not None and (m := INSTRUCTION.match(line)):
      counts[m["op"]] += 1
  return rows


def span(values):
  low, high = min(values), max(values)
  return str(low) if low == high else f"{low}-{high}"


def summary(rows):
  names = demangle(sorted({function for _, _, function, _ in rows}))
  kernels = collections.defaultdict(lambda: collections.defaultdict(list))
  for source, arch, function, counts in rows:
    if sum(counts.values()):
      kernels[(source, kernel_name(names[function]))][arch].append(counts)
  header = ["kernel", "arch", "inst", *COUNTED, "all"]
  body = []
  for (source, name), per_arch in sorted(kernels.items()):
    for arch, counted in sorted(per_arch.items()):
      body.append([f"{source}: {name}", arch, str(len(counted)),
                   *(span([c[op] for c in counted]) for op in COUNTED),
                   span([sum(c.values()) for c in counted])])
  widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]

  def fmt(r):
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))

  return "\n".join([
      f"jaxops CUDA kernels: SASS instructions per kernel from cuobjdump -sass ({len(kernels)} "
      "kernels)",
      fmt(header),
      fmt(["-" * w for w in widths]),
      *(fmt(r) for r in body),
      "inst: template instantiations folded into the row; each count is the range over them.",
      "HMMA: tensor-core products; LDSM: ldmatrix; LDGSTS: cp.async; BAR: barriers; MUFU: exp2,",
      "reciprocals; LDL/STL: local memory (spills).",
  ]) + "\n"


def main():
  cuobjdump, nvdisasm_dir, library, output = sys.argv[1:5]
  env = dict(os.environ)
  if nvdisasm_dir:
    env["PATH"] = nvdisasm_dir + os.pathsep + env.get("PATH", "")
  result = subprocess.run([cuobjdump, "-sass", library], capture_output=True, text=True, env=env)
  rows = parse(result.stdout)
  if result.returncode != 0 or not rows:
    sys.exit(f"cuda_sass_summary.py: {cuobjdump} -sass {library} gave no kernels "
             f"(exit {result.returncode}): {result.stderr.strip()[-2000:]}")
  text = summary(rows)
  pathlib.Path(output).write_text(text)
  print(text, end="", flush=True)


if __name__ == "__main__":
  main()
