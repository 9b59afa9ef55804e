"""Do two jaxops builds compile the same reverse-mode programs?

Timings of memory-bound ops on a shared VM move by 2x between runs; whether a
change can have slowed ``jax.grad`` at all is better answered by comparing what
XLA compiles. For every public op this compiles ``jax.vjp`` (forward and
backward) with each build (``<python> -P tools/compare_programs.py --dump DIR``
runs in each interpreter) and prints, per op, the lines where the optimised
HLO differs once names, source locations and stack frames are set aside.

  python tools/compare_programs.py --before /tmp/old/.venv/bin/python --after .venv/bin/python
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import subprocess
import sys
import tempfile


def _programs():
  import jax
  import jax.numpy as jnp
  import jaxops

  x, r = jnp.ones((64, 128)), jnp.ones((64, 128))
  w, labels = jnp.ones((128,)), jnp.zeros((64,), jnp.int32)
  q, kv = jnp.ones((1, 64, 4, 32)), jnp.ones((1, 64, 2, 32))
  table, ids = jnp.ones((100, 128)), jnp.zeros((64,), jnp.int32)
  unembed = jnp.ones((128, 50))
  cases = {
      "layer_norm": (lambda x, w: jaxops.layer_norm(x, w, w), (x, w)),
      "rms_norm": (jaxops.rms_norm, (x, w)),
      "add_rms_norm": (jaxops.add_rms_norm, (x, r, w)),
      "softmax": (jaxops.softmax, (x,)),
      "log_softmax": (jaxops.log_softmax, (x,)),
      "causal_softmax": (jaxops.causal_softmax, (x,)),
      "cross_entropy": (lambda x: jaxops.cross_entropy(x, labels), (x,)),
      "linear_cross_entropy": (lambda x, u: jaxops.linear_cross_entropy(x, u, labels),
                               (x, unembed)),
      "gelu": (jaxops.gelu, (x,)), "silu": (jaxops.silu, (x,)),
      "swiglu": (jaxops.swiglu, (x, r)), "geglu": (jaxops.geglu, (x, r)),
      "rope": (lambda q: jaxops.rope(q, jnp.arange(64)), (q,)),
      "embedding": (lambda t: jaxops.embedding(t, ids), (table,)),
      "attention": (lambda q, k, v: jaxops.attention(q, k, v, is_causal=True), (q, kv, kv)),
  }
  for name, (fn, args) in cases.items():
    def vjp(*args, fn=fn):
      out, pullback = jax.vjp(fn, *args)
      return out, pullback(jax.tree.map(jnp.ones_like, out))

    yield name, jax.jit(vjp).lower(*args).compile().as_text()


def _normalised(text: str) -> list[str]:
  """The computations' lines without value numbers, metadata and stack frames."""
  lines = []
  for line in text.splitlines():
    if not re.match(r"^(ENTRY|%|\}|  )", line) or re.match(r"^ *\d+ [{\"]", line):
      continue
    line = re.sub(r"metadata=\{[^}]*\}|, stack_frame_id=\d+|, frontend_attributes=\{[^}]*\}",
                  "", line)
    lines.append(re.sub(r"\.\d+|_\d+\b", "", line))
  return lines


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dump", help=argparse.SUPPRESS)
  parser.add_argument("--before")
  parser.add_argument("--after")
  args = parser.parse_args(argv)
  if args.dump:
    for name, text in _programs():
      (pathlib.Path(args.dump) / f"{name}.hlo").write_text(text)
    return 0
  with tempfile.TemporaryDirectory() as root:
    dirs = {}
    for build in ("before", "after"):
      dirs[build] = pathlib.Path(root) / build
      dirs[build].mkdir()
      subprocess.run([getattr(args, build), "-P", __file__, "--dump", str(dirs[build])],
                     check=True)
    for path in sorted(dirs["after"].iterdir()):
      diff = list(difflib.unified_diff(_normalised((dirs["before"] / path.name).read_text()),
                                       _normalised(path.read_text()), lineterm="", n=0))
      changed = [l for l in diff if l[:1] in "+-" and l[:3] not in ("+++", "---")]
      print(f"{path.stem:<22} {'identical' if not changed else f'{len(changed)} lines differ'}")
      for line in changed:
        print(f"    {line[:200]}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
