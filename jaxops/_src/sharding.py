"""Sharding rules: a primitive on a sharded mesh runs on its local shards.

Part of the mechanism in :mod:`jaxops._src.primitive`. An op describes how
its dimensions correspond with :class:`Factors`: one name per dimension of
every operand and result (the same name where two dimensions must be sharded
alike: the rows of ``x`` and of its statistics, the batch and heads of q, k and
v), or ``None`` for a dimension the kernel needs whole (the normalised feature
axis, attention's sequence and head_dim axes).

From that the mechanism builds both halves of JAX's ``custom_partitioning``:

* a Shardy sharding rule (``SdyShardingRule``), so propagation through the op
  keeps batch/heads/rows shardings instead of replicating around an opaque
  custom call; ``None`` dimensions become need-replication factors;
* a ``partition`` callback that reads the shardings Shardy chose for the
  operands, keeps those of named factors that divide evenly over their mesh
  axes, replicates everything else (the documented fallback: XLA all-gathers
  an operand sharded along a ``None`` dimension, and the answer stays right),
  and runs the kernel once per shard on local shapes.

A named factor that a result lacks is *summed over*: when it is sharded the
result is all-reduced (``psum``) over its mesh axes. That is exactly what the
weight gradients need (dweight sums over the rows of every shard). An op whose
result combines a factor any other way (softmax over keys, the mean of a loss)
must name that dimension ``None`` instead.

Why ``custom_partitioning`` rather than ``shard_map`` inside the op: the op
does not know the mesh or its operands' shardings when it is traced, and
under ``jit`` with sharded inputs nobody tells it; ``custom_partitioning`` is
asked at compile time, after Shardy has propagated the user's shardings, and a
single-device program is lowered straight to the kernel's custom call. It is
applied in the lowering (not around the public function), so ``vmap``,
``grad`` and the primitives' own rules are untouched by it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import jax
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import NamedSharding, PartitionSpec

# The one private name jaxops touches, in this one place. custom_partitioning's
# lowering needs the program's devices, and jit hands them to the lowering only
# when the jaxpr contains a primitive in this registry (custom_partitioning_p is
# in it). A primitive that applies custom_partitioning inside its own lowering
# (the only way that composes with vmap and AD, which custom_partitioning_p has
# no rules for) must be registered too; TransformerEngine's JAX primitives do
# the same. If a later JAX moves it, `register_for_sharding` returns False and
# the ops lower without their rule on a mesh (XLA gathers: right, but slower).
try:
  from jax._src import dispatch as _jax_dispatch  # noqa: private, see above
  _DEVICES_DURING_LOWERING = _jax_dispatch.prim_requires_devices_during_lowering
except (ImportError, AttributeError):
  _DEVICES_DURING_LOWERING = None


def register_for_sharding(primitive) -> bool:
  """Asks jit to give ``primitive``'s lowering the program's devices."""
  if _DEVICES_DURING_LOWERING is None:
    return False
  _DEVICES_DURING_LOWERING.add(primitive)
  return True


def devices_known(ctx) -> bool:
  """Whether custom_partitioning can lower here: one device, or known devices."""
  axis_context = ctx.module_context.axis_context
  return getattr(axis_context, "device_assignment", ()) is not None

# A dimension's factor: a name, a tuple of names (a compound factor: GQA's query
# heads are (kv_heads, group)), or None (the kernel needs the dimension whole).
Factor = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Factors:
  """Which dimensions of a primitive's operands and results are sharded alike.

  ``operands[i][d]`` / ``results[j][d]`` name dimension ``d`` of operand ``i``
  / result ``j``. ``sizes`` gives the size of factors used only inside
  compound factors (as Shardy requires).

  ``partitioned(axes, mesh)``, optional: given the mesh axes chosen for each
  named factor, the function to run on each shard in place of the kernel on
  its local shapes (it may use collectives over those axes: ring attention
  over a sharded sequence factor), or None for the kernel.
  """

  operands: Sequence[Sequence[Factor]]
  results: Sequence[Sequence[Factor]]
  sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  partitioned: Callable | None = dataclasses.field(default=None, compare=False)

  def sdy_rule(self) -> SdyShardingRule:
    fresh = (f"whole{i}" for i in range(1_000_000))
    whole: list[str] = []

    def mapping(dims):
      out = []
      for factor in dims:
        if factor is None:
          whole.append(next(fresh))
          out.append(whole[-1])
        elif isinstance(factor, tuple):
          out.append(CompoundFactor(*factor))
        else:
          out.append(factor)
      return ArrayMapping(*out)

    operands = tuple(mapping(dims) for dims in self.operands)
    results = tuple(mapping(dims) for dims in self.results)
    in_results = {name for dims in self.results for name in _names(dims)}
    summed = tuple(sorted({name for dims in self.operands for name in _names(dims)}
                          - in_results))
    return SdyShardingRule(operands, results, reduction_factors=summed,
                           need_replication_factors=tuple(whole), **dict(self.sizes))


def _names(dims) -> list[str]:
  names = []
  for factor in dims:
    if isinstance(factor, tuple):
      names.extend(factor)
    elif factor is not None:
      names.append(factor)
  return names


def _axes_tuple(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_entries(sharding, ndim: int) -> list:
  if not isinstance(sharding, NamedSharding):
    return [None] * ndim  # e.g. a GSPMDSharding that has no mesh: replicate
  spec = tuple(sharding.spec)
  return list(spec) + [None] * (ndim - len(spec))


class _Assignment:
  """Mesh axes chosen for each factor, from the operands' shardings."""

  def __init__(self, factors: Factors, mesh, arg_shapes):
    self.factors = factors
    self.mesh = mesh
    self.axes: dict[str, tuple[str, ...]] = {}
    sizes = dict(factors.sizes)
    for dims, arg in zip(factors.operands, arg_shapes):
      for factor, size in zip(dims, arg.shape):
        if isinstance(factor, str):
          sizes.setdefault(factor, size)
    used: set[str] = set()
    for dims, arg in zip(factors.operands, arg_shapes):
      for factor, entry in zip(dims, _spec_entries(arg.sharding, len(arg.shape))):
        axes = _axes_tuple(entry)
        if factor is None or not axes:
          continue
        # A compound dimension is sharded through its major factor only.
        name = factor[0] if isinstance(factor, tuple) else factor
        if name in self.axes or used & set(axes):
          continue
        if sizes[name] % math.prod(mesh.shape[a] for a in axes):
          continue  # uneven shards: keep this factor whole
        self.axes[name] = axes
        used.update(axes)

  def sharding(self, dims) -> NamedSharding:
    entries = []
    for factor in dims:
      names = factor if isinstance(factor, tuple) else (factor,) if factor else ()
      axes = tuple(a for name in names for a in self.axes.get(name, ()))
      entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(self.mesh, PartitionSpec(*entries))

  def summed_axes(self, result_dims) -> tuple[str, ...]:
    present = set(_names(result_dims))
    return tuple(a for name, axes in self.axes.items() if name not in present for a in axes)


