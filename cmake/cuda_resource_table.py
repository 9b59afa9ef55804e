"""Print the registers and memory ptxas gave every CUDA kernel, one row per kernel.

Run by the build after the CUDA kernel library is archived (cmake/cuda.cmake):

    python cuda_resource_table.py CUOBJDUMP LIBRARY OUTPUT

It reads `cuobjdump -res-usage LIBRARY`, folds the template instantiations of
each kernel (dtypes, functors) into one row with the range over them, prints the
table and writes it to OUTPUT.
"""

import collections
import pathlib
import re
import shutil
import subprocess
import sys

MEMBER = re.compile(r"^member .*:(?P<object>[^:]+)\.o:$")
# sm_90a: the architecture-specific target of the FlashAttention-3 kernels.
ARCH = re.compile(r"^arch = (?P<arch>sm_\d+a?)$")
FUNCTION = re.compile(r"^ Function (?P<name>\S+):$")
USAGE = re.compile(r"(?P<key>[A-Z]+)(?:\[\d+\])?:(?P<value>\d+)")


def demangle(names):
  """Mangled -> demangled names (c++filt from binutils; unchanged without it)."""
  cxxfilt = shutil.which("c++filt")
  if not cxxfilt or not names:
    return {name: name for name in names}
  out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True,
                       check=True).stdout.splitlines()
  return dict(zip(names, out))


def kernel_name(demangled):
  """`void ns::(anonymous namespace)::gated_bwd_kernel<...>(...)` -> `gated_bwd_kernel`."""
  head = re.split(r"[<(]", demangled.replace("(anonymous namespace)", "anon"))[0]
  return re.split(r"[\s:]", head)[-1] or demangled


def parse(text):
  """[(source, arch, mangled name, {REG, SHARED, STACK, LOCAL})] from cuobjdump -res-usage."""
  rows, source, arch, function = [], "?", "?", None
  for line in text.splitlines():
    if m := MEMBER.match(line):
      source = m["object"]
    elif m := ARCH.match(line):
      arch = m["arch"]
    elif m := FUNCTION.match(line):
      function = m["name"]
    elif function and line.startswith("  REG:"):
      usage = {m["key"]: int(m["value"]) for m in USAGE.finditer(line)}
      rows.append((source, arch, function, usage))
      function = None
  return rows


def span(values):
  low, high = min(values), max(values)
  return str(low) if low == high else f"{low}-{high}"


def table(rows):
  names = demangle(sorted({function for _, _, function, _ in rows}))
  archs = sorted({arch for _, arch, _, _ in rows})
  kernels = collections.defaultdict(lambda: collections.defaultdict(list))
  instantiations = collections.defaultdict(set)
  for source, arch, function, usage in rows:
    key = (source, kernel_name(names[function]))
    kernels[key][arch].append(usage)
    instantiations[key].add(function)

  header = ["kernel", "inst"]
  for arch in archs:
    header += [f"{arch} regs", f"{arch} smem B"]
  header += ["stack B", "local B"]
  body = []
  for key in sorted(kernels):
    source, name = key
    row = [f"{source}: {name}", str(len(instantiations[key]))]
    for arch in archs:
      usages = kernels[key].get(arch, [])
      row += [span([u["REG"] for u in usages]), span([u["SHARED"] for u in usages])] if usages else ["-", "-"]
    every = [u for usages in kernels[key].values() for u in usages]
    row += [str(max(u["STACK"] for u in every)), str(max(u["LOCAL"] for u in every))]
    body.append(row)

  widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
  def fmt(r):
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
  lines = [
      f"jaxops CUDA kernels: resources per kernel from cuobjdump -res-usage "
      f"({len(kernels)} kernels, {len(rows)} compiled functions over {', '.join(archs)})",
      fmt(header),
      fmt(["-" * w for w in widths]),
      *(fmt(r) for r in body),
      "inst: template instantiations folded into the row (ranges are over them). smem: static",
      "shared memory; dynamic shared memory is set at launch and not shown. Spills: none can be",
      "here, ptxas -warn-spills,-warn-lmem-usage are errors in this build (stack/local would hold them).",
  ]
  return "\n".join(lines) + "\n"


def main():
  cuobjdump, library, output = sys.argv[1:4]
  text = subprocess.run([cuobjdump, "-res-usage", library], capture_output=True, text=True,
                        check=True).stdout
  rows = parse(text)
  if not rows:
    sys.exit(f"cuda_resource_table.py: no kernels found by {cuobjdump} -res-usage {library}")
  result = table(rows)
  pathlib.Path(output).write_text(result)
  print(result, end="", flush=True)


if __name__ == "__main__":
  main()
