"""The documentation's executed examples (docs/examples/*.md) run.

The site's build runs them in a Jupyter kernel; the suite builds the site with
execution off (tests/test_docs.py) and runs each example's code cells here
instead, in order, in a fresh process (an example may set JAX options), with
matplotlib drawing off-screen. Each must take well under a minute on a CPU.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "docs" / "examples"
CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.S | re.M)

RUNNER = """
import sys
cells = sys.stdin.read().split("\\0")
namespace = {"__name__": "__main__"}
for i, cell in enumerate(cells):
  exec(compile(cell, f"{sys.argv[1]}, cell {i}", "exec"), namespace)
"""


def code_cells(path: pathlib.Path) -> list[str]:
  return CODE_CELL.findall(path.read_text())


def test_every_example_has_code():
  examples = sorted(EXAMPLES.glob("*.md"))
  assert len(examples) >= 3
  for path in examples:
    assert code_cells(path), f"{path.name} has no code cell"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the test extra has it)")
@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.md")))
def test_example_runs(name):
  path = EXAMPLES / f"{name}.md"
  env = dict(os.environ, MPLBACKEND="Agg", JAXOPS_TEST_WORKERS="1")
  run = subprocess.run([sys.executable, "-P", "-c", RUNNER, path.name],
                       input="\0".join(code_cells(path)), capture_output=True, text=True,
                       env=env, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
