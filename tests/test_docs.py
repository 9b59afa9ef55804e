"""The documentation: the docstrings' examples run, and the Sphinx site builds.

Every public module's docstring examples (``>>>``) run as doctests, with
``jax``, ``jax.numpy as jnp``, ``numpy as np`` and ``jaxops`` imported, so that
a stale example fails here; so do the README's quick start and the code of
the landing and getting-started pages. The README stays one screen and holds
the commands .ci/run runs. The site (docs/, README "Documentation") is built
with warnings as errors, with the examples' execution off: their code runs in
tests/test_docs_examples.py, one process per example.
"""

import doctest
import importlib
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# The modules whose docstrings the API reference renders (docs/api/).
PUBLIC_MODULES = [
    "jaxops._src.activations", "jaxops._src.adamw", "jaxops._src.attention",
    "jaxops._src.cross_entropy", "jaxops._src.embedding", "jaxops._src.export",
    "jaxops._src.ffi_targets", "jaxops._src.norms", "jaxops._src.paged_attention",
    "jaxops._src.patch_embed", "jaxops._src.ring_attention", "jaxops._src.rope",
    "jaxops._src.routing", "jaxops._src.sampling", "jaxops._src.softmax", "jaxops._src.sparse",
    "jaxops.optim", "jaxops.sparse", "jaxops.testing",
    "jaxops.flax.linen", "jaxops.flax.nnx", "jaxops.flax._attention",
    "jaxops.flax._patch_embed", "jaxops.flax._sparse",
    "jaxops.models.config", "jaxops.models.decoder", "jaxops.models.generate",
    "jaxops.models.serving", "jaxops.models.training", "jaxops.models.data",
]

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples():
  finder = doctest.DocTestFinder(exclude_empty=True)
  for name in PUBLIC_MODULES:
    module = importlib.import_module(name)
    for test in finder.find(module, name, globs={}):
      if test.examples and test.name.split(".")[-1] != "__test__":
        yield pytest.param(name, test.name, id=test.name.removeprefix(name + "."))


def test_every_public_op_has_an_example():
  documented = {name.split(".")[-1] for _, name in (p.values for p in _examples())}
  ops = set(jaxops.__all__) - {"optim", "sparse"}
  missing = sorted(ops - documented - {"attention", "paged_attention", "paged_kv_update"})
  assert not missing, f"public ops without a docstring example: {missing}"


@pytest.mark.parametrize("module,name", list(_examples()))
def test_docstring_example(module, name):
  finder = doctest.DocTestFinder(exclude_empty=True)
  globs = {"jax": jax, "jnp": jnp, "np": np, "jaxops": jaxops}
  (test,) = [t for t in finder.find(importlib.import_module(module), module, globs=globs)
             if t.name == name]
  runner = doctest.DocTestRunner(optionflags=OPTIONS)
  output = []
  result = runner.run(test, out=output.append)
  assert result.failed == 0, "".join(output)


def test_readme_is_one_screen_and_holds_what_ci_runs():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 150
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  commands = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
  assert len(commands) == 2  # the tests, and the Bazel build
  for command in commands:
    assert command in readme.splitlines(), f"README.md lacks .ci/run's command {command!r}"


def _fenced_python(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_quick_start_runs():
  (quick_start,) = re.findall(r"^## Quick start\n\n```python\n(.*?)^```",
                              (ROOT / "README.md").read_text(), re.S | re.M)
  exec(compile(quick_start, "README.md", "exec"), {})


@pytest.mark.parametrize("page", ["index.md", "getting-started.md"])
def test_page_code_runs(page):
  blocks = _fenced_python((DOCS / page).read_text())
  assert blocks
  namespace = {}
  for block in blocks:
    if block.startswith(">>>"):
      test = doctest.DocTestParser().get_doctest(block, namespace, page, None, 0)
      runner = doctest.DocTestRunner(optionflags=OPTIONS)
      output = []
      assert runner.run(test, out=output.append).failed == 0, "".join(output)
    else:
      exec(compile(block, page, "exec"), namespace)


@pytest.mark.skipif(importlib.util.find_spec("sphinx") is None
                    or importlib.util.find_spec("myst_nb") is None,
                    reason="the docs stack is not installed (pip install '.[docs]')")
def test_site_builds_without_warnings(tmp_path):
  env = dict(os.environ, JAXOPS_DOCS_EXECUTE="off")
  command = [sys.executable, "-P", "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
             "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
  run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
  page = (tmp_path / "html" / "api" / "_autosummary" / "jaxops.attention.html").read_text()
  assert "query_offset" in page
