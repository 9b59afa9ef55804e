"""The one mechanism that turns an operator description into a JAX primitive.

Every jaxops kernel is reached through a :class:`FfiPrimitive`. A description
names the primitive, what runs it on the platforms jaxops ships kernels for
(an FFI custom-call target, or a composition of other primitives), its
abstract evaluation and a pure-``jnp`` reference with the same signature and
outputs. What the target's handlers bind (attribute names and types, the
hidden workspace) is not written here: it is the target's contract, declared
once in C++ and read from the extension module (:mod:`jaxops._src.ffi_targets`).
From that, the mechanism registers:

* abstract evaluation (``abstract_eval``);
* lowering: an XLA FFI custom call on every platform that has a kernel (``cpu``
  and ``cuda``), with each static parameter converted to the attribute type the
  C++ handler binds (a Python float would otherwise become an f64 attribute and
  fail to bind against ``Attr<float>``, and only on the device); a primitive
  without a target of its own lowers its ``composite`` there (other primitives,
  e.g. a tangent computed by another op's kernel) or else its reference; on any
  other platform the reference is lowered, so a program still runs there;
* the hidden workspace result of a target that has one: scratch memory the
  kernel needs, sized by the C++ contract, added to the custom call in the
  lowering and dropped there, so JAX (abstract eval, batching, AD) never sees
  it. Device kernels run asynchronously, so their scratch must be an XLA-owned
  buffer that outlives the launch;
* a batching rule: the op's own rule when it has one (``batch_rule``), else
  ``vmap`` of the composite or of the reference (correct for every op, but the
  reference leaves the kernel);
* a JVP rule that differentiates the reference: what makes backward and tangent
  primitives differentiable again (second order). An op's forward primitive
  gets its real differentiation rules from :class:`jaxops._src.autodiff.Differentiable`
  (forward mode through a tangent primitive, reverse mode through the fused
  backward kernel);
* an optional sharding rule (``sharding``, see :mod:`jaxops._src.sharding`):
  on a mesh, the kernel runs once per shard on local shapes instead of XLA
  gathering the operands around an opaque custom call;
* an eager implementation (``jit`` of the primitive);
* the varying manual axes (``vma``) of ``jax.shard_map`` (with its default
  ``check_vma=True``): operands that vary over fewer mesh axes than others are
  cast to varying over all of them before the bind (as ``jnp``'s binary ops
  do), and every result is typed varying over their union. The family's
  abstract evaluation does not see any of it. Because the cast comes before
  the bind, JVP, batching and transpose see operands of one ``vma`` and
  their results and cotangents keep it; the cast's own transpose sums an
  operand's cotangent over the axes it did not vary over (a weight shared by
  every shard gets the sum of the shards' gradients).

Nothing here imports from ``jax._src``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxops._src import ffi_targets, validation
from jaxops._src.sharding import (
    Factors, devices_known, register_for_sharding, shard_locally, typed_results)

# What batching rules receive as the batch dimension of an unbatched operand.
NOT_MAPPED = None

# Platforms for which jaxops ships kernels, as JAX's lowering names them.
KERNEL_PLATFORMS = ("cpu", "cuda")

# Every FfiPrimitive, in creation order (the CUDA harness swaps their kernels).
ALL_PRIMITIVES: list["FfiPrimitive"] = []

Avals = Sequence[jax.core.ShapedArray]
BatchRule = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class FfiPrimitive:
  """A primitive lowered to the FFI target ``target`` (same name on every platform).

  Attributes:
    name: primitive name (shown in jaxprs), e.g. ``"jaxops_layer_norm_fwd"``.
    target: custom-call target name registered by the C++ handlers, or None for
      a primitive without a kernel of its own. Its contract (attribute types,
      workspace) is read from C++ when the primitive is made: a target C++
      does not declare is an error at import.
    composite: for a primitive without a target: ``(*arrays, **params) ->
      tuple`` computed from other primitives (whose kernels then run), lowered
      on the kernel platforms in place of the reference.
    abstract_eval: ``(*avals, **params) -> tuple[ShapedArray, ...]``.
    reference: ``(*arrays, **params) -> tuple[Array, ...]`` in pure ``jnp``,
      with the same outputs as the kernel (the specification of the primitive).
    reference_params: static parameters only the reference uses, which the
      kernel does not bind (e.g. a norm's epsilon for its tangent kernel); every
      other static parameter must be an attribute of the target's contract.
    batch_rule: optional ``(prim, args, dims, **params) -> (outs, out_dims) | None``;
      returning ``None`` falls back to ``vmap`` of the reference.
    input_output_aliases: ``{operand index: result index}`` the kernel may
      write in place (XLA copies the operand first when it is still live).
    sharding: optional ``(avals_in, avals_out, **params) -> Factors``: which
      dimensions shard alike; without it a sharded operand is gathered. For a
      composite it only types the results under Explicit mesh axes (the
      primitives inside partition themselves).
    local_params: optional ``(params, avals_in, local_avals_in) -> params`` for
      a parameter that counts something a shard holds only part of.
  """

  name: str
  target: str | None
  abstract_eval: Callable[..., tuple]
  reference: Callable[..., tuple]
  composite: Callable[..., tuple] | None = None
  reference_params: tuple[str, ...] = ()
  batch_rule: BatchRule | None = None
  input_output_aliases: Mapping[int, int] = dataclasses.field(default_factory=dict)
  sharding: Callable[..., Factors] | None = None
  local_params: Callable[..., dict] | None = None
  primitive: Primitive = dataclasses.field(init=False, repr=False, compare=False)
  # What the target's handlers bind, from C++ (None without a target).
  contract: ffi_targets.TargetContract | None = dataclasses.field(
      init=False, repr=False, compare=False, default=None)
  # The same op on local shapes: what runs on each shard under a sharding rule.
  local_primitive: Primitive = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    if self.target is not None:
      object.__setattr__(self, "contract", ffi_targets.contract(self.target))
    prim = Primitive(self.name)
    prim.multiple_results = True
    object.__setattr__(self, "primitive", prim)
    prim.def_abstract_eval(self._abstract_eval)
    prim.def_impl(self._eager)
    mlir.register_lowering(
        prim, mlir.lower_fun(self._reference_tuple, multiple_results=True))
    batching.primitive_batchers[prim] = self._batch
    ad.primitive_jvps[prim] = self._jvp
    ALL_PRIMITIVES.append(self)
    if self.target is None:
      if self.composite is not None:
        for platform in KERNEL_PLATFORMS:
          mlir.register_lowering(
              prim, mlir.lower_fun(self._composite_tuple, multiple_results=True),
              platform=platform)
        # The kernels inside partition themselves on a mesh, which needs the
        # program's devices at lowering time; jit looks for them at the top.
        register_for_sharding(prim)
      return
    for platform in KERNEL_PLATFORMS:
      mlir.register_lowering(prim, self.kernel_lowering(platform), platform=platform)
    local = Primitive(self.name + "_local")
    local.multiple_results = True
    object.__setattr__(self, "local_primitive", local)
    local.def_abstract_eval(self._abstract_eval)
    local.def_impl(lambda *args, **params: _jitted_bind(local, tuple(sorted(params.items())))(*args))
    for platform in KERNEL_PLATFORMS:
      mlir.register_lowering(local, self.ffi_lowering(platform), platform=platform)

  def __call__(self, *args, **params) -> tuple:
    return tuple(self.primitive.bind(*same_vma(args), **params))

  # -- rules -----------------------------------------------------------------

  def _abstract_eval(self, *avals, **params):
    avals_out = tuple(self.abstract_eval(*avals, **params))
    if self.sharding is not None:
      avals_out = typed_results(
          self.name, self.sharding(avals, avals_out, **params), avals, avals_out)
    return results_varying_like(avals, avals_out)

  def _reference_tuple(self, *args, **params):
    return tuple(self.reference(*args, **params))

  def _composite_tuple(self, *args, **params):
    return tuple(self.composite(*args, **params))

  def _eager(self, *args, **params):
    return _jitted_bind(self.primitive, tuple(sorted(params.items())))(*args)

  def ffi_lowering(self, platform: str, target: str | None = None):
    """The lowering rule of this primitive for ``platform``: a custom call to ``target``
    (default ``self.target``) laid out as ``platform``'s handler expects it.

    The one hook tests use to run another build of a kernel: the CUDA harness
    (tests/cuda_harness) lowers the ``cpu`` platform as ``cuda`` to a CPU
    compilation of the CUDA handlers registered under another target name.
    """
    target = self.target if target is None else target

    def lowering(ctx, *operands, **params):
      attrs = self._kernel_attributes(params)
      workspace = None
      if self.contract.has_workspace:
        integers = {k: int(v) for k, v in attrs.items() if isinstance(v, np.integer)}
        workspace = ffi_targets.workspace(
            self.target, [aval.shape for aval in ctx.avals_in], integers, platform)
        ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
      rule = jax.ffi.ffi_lowering(
          target, operand_output_aliases=dict(self.input_output_aliases) or None)
      results = rule(ctx, *operands, **attrs)
      return results[:-1] if workspace is not None else results

    return lowering

  def kernel_lowering(self, platform: str):
    """The lowering registered for ``platform``: the FFI custom call, under the
    op's sharding rule when it has one (what tests restore after swapping in
    another build of a kernel with :meth:`ffi_lowering`)."""
    direct = self.ffi_lowering(platform)
    if self.sharding is None:
      return direct

    if not register_for_sharding(self.primitive):
      return direct

    def lowering(ctx, *operands, **params):
      if not devices_known(ctx):
        return direct(ctx, *operands, **params)
      factors = self.sharding(ctx.avals_in, ctx.avals_out, **params)

      def local_bind(*local_operands):
        local_params = params
        if self.local_params is not None:
          local_params = self.local_params(params, ctx.avals_in,
                                           [jax.typeof(a) for a in local_operands])
        return self.local_primitive.bind(*local_operands, **local_params)

      sharded = lambda *args: shard_locally(local_bind, factors, args, len(ctx.avals_out))
      return mlir.lower_fun(sharded, multiple_results=True)(ctx, *operands)

    return lowering

  def _kernel_attributes(self, params) -> dict:
    """The parameters the kernel binds, each cast to the type its contract
    declares; ``reference_params`` are the reference's only (e.g. a norm's
    epsilon, which its tangent kernel does not need but its reference uses to
    recompute the statistics)."""
    declared = self.contract.attributes
    attrs = {}
    for key, value in params.items():
      if key in declared:
        attrs[key] = declared[key](value)
      elif key not in self.reference_params:
        raise TypeError(f"{self.name}: parameter {key!r} is not an attribute of {self.target} "
                        f"(declared in C++: {list(declared)}) nor in reference_params")
    missing = [key for key in declared if key not in attrs]
    if missing:
      raise TypeError(f"{self.name}: {self.target} binds the attributes {missing}, "
                      "which the primitive was not given")
    return attrs

  def _batch(self, args, dims, **params):
    if self.batch_rule is not None:
      result = self.batch_rule(self, args, dims, **params)
      if result is not None:
        return result
    # A composite batches through its primitives (which keep their kernels and
    # fall back to their references on other platforms).
    return vmap_reference(self.composite or self.reference, args, dims, **params)

  def _jvp(self, primals, tangents, **params):
    """The reference's JVP: differentiates backward and tangent primitives (the
    second derivatives of an op), and any primitive an op does not describe."""
    return reference_jvp(self.reference, primals, tangents, **params)


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim: Primitive, params: tuple):
  return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def reference_jvp(reference, primals, tangents, **params):
  """``jax.jvp`` of ``reference`` (a function returning a tuple), with JAX's
  symbolic zero tangents made concrete; integer operands get none."""
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return jax.jvp(lambda *a: tuple(reference(*a, **params)), tuple(primals), tuple(tangents))


def vmap_reference(reference, args, dims, **params):
  """Batching fallback: the reference under ``vmap``, outputs batched on axis 0."""
  outs = jax.vmap(lambda *a: tuple(reference(*a, **params)), in_axes=tuple(dims))(*args)
  return outs, (0,) * len(outs)


def batch_to_front(args, dims, which: Sequence[int]):
  """Moves the vmapped axis of ``args[i]`` (i in ``which``) to the front.

  Unbatched ones among ``which`` are broadcast, so all share the leading batch
  axis, except absent operands (the zero-size placeholder of an optional
  operand or of a zero tangent), which stay absent. Returns ``(new_args,
  batch_size)``; other args are left as they are.
  """
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
  out = list(args)
  for i in which:
    if dims[i] is NOT_MAPPED:
      if not is_absent(args[i]):
        out[i] = jnp.broadcast_to(args[i], (size, *args[i].shape))
    else:
      out[i] = jnp.moveaxis(args[i], dims[i], 0)
  return out, size


def absent(dtype):
  """The placeholder of an absent operand: an optional input not given, or a
  tangent that is zero. Kernels take it as "none"."""
  return jnp.zeros((0,), dtype)


def is_absent(x) -> bool:
  return x.shape == (0,)


def is_batched(dims, which: Sequence[int]) -> bool:
  return any(dims[i] is not NOT_MAPPED for i in which)


# -- varying manual axes (jax.shard_map with check_vma=True) ---------------------------


def vma(aval) -> frozenset:
  """The manual mesh axes over which a value of type ``aval`` varies inside
  ``jax.shard_map`` (empty outside it, and with ``check_vma=False``)."""
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10: ShapedArray.mat.varying
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # earlier jax: ShapedArray.vma


def with_vma(aval, axes: frozenset, mesh_of):
  """``aval`` typed varying over ``axes`` (and no others). ``mesh_of``: an aval
  of the same shard_map, whose (manual) mesh a result without one takes."""
  if vma(aval) == axes:
    return aval
  if not hasattr(aval, "manual_axis_type"):
    return aval.update(vma=axes)
  sharding = aval.sharding
  if sharding.mesh.empty:
    sharding = sharding.update(mesh=mesh_of.sharding.mesh)
  return aval.update(sharding=sharding,
                     manual_axis_type=aval.manual_axis_type.update(varying=axes))


def results_varying_like(avals_in, avals_out) -> tuple:
  """Every result varies over the union of the operands' varying axes."""
  varying = [a for a in avals_in if vma(a)]
  if not varying:
    return tuple(avals_out)
  axes = frozenset().union(*(vma(a) for a in varying))
  return tuple(with_vma(a, axes, varying[0]) for a in avals_out)