def shard_locally(local_bind, factors: Factors, args, n_results: int):
  """Calls ``local_bind(*args)`` under a ``custom_partitioning`` built from ``factors``.

  ``local_bind`` runs the kernel on whatever shapes it is given: the whole
  arrays on one device, one shard each on a mesh.
  """

  @custom_partitioning
  def sharded(*operands):
    return tuple(local_bind(*operands))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    assignment = _Assignment(factors, mesh, arg_shapes)
    arg_shardings = tuple(assignment.sharding(dims) for dims in factors.operands)
    result_shardings = tuple(assignment.sharding(dims) for dims in factors.results)
    summed = [assignment.summed_axes(dims) for dims in factors.results]
    custom = (None if factors.partitioned is None
              else factors.partitioned(dict(assignment.axes), mesh))
    if custom is not None:
      return mesh, custom, result_shardings, arg_shardings

    def lower(*local_operands):
      outs = list(local_bind(*local_operands))
      for i, axes in enumerate(summed):
        if axes:
          outs[i] = jax.lax.psum(outs[i], axes)
      return tuple(outs)

    return mesh, lower, result_shardings, arg_shardings

  sharded.def_partition(partition=partition, sharding_rule=factors.sdy_rule())
  outs = sharded(*args)
  assert len(outs) == n_results
  return outs


