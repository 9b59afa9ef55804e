"""Every jaxops Flax module named like a Flax one takes every constructor and
call argument of its Flax twin, with Flax's defaults, so a module swaps in by
changing its import (and a new Flax argument fails here until it is covered)."""

import dataclasses
import inspect

import flax.linen as nn
import pytest
from flax import nnx

from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx

# The one default jaxops changes on purpose: its own attention.
CHANGED_DEFAULTS = {"attention_fn"}


def _twins(ours_module, flax_module):
  return [(name, getattr(ours_module, name), getattr(flax_module, name))
          for name, cls in vars(ours_module).items()
          if isinstance(cls, type) and cls.__module__ == ours_module.__name__
          and isinstance(getattr(flax_module, name, None), type)]


LINEN = _twins(jlinen, nn)
NNX = _twins(jnnx, nnx)


def test_every_flax_twin_is_listed():
  assert {name for name, *_ in LINEN} == {
      "LayerNorm", "RMSNorm", "Embed", "MultiHeadDotProductAttention", "MultiHeadAttention",
      "SelfAttention"}
  assert {name for name, *_ in NNX} == {"LayerNorm", "RMSNorm", "Embed", "MultiHeadAttention"}


def _default(field):
  if field.default is not dataclasses.MISSING:
    return field.default
  return field.default_factory if field.default_factory is not dataclasses.MISSING else None


def _assert_covers(ours: inspect.Signature, theirs: inspect.Signature, what: str):
  """Every parameter of ``theirs`` in ``ours`` with the same kind and default,
  Flax's positional parameters first and in Flax's order."""
  mine = ours.parameters
  for name, parameter in theirs.parameters.items():
    assert name in mine, f"{what}: no argument {name!r}"
    assert mine[name].kind == parameter.kind, f"{what}: {name!r} is {mine[name].kind}"
    if name not in CHANGED_DEFAULTS:
      assert mine[name].default == parameter.default, f"{what}: default of {name!r}"
  positional = lambda s: [n for n, p in s.parameters.items()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  assert positional(ours)[:len(positional(theirs))] == positional(theirs), what


@pytest.mark.parametrize("name,ours,theirs", LINEN, ids=[t[0] for t in LINEN])
def test_linen_covers_flax(name, ours, theirs):
  fields = {f.name: f for f in dataclasses.fields(ours)}
  for field in dataclasses.fields(theirs):
    assert field.name in fields, f"{name}: no attribute {field.name!r}"
    if field.name not in CHANGED_DEFAULTS:
      assert _default(fields[field.name]) == _default(field), f"{name}.{field.name}"
  _assert_covers(inspect.signature(ours.__call__), inspect.signature(theirs.__call__),
                 f"{name}.__call__")


@pytest.mark.parametrize("name,ours,theirs", NNX, ids=[t[0] for t in NNX])
def test_nnx_covers_flax(name, ours, theirs):
  _assert_covers(inspect.signature(ours), inspect.signature(theirs), f"{name}.__init__")
  _assert_covers(inspect.signature(ours.__call__), inspect.signature(theirs.__call__),
                 f"{name}.__call__")
  assert issubclass(ours, theirs)