def vary(x, axes: frozenset):
  """``x`` cast to varying over ``axes`` too: a no-op on the data, whose
  transpose sums the cotangent over the axes ``x`` did not vary over."""
  missing = tuple(sorted(axes - vma(jax.typeof(x)), key=str))
  if not missing:
    return x
  pcast = getattr(jax.lax, "pcast", None)  # jax >= 0.8; jax.lax.pvary before it
  return pcast(x, missing, to="varying") if pcast is not None else jax.lax.pvary(x, missing)


def same_vma(args) -> tuple:
  """``args`` each cast to vary over the union of their varying axes (what a
  primitive's operands are given before its bind, so that JVP, batching and
  transpose see one ``vma``)."""
  axes = [vma(jax.typeof(a)) for a in args]
  union = frozenset().union(*axes)
  if all(a == union for a in axes):
    return tuple(args)
  return tuple(vary(a, union) for a in args)


# -- choosing an implementation ------------------------------------------------

IMPLEMENTATIONS = (None, "ffi", "xla")


def use_kernel(op: str, implementation: str | None,
               dtypes: Mapping[str, Any] | Sequence[Any]) -> bool:
  """Whether a public op runs its primitive (True) or its jnp reference (False).

  ``dtypes``: the dtype of each array operand the kernel takes, by argument
  name (``{"x": x.dtype}``), for the message; a plain sequence is accepted too.
  ``None`` picks the kernel when the default backend has one and every dtype is
  one the kernels support (float32, bfloat16, float16), else the reference
  (float64 under ``jax.experimental.enable_x64``, complex where the op has a
  complex form); ``"ffi"`` insists on the kernel (a clear error otherwise);
  ``"xla"`` always takes the reference.
  """
  implementation = validation.choice(op, "implementation", implementation, IMPLEMENTATIONS)
  if implementation == "xla":
    return False
  named = dict(dtypes) if isinstance(dtypes, Mapping) else dict(enumerate(dtypes))
  unsupported = {name: jnp.dtype(d) for name, d in named.items()
                 if jnp.dtype(d) not in SUPPORTED_FLOAT_DTYPES}
  backend = current_platform()
  available = backend in KERNEL_PLATFORMS and ffi_targets.available(backend)
  if implementation == "ffi":
    if not available:
      raise ValueError(
          f"{op}: implementation='ffi' needs a jaxops kernel for the {backend!r} backend; "
          f"kernels exist for {KERNEL_PLATFORMS} (the CUDA one only when jaxops was built with nvcc)")
    if unsupported:
      name, dtype = next(iter(unsupported.items()))
      which = name if isinstance(name, str) else "an operand"
      raise TypeError(
          f"{op}: implementation='ffi' has no kernel for {which} of dtype {dtype}; the "
          f"kernels support {SUPPORTED_DTYPE_NAMES} (implementation=None runs the jnp "
          "reference for other dtypes)")
    return True
  return available and not unsupported


SUPPORTED_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
SUPPORTED_DTYPE_NAMES = "float32, bfloat16 and float16"


def current_platform() -> str:
  """The default backend as lowering names platforms: "cpu", "cuda", "rocm", "tpu"."""
  backend = jax.default_backend()
  if backend == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    return "rocm" if "rocm" in version else "cuda"
  return backend
