"""Constructor signatures of the nnx wrappers: Flax's own plus ``implementation``.

The nnx wrappers subclass Flax's modules and forward every constructor
argument to them, so they accept exactly what Flax accepts (with Flax's
defaults, a future argument included); ``__signature__`` shows that list to
``inspect``/``help`` instead of ``*args, **kwargs``.
"""

from __future__ import annotations

import inspect

def extended(flax_init, **defaults):
  """``flax_init``'s signature with new defaults for some of its arguments and
  the other ``defaults`` (``implementation=None``...) added as keyword-only."""
  signature = inspect.signature(flax_init)
  parameters = [p.replace(default=defaults.pop(p.name)) if p.name in defaults else p
                for p in signature.parameters.values()]
  added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
           for name, default in defaults.items()]
  at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
  return signature.replace(parameters=parameters[:at] + added + parameters[at:])


def bind(signature, *args, **kwargs):
  """The arguments of one call by name, defaults applied (a TypeError as Python's
  own when an argument is missing or unknown)."""
  bound = signature.bind(*args, **kwargs)
  bound.apply_defaults()
  return bound.arguments
