"""gelu, silu, swiglu and geglu: primitives and public functions.

Forward primitives return the activation; backward primitives take the output
cotangent and the saved inputs and return the input gradients, both of them in
one pass for the gated ops. The kernels see the operands as flat arrays, so any
shape works and vmap only has to line the batch axes up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import reference
from jaxops._src import primitive
from jaxops._src.checks import check_float_array
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front
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


def _make(name, *, n_outputs, reference_fn, attributes=None):
  def abstract_eval(*avals, **params):
    return tuple(_like(avals[-1]) for _ in range(n_outputs))

  return FfiPrimitive(
      name=name, target=name, abstract_eval=abstract_eval, reference=reference_fn,
      attributes=attributes or {}, batch_rule=_elementwise_batch_rule, sharding=elementwise)


_APPROXIMATE = {"approximate": np.bool_}

gelu_fwd_p = _make(
    "jaxops_gelu_fwd", n_outputs=1, attributes=_APPROXIMATE,
    reference_fn=lambda x, *, approximate: (reference.gelu(x, approximate),))
gelu_bwd_p = _make(
    "jaxops_gelu_bwd", n_outputs=1, attributes=_APPROXIMATE,
    reference_fn=_vjp_of(reference.gelu))
silu_fwd_p = _make(
    "jaxops_silu_fwd", n_outputs=1, reference_fn=lambda x: (reference.silu(x),))
silu_bwd_p = _make("jaxops_silu_bwd", n_outputs=1, reference_fn=_vjp_of(reference.silu))
swiglu_fwd_p = _make(
    "jaxops_swiglu_fwd", n_outputs=1, reference_fn=lambda g, u: (reference.swiglu(g, u),))
swiglu_bwd_p = _make("jaxops_swiglu_bwd", n_outputs=2, reference_fn=_vjp_of(reference.swiglu))
geglu_fwd_p = _make(
    "jaxops_geglu_fwd", n_outputs=1, attributes=_APPROXIMATE,
    reference_fn=lambda g, u, *, approximate: (reference.geglu(g, u, approximate),))
geglu_bwd_p = _make(
    "jaxops_geglu_bwd", n_outputs=2, attributes=_APPROXIMATE,
    reference_fn=_vjp_of(reference.geglu))


# -- custom VJPs: the backward kernel for first-order gradients --------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu_kernel(x, approximate):
  return gelu_fwd_p(x, approximate=approximate)[0]


def _gelu_kernel_fwd(x, approximate):
  return _gelu_kernel(x, approximate), x


def _gelu_kernel_bwd(approximate, x, dy):
  return gelu_bwd_p(dy, x, approximate=approximate)


_gelu_kernel.defvjp(_gelu_kernel_fwd, _gelu_kernel_bwd)


@jax.custom_vjp
def _silu_kernel(x):
  return silu_fwd_p(x)[0]


def _silu_kernel_fwd(x):
  return _silu_kernel(x), x


def _silu_kernel_bwd(x, dy):
  return silu_bwd_p(dy, x)


_silu_kernel.defvjp(_silu_kernel_fwd, _silu_kernel_bwd)


@jax.custom_vjp
def _swiglu_kernel(gate, up):
  return swiglu_fwd_p(gate, up)[0]


def _swiglu_kernel_fwd(gate, up):
  return _swiglu_kernel(gate, up), (gate, up)


def _swiglu_kernel_bwd(residuals, dy):
  return swiglu_bwd_p(dy, *residuals)


_swiglu_kernel.defvjp(_swiglu_kernel_fwd, _swiglu_kernel_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _geglu_kernel(gate, up, approximate):
  return geglu_fwd_p(gate, up, approximate=approximate)[0]


def _geglu_kernel_fwd(gate, up, approximate):
  return _geglu_kernel(gate, up, approximate), (gate, up)


def _geglu_kernel_bwd(approximate, residuals, dy):
  return geglu_bwd_p(dy, *residuals, approximate=approximate)


_geglu_kernel.defvjp(_geglu_kernel_fwd, _geglu_kernel_bwd)


# -- public functions --------------------------------------------------------------


def gelu(x, approximate: bool = True, *, implementation=None):
  """Gaussian error linear unit, elementwise: ``x * Phi(x)``.

  With ``approximate=True`` (the default, as in ``jax.nn.gelu``) Phi is the tanh
  approximation ``(1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2``; otherwise the
  exact normal CDF. Computed in float32, returned in ``x.dtype``; any shape.

  Args:
    x: float32, bfloat16 or float16 array.
    approximate: a Python bool.
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).
  """
  op = "jaxops.gelu"
  x = check_float_array(op, "x", x, non_empty_last_axis=False)
  approximate = _check_bool(op, "approximate", approximate)
  if not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.gelu(x, approximate)
  return _gelu_kernel(x, approximate)


def silu(x, *, implementation=None):
  """SiLU (swish), elementwise: ``x * sigmoid(x)``, in float32, returned in
  ``x.dtype``. ``implementation`` as in :func:`gelu`."""
  op = "jaxops.silu"
  x = check_float_array(op, "x", x, non_empty_last_axis=False)
  if not primitive.use_kernel(op, implementation, [x.dtype]):
    return reference.silu(x)
  return _silu_kernel(x)


def swiglu(gate, up, *, implementation=None):
  """The SwiGLU gate: ``silu(gate) * up``, elementwise.

  ``gate`` and ``up`` have one shape and dtype (no broadcasting). Computed in
  float32 and rounded once to the inputs' dtype; the backward produces both
  gradients in one pass. ``implementation`` as in :func:`gelu`.
  """
  op = "jaxops.swiglu"
  gate, up = _check_gated(op, gate, up)
  if not primitive.use_kernel(op, implementation, [gate.dtype]):
    return reference.swiglu(gate, up)
  return _swiglu_kernel(gate, up)


def geglu(gate, up, approximate: bool = True, *, implementation=None):
  """The GeGLU gate: ``gelu(gate, approximate) * up``, elementwise.

  As :func:`swiglu`, with the GELU of :func:`gelu` as the activation.
  """
  op = "jaxops.geglu"
  gate, up = _check_gated(op, gate, up)
  approximate = _check_bool(op, "approximate", approximate)
  if not primitive.use_kernel(op, implementation, [gate.dtype]):
    return reference.geglu(gate, up, approximate)
  return _geglu_kernel(gate, up, approximate)


# -- argument handling ---------------------------------------------------------------


def _check_gated(op, gate, up):
  gate = check_float_array(op, "gate", gate, non_empty_last_axis=False)
  up = check_float_array(op, "up", up, non_empty_last_axis=False)
  if up.shape != gate.shape:
    raise ValueError(f"{op}: up must have the shape of gate {gate.shape}, got {up.shape}")
  if up.dtype != gate.dtype:
    raise TypeError(f"{op}: up must have the dtype of gate ({gate.dtype}), got {up.dtype}")
  return gate, up


def _check_bool(op, name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be a Python bool, got {type(value).__name__}")
  return bool(value)
