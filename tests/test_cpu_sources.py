"""Conventions of the CPU kernel sources (cpu/) that a compiler would not enforce."""

import pathlib
import re

CPU = pathlib.Path(__file__).resolve().parent.parent / "cpu"


def test_kernels_prefetch_only_through_simd_prefetch():
  """GCC 12 deletes a loop of __builtin_prefetch calls (and _mm_prefetch, the
  same builtin) as dead code when nothing else in the loop has an effect: it
  had removed every prefetch of the attention forward and JVP. simd::prefetch
  is an asm statement, which stays; no other file may prefetch another way."""
  raw = re.compile(r"__builtin_prefetch|_mm_prefetch")
  offenders = [f"{path.name}:{number}"
               for path in sorted(CPU.glob("*.[ch]*")) if path.name != "simd.h"
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if raw.search(line) and not line.lstrip().startswith("//")]
  assert not offenders, offenders
  assert "asm volatile(\"prefetcht2" in (CPU / "simd.h").read_text()
