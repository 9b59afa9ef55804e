"""``import jaxops`` from a source checkout that has no compiled extension.

Python puts the current directory first on ``sys.path``, so running Python in
the repository root imports the checkout's ``jaxops/`` instead of the
installed package. Without a build in place the import must say that, and
what to do, instead of a bare "No module named 'jaxops._jaxops_cpu'".
"""

import os
import pathlib
import shutil
import site
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxops"


def _copy_without_extension(destination: pathlib.Path) -> None:
  shutil.copytree(PACKAGE, destination / "jaxops",
                  ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))


def test_a_checkout_without_extension_says_what_to_do(tmp_path):
  checkout, installed = tmp_path / "checkout", tmp_path / "site-packages"
  _copy_without_extension(checkout)
  (checkout / "pyproject.toml").write_text("[project]\nname = 'jaxops'\n")
  # A stand-in for the installed package that the checkout shadows.
  (installed / "jaxops").mkdir(parents=True)
  (installed / "jaxops" / "__init__.py").write_text("")
  # -S: no .pth files, so an editable install's import hook (a developer's
  # environment) cannot redirect the import; site-packages stays reachable.
  search_path = os.pathsep.join([str(installed), *site.getsitepackages()])
  result = subprocess.run(
      [sys.executable, "-S", "-c", "import jaxops"], cwd=checkout, capture_output=True,
      text=True, env={"PYTHONPATH": search_path, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
      timeout=120)
  assert result.returncode != 0
  last_line = result.stderr.strip().splitlines()[-1]
  assert last_line.startswith("ModuleNotFoundError: No module named 'jaxops._jaxops_cpu': "
                              "jaxops is being imported from the source checkout at "
                              f"{(checkout / 'jaxops').resolve()}, which has no compiled "
                              "extension."), last_line
  assert f"It shadows the jaxops installed at {installed / 'jaxops'}" in last_line
  assert "with `python -P`" in last_line
  assert 'pip install -e ".[test]" -Cbuild-dir=build/editable' in last_line
