"""The test suite's own layout: no test module imports another.

Shared test code lives in tests/support/ (and the harness in tests/cuda_harness/);
a test module imported as a library ties two files' tests together and, with
pytest's collection, can run a module's set-up twice.
"""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def imported_modules(source: str) -> set[str]:
  """Every module an ``import`` or absolute ``from ... import`` of ``source`` names
  (for ``from a import b``: both ``a`` and ``a.b``, b may be a module)."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_no_test_module_imports_another():
  test_modules = {p.stem for p in TESTS.glob("test_*.py")}
  offending = sorted(
      f"{path.name} imports {name}" for path in TESTS.glob("test_*.py")
      for name in imported_modules(path.read_text())
      if any(part in test_modules for part in name.split(".")))
  assert not offending, "move the shared code to tests/support/:\n" + "\n".join(offending)


def test_the_check_sees_each_form_of_import():
  source = ("import test_norms\nfrom test_softmax import MASKED\nimport tests.test_rope as r\n"
            "from support import backends\ndef f():\n  import test_adamw\n")
  names = imported_modules(source)
  assert {"test_norms", "test_softmax", "tests.test_rope", "test_adamw"} <= names
  assert "support.backends" in names
