"""gelu, silu, swiglu and geglu: primitives and public functions.

Forward primitives return the activation; backward primitives take the output
cotangent and the saved inputs and return the input gradients, both of them in
one pass for the gated ops. The kernels see the operands as flat arrays, so any
shape works and vmap only has to line the batch axes up.

Forward mode: the tangent of an elementwise ``f`` is ``f'(x) * dx``, the same
product the backward kernel forms with the cotangent, so gelu's and silu's
tangent primitives run their backward kernels. The gated ops' tangents are the
reference's JVP, one elementwise expression XLA fuses into a single pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front, is_absent
from jaxops._src.sharding import elementwise

_F32 = jnp.float32


def _like(x):
  return jax.core.ShapedArray(x.shape, x.dtype)


def _elementwise_batch_rule(prim, args, dims, **params):
  """All operands batched on one axis: the kernel runs as is (elementwise, so
  the batch axis is just more elements). Otherwise the batch axes are moved to
  the front, broadcasting the unbatched operands."""
  if all(d is not NOT_MAPPED and d == dims[0] for d in dims):
    outs = prim(*args, **params)
    return outs, (dims[0],) * len(outs)
  args, _ = batch_to_front(args, dims, range(len(args)))
  outs = prim(*args, **params)
  return outs, (0,) * len(outs)


def _vjp_of(forward):
  """The backward reference: the VJP of a float32 forward reference, in the
  dtypes of the primal inputs."""

  def backward(dy, *primals, **params):
    _, vjp = jax.vjp(lambda *a: forward(*a, **params), *(p.astype(_F32) for p in primals))
    grads = vjp(dy.astype(_F32))
    return tuple(g.astype(p.dtype) for g, p in zip(grads, primals))

  return backward


def _jvp_of(forward):
  """The tangent reference: the JVP of a float32 forward reference (absent
  tangents are zero), in the dtype of the primal inputs."""

  def tangent(*operands, **params):
    primals, tangents = operands[:len(operands) // 2], operands[len(operands) // 2:]
    tangents = [jnp.zeros_like(p) if is_absent(t) else t for p, t in zip(primals, tangents)]
    _, out = jax.jvp(lambda *a: forward(*a, **params), tuple(p.astype(_F32) for p in primals),
                     tuple(t.astype(_F32) for t in tangents))
    return (out.astype(primals[0].dtype),)

  return tangent


def _make(name, *, n_outputs, reference_fn, kernel=True, composite=None):
  def abstract_eval(*avals, **params):
    # Every operand but a zero tangent's placeholder is shaped like the first.
    return tuple(_like(avals[0]) for _ in range(n_outputs))

  return FfiPrimitive(
      name=name, target=name if kernel else None, abstract_eval=abstract_eval,
      reference=reference_fn, composite=composite,
      batch_rule=_elementwise_batch_rule, sharding=elementwise if kernel else None)


gelu_fwd_p = _make(
    "jaxops_gelu_fwd", n_outputs=1,
    reference_fn=lambda x, *, approximate: (reference.gelu(x, approximate),))
gelu_bwd_p = _make(
    "jaxops_gelu_bwd", n_outputs=1,
    reference_fn=_vjp_of(reference.gelu))
gelu_jvp_p = _make(
    "jaxops_gelu_jvp", n_outputs=1, kernel=False, reference_fn=_jvp_of(reference.gelu),
    composite=lambda x, dx, *, approximate: gelu_bwd_p(dx, x, approximate=approximate))
silu_fwd_p = _make(
    "jaxops_silu_fwd", n_outputs=1, reference_fn=lambda x: (reference.silu(x),))
silu_bwd_p = _make("jaxops_silu_bwd", n_outputs=1, reference_fn=_vjp_of(reference.silu))
silu_jvp_p = _make("jaxops_silu_jvp", n_outputs=1, kernel=False,
                   reference_fn=_jvp_of(reference.silu),
                   composite=lambda x, dx: silu_bwd_p(dx, x))
swiglu_fwd_p = _make(
    "jaxops_swiglu_fwd", n_outputs=1, reference_fn=lambda g, u: (reference.swiglu(g, u),))
swiglu_bwd_p = _make("jaxops_swiglu_bwd", n_outputs=2, reference_fn=_vjp_of(reference.swiglu))
swiglu_jvp_p = _make("jaxops_swiglu_jvp", n_outputs=1, kernel=False,
                     reference_fn=_jvp_of(reference.swiglu))
geglu_fwd_p = _make(
    "jaxops_geglu_fwd", n_outputs=1,
    reference_fn=lambda g, u, *, approximate: (reference.geglu(g, u, approximate),))
geglu_bwd_p = _make(
    "jaxops_geglu_bwd", n_outputs=2,
    reference_fn=_vjp_of(reference.geglu))
geglu_jvp_p = _make("jaxops_geglu_jvp", n_outputs=1, kernel=False,
                    reference_fn=_jvp_of(reference.geglu))


# -- differentiation: the backward kernels are the tangents' transposes --------------


def _transpose_to(bwd_p):
  def transpose(cotangents, saved, wanted, **params):
    return bwd_p(cotangents[0], *saved, **params)

  return transpose


for _fwd_p, _jvp_p, _bwd_p, _inputs, _name in (
    (gelu_fwd_p, gelu_jvp_p, gelu_bwd_p, (0,), "jaxops.gelu"),
    (silu_fwd_p, silu_jvp_p, silu_bwd_p, (0,), "jaxops.silu"),
    (swiglu_fwd_p, swiglu_jvp_p, swiglu_bwd_p, (0, 1), "jaxops.swiglu"),
    (geglu_fwd_p, geglu_jvp_p, geglu_bwd_p, (0, 1), "jaxops.geglu")):
  Differentiable(forward=_fwd_p, tangent=_jvp_p, transpose=_transpose_to(_bwd_p),
                 tangent_inputs=_inputs, saved_inputs=_inputs, checkpoint_name=_name)


# -- public functions --------------------------------------------------------------


def gelu(x, approximate: bool = True, *, implementation=None):
  """Gaussian error linear unit, elementwise: ``x * Phi(x)``.

  With ``approximate=True`` (the default, as in ``jax.nn.gelu``) Phi is the tanh
  approximation ``(1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2``; otherwise the
  exact normal CDF. Computed in float32, returned in ``x.dtype``; any shape. A
  drop-in for ``jax.nn.gelu`` (same values).

  Args:
    x: float32, bfloat16 or float16 (the kernel), or float64 (the jnp
      reference); complex too with ``approximate=True`` (the exact GELU uses
      erfc, which JAX has for real numbers only, as jax.nn.gelu).
    approximate: a Python bool.
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: ``x`` is not a floating-point array (complex with
      ``approximate=False``), ``approximate`` is not a bool, or
      ``implementation="ffi"`` has no kernel for ``x.dtype``.

  Examples:
    >>> jaxops.gelu(jnp.array([-1.0, 0.0, 1.0]))
    Array([-0.158..., 0. ..., 0.841...], dtype=float32)
  """
  op = "jaxops.gelu"
  approximate = validation.static_bool(op, "approximate", approximate)
  x = _activation_input(op, "x", x, approximate)
  if not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.gelu(x, approximate)
  return gelu_fwd_p(x, approximate=approximate)[0]


def silu(x, *, implementation=None):
  """SiLU (swish), elementwise: ``x * sigmoid(x)``; a drop-in for ``jax.nn.silu``.

  Computed in float32 and returned in ``x.dtype``; any shape.

  Args:
    x: as in :func:`gelu` (complex included).
    implementation: ``None``, ``"ffi"`` or ``"xla"``, as in :func:`gelu`.

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: ``x`` is not a floating-point array, or ``implementation="ffi"``
      has no kernel for ``x.dtype``.

  Examples:
    >>> jaxops.silu(jnp.array([-1.0, 0.0, 1.0]))
    Array([-0.268..., 0. ..., 0.731...], dtype=float32)
  """
  op = "jaxops.silu"
  x = _activation_input(op, "x", x, approximate=True)
  if not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.silu(x)
  return silu_fwd_p(x)[0]


def swiglu(gate, up, *, implementation=None):
  """The SwiGLU gate: ``silu(gate) * up``, elementwise.

  Computed in float32 and rounded once to the inputs' dtype; the backward
  produces both gradients in one pass.

  Args:
    gate: float array; dtypes as in :func:`gelu`.
    up: float array of ``gate``'s shape (no broadcasting). Of different dtypes
      they are promoted to their common one, as ``jax.nn.silu(gate) * up`` is.
    implementation: ``None``, ``"ffi"`` or ``"xla"``, as in :func:`gelu`.

  Returns:
    An array of ``gate``'s shape in the common dtype.

  Raises:
    TypeError: ``gate`` or ``up`` is not a floating-point array.
    ValueError: ``up``'s shape is not ``gate``'s.

  Examples:
    >>> jaxops.swiglu(jnp.array([1.0, 2.0]), jnp.array([2.0, 0.5]))
    Array([1.462..., 0.880...], dtype=float32)
  """
  op = "jaxops.swiglu"
  gate, up = _check_gated(op, gate, up, approximate=True)
  if not primitive.use_kernel(op, implementation, {"gate": gate.dtype}):
    return reference.swiglu(gate, up)
  return swiglu_fwd_p(gate, up)[0]


def geglu(gate, up, approximate: bool = True, *, implementation=None):
  """The GeGLU gate: ``gelu(gate, approximate) * up``, elementwise.

  As :func:`swiglu`, with the GELU of :func:`gelu` as the activation
  (``jax.nn.gelu(gate, approximate) * up``).

  Args:
    gate: float array; dtypes as in :func:`gelu`.
    up: float array of ``gate``'s shape, promoted with it to their common dtype.
    approximate: a Python bool: the tanh form (default) or the exact normal CDF.
    implementation: ``None``, ``"ffi"`` or ``"xla"``, as in :func:`gelu`.

  Returns:
    An array of ``gate``'s shape in the common dtype.

  Raises:
    TypeError: as :func:`swiglu`, or ``approximate`` is not a bool.
    ValueError: ``up``'s shape is not ``gate``'s.

  Examples:
    >>> jaxops.geglu(jnp.array([1.0, 2.0]), jnp.array([2.0, 0.5]))
    Array([1.682..., 0.977...], dtype=float32)
  """
  op = "jaxops.geglu"
  approximate = validation.static_bool(op, "approximate", approximate)
  gate, up = _check_gated(op, gate, up, approximate)
  if not primitive.use_kernel(op, implementation, {"gate": gate.dtype}):
    return reference.geglu(gate, up, approximate)
  return geglu_fwd_p(gate, up, approximate=approximate)[0]


# -- argument handling ---------------------------------------------------------------


def _activation_input(op, name, x, approximate):
  """A floating array, or a complex one where the activation has a complex
  form: SiLU and the tanh GELU; not the exact GELU (erfc is real only)."""
  x = validation.float_array(op, name, x, complex=True)
  if not approximate and jnp.iscomplexobj(x):
    raise validation.type_error(
        op, name, "have a floating dtype with approximate=False (the exact GELU uses erfc, "
        "which has no complex form; approximate=True accepts complex)", str(x.dtype))
  return x


def _check_gated(op, gate, up, approximate):
  """gate and up of one shape, promoted to their common dtype."""
  gate = _activation_input(op, "gate", gate, approximate)
  up = _activation_input(op, "up", up, approximate)
  common = jnp.promote_types(gate.dtype, up.dtype)
  gate, up = gate.astype(common), up.astype(common)
  validation.same_as(op, "up", up, "gate", gate)
  return gate, up