def leading_axes(roles: str, *, whole_trailing: int = 1, grouped_axes=None):
  """The sharding of an op over the leading axes of its main operand ``x``.

  ``roles`` is ``"<operands> -> <results>"``, one letter each: ``x`` an array
  shaped like ``x`` (a dimension of size 1 where ``x``'s is larger is a
  broadcast, kept whole; so is a zero-size placeholder), ``s`` an array over
  ``x``'s leading axes (row statistics, labels, per-token losses), ``p`` an
  array kept whole (weights, scalars), ``g`` a per-group sum over rows
  ([groups, ...]: weight gradients). ``x`` is the first ``x`` operand. Its last
  ``whole_trailing`` axes stay whole (the normalised or softmax axis; 0 for
  elementwise ops); every other axis shards, and the ``x`` and ``s`` arrays
  follow it.

  ``grouped_axes(x_aval, params)`` is how many leading axes of ``x`` index the
  groups of a ``g`` result (0: one group, which sums over every row, so sharded
  rows are all-reduced). The first of them shards with the groups (the op's
  ``local_params`` must then give each shard its own group count); the others
  stay whole.
  """
  operand_roles, result_roles = (part.strip() for part in roles.split("->"))

  def factors(avals_in, avals_out, **params):
    x = avals_in[operand_roles.index("x")]
    split = x.ndim - whole_trailing
    lead = [f"axis{i}" for i in range(split)]
    grouped = grouped_axes(x, params) if grouped_axes is not None else 0
    sizes = {}
    if grouped == 0:
      group_dim = None
    elif grouped == 1:
      group_dim = "axis0"
    else:
      lead[1:grouped] = [None] * (grouped - 1)
      group_dim = ("axis0", "group_minor")
      sizes["group_minor"] = math.prod(x.shape[1:grouped])

    def dims(role, aval):
      if role == "x" and aval.ndim == x.ndim:
        return tuple(name if d < split and aval.shape[d] == x.shape[d] else None
                     for d, name in enumerate(lead + [None] * whole_trailing))
      if role == "s" and aval.ndim == split:
        return tuple(lead)
      if role == "g":
        return (group_dim,) + (None,) * (aval.ndim - 1)
      return (None,) * aval.ndim

    return Factors([dims(r, a) for r, a in zip(operand_roles, avals_in)],
                   [dims(r, a) for r, a in zip(result_roles, avals_out)], sizes)

  return factors


def elementwise(avals_in, avals_out, **params):
  """Every axis of every operand and result shards alike (activations)."""
  roles = "x" * len(avals_in) + " -> " + "x" * len(avals_out)
  return leading_axes(roles, whole_trailing=0)(avals_in, avals_out, **params)


def typed_results(primitive_name: str, factors: Factors, avals_in, avals_out):
  """Results typed with their shardings under a mesh of Explicit axes.

  There the sharding is part of every value's type, and a primitive's abstract
  evaluation must give it (else its results count as replicated and XLA gathers
  them). The rule is the same as on an Auto mesh: named factors keep the
  operands' sharding, everything else is whole.
  """
  sharded = [a for a in avals_in
             if isinstance(getattr(a, "sharding", None), NamedSharding)
             and any(entry is not None for entry in a.sharding.spec)]
  if not sharded:
    return avals_out
  mesh = sharded[0].sharding.mesh
  assignment = _Assignment(factors, mesh, avals_in)
  for index, (dims, aval) in enumerate(zip(factors.operands, avals_in)):
    entries = _spec_entries(getattr(aval, "sharding", None), aval.ndim)
    for axis, (factor, entry) in enumerate(zip(dims, entries)):
      name = factor[0] if isinstance(factor, tuple) else factor
      if entry is not None and (name is None or name not in assignment.axes):
        # On an Auto mesh XLA would gather this operand; with Explicit axes the
        # types would no longer match the user's, so say so instead.
        raise ValueError(
            f"{primitive_name}: operand {index} is sharded along axis {axis} "
            f"({entry!r}), which this op keeps whole (or cannot split evenly). With "
            "Explicit mesh axes, reshard it first (jax.sharding.reshard), or use Auto axes, "
            "where XLA gathers it for the op")
  return tuple(a.update(sharding=assignment.sharding(dims))
               for a, dims in zip(avals_out, factors.results))
