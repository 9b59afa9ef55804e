"""Sphinx configuration of the jaxops documentation.

Build: ``.venv/bin/python -P -m sphinx -W -b html docs docs/_build/html`` (warnings
are errors). ``JAXOPS_DOCS_EXECUTE=off`` builds without running the examples (the
suite's site test does; their code runs in the suite's own tests).
"""

import os

project = "jaxops"
author = "the jaxops authors"
copyright = "2026, the jaxops authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# .rst first: autosummary writes its generated pages (reST) with the first suffix.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
exclude_patterns = ["_build", "bench-results", "**.ipynb_checkpoints", "jupyter_execute"]
templates_path = ["_templates"]

# The examples run when the site builds (on the CPU, well under a minute each).
nb_execution_mode = os.environ.get("JAXOPS_DOCS_EXECUTE", "force")
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_merge_streams = True

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_ignore_module_all = False
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False


html_theme = "furo"
html_title = "jaxops"
html_static_path = ["_static"]


# The Markdown files link each other by repository path, which reads right on a
# code host; on the site, the files outside docs/ are pages of their own.
REPOSITORY_LINKS = {
    "](../BENCHMARKS.md)": "](benchmarks.md)",
    "](../CONTRIBUTING.md)": "](contributing.md)",
    "[bench-results/](bench-results/)": "`docs/bench-results/`",
}
INCLUDED_LINKS = {  # in CONTRIBUTING.md, relative to the repository root
    "](BENCHMARKS.md)": "](docs/benchmarks.md)",
}


def _rewrite(text, links):
  for old, new in links.items():
    text = text.replace(old, new)
  return text


def _source_read(app, docname, source):
  source[0] = _rewrite(source[0], REPOSITORY_LINKS)


def _include_read(app, relative_path, parent_docname, content):
  content[0] = _rewrite(content[0], INCLUDED_LINKS)


def _skip_member(app, what, name, obj, skip, options):
  # A NamedTuple's fields are documented in its docstring's Attributes section.
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def setup(app):
  app.connect("autodoc-skip-member", _skip_member)
  app.connect("source-read", _source_read)
  app.connect("include-read", _include_read)
