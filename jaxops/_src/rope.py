"""rope (rotary position embedding): primitive and public function.

One primitive serves both directions: the rotation is orthogonal, so the
backward is the same kernel rotating by minus the angle (``inverse=True``).
The rotation is linear in x, so the primitive is its own tangent primitive
(forward mode rotates the tangent) and the inverse rotation is its transpose.
Positions are an int32 operand (they may be traced), shaped [1, seq] (shared
by the batch) or [batch, seq]; the kernel builds its cos/sin table for those
rows into a hidden workspace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, batch_to_front
from jaxops._src.sharding import Factors

_STYLES = ("neox", "gptj")


def _rope_reference(x, positions, *, theta, rotary_dim, interleaved, inverse):
  return (reference.rope(x, positions, theta=theta, style="gptj" if interleaved else "neox",
                         rotary_dim=rotary_dim, inverse=inverse),)


def _rope_batch_rule(prim, args, dims, **params):
  """The vmapped axis joins the batch axis: x [V, B, ...] -> [V * B, ...], with
  the positions repeated (or, when they are batched, laid out) to match."""
  x, positions = args
  x_dim, positions_dim = dims
  size = x.shape[x_dim] if x_dim is not NOT_MAPPED else positions.shape[positions_dim]
  if positions_dim is NOT_MAPPED and positions.shape[0] == 1:
    x = jnp.moveaxis(x, x_dim, 0)
    batch = x.shape[1]
    y = prim(x.reshape(size * batch, *x.shape[2:]), positions, **params)[0]
    return (y.reshape(size, batch, *y.shape[1:]),), (0,)
  (x, positions), _ = batch_to_front(args, dims, (0, 1))
  batch = x.shape[1]
  positions = jnp.broadcast_to(positions, (size, batch, positions.shape[-1]))
  y = prim(x.reshape(size * batch, *x.shape[2:]),
           positions.reshape(size * batch, positions.shape[-1]), **params)[0]
  return (y.reshape(size, batch, *y.shape[1:]),), (0,)


def _rope_sharding(avals_in, avals_out, **params):
  """Batch, sequence and heads shard; head_dim stays whole. The positions shard
  with x's batch and sequence axes, so each shard rotates by its own positions."""
  x, positions = avals_in
  x_dims = ("batch", "seq", "heads", None)
  batch = "batch" if positions.shape[0] == x.shape[0] else None
  return Factors([x_dims, (batch, "seq")], [x_dims])


rope_p = FfiPrimitive(
    name="jaxops_rope", target="jaxops_rope",
    abstract_eval=lambda x, positions, **params: (jax.core.ShapedArray(x.shape, x.dtype),),
    reference=_rope_reference,
    batch_rule=_rope_batch_rule,
    sharding=_rope_sharding)


def _rope_transpose(cotangents, saved, wanted, *, inverse, **params):
  (dy,), (positions,) = cotangents, saved
  return rope_p(dy, positions, inverse=not inverse, **params)


Differentiable(forward=rope_p, transpose=_rope_transpose, tangent_inputs=(0,),
               checkpoint_name="jaxops.rope")


def rope(x, positions, *, theta: float = 10000.0, style: str = "neox",
         rotary_dim: int | None = None, implementation=None):
  """Rotary position embedding of queries or keys.

  Each pair of features of the first ``rotary_dim`` features of every head is
  rotated by ``position * theta**(-2i / rotary_dim)`` (pair i); the remaining
  features pass through unchanged. Angles are float32 (the product of the
  float32 position and the float32 frequency), the rotation is computed in
  float32 and the result returned in ``x.dtype``.

  Args:
    x: [batch, seq, heads, head_dim]: float32, bfloat16 or float16 (the
      kernel), or float64 or complex (the jnp reference, in float64 for
      float64 and complex128; the rotation is real-linear, so complex x
      rotates its real and imaginary parts alike).
    positions: integer array [seq] (shared by the batch) or [batch, seq]; may
      be traced. Values must fit in int32 (and are exact as float32 below 2^24).
    theta: the base of the frequencies, a Python float > 0.
    style: ``"neox"`` (GPT-NeoX, Llama: pairs ``(i, i + rotary_dim/2)``, the
      halves rotated against each other) or ``"gptj"`` (GPT-J: interleaved
      pairs ``(2i, 2i + 1)``).
    rotary_dim: how many leading features of each head rotate: even, in
      ``[2, head_dim]``; ``None`` means all (``head_dim`` must then be even).
    implementation: ``None`` (fused kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  The gradient w.r.t. ``x`` is the inverse rotation of the cotangent; positions
  get no gradient.

  Returns:
    An array shaped and typed like ``x``.

  Raises:
    TypeError: ``x`` is not a floating-point array, ``positions`` is not an
      integer array, or ``theta``/``rotary_dim`` have the wrong type.
    ValueError: ``x`` is not of rank 4, ``positions`` is not ``[seq]`` or
      ``[batch, seq]``, ``theta`` <= 0, ``style`` is unknown, or ``rotary_dim``
      is odd or out of range.

  Examples:
    >>> x = jnp.ones((1, 2, 1, 4))                # [batch, seq, heads, head_dim]
    >>> jaxops.rope(x, jnp.array([0, 1]))[0, :, 0]
    Array([[ 1. ...,  1. ...,  1. ...,  1. ...],
           [-0.301...,  0.98...,  1.381...,  1.009...]], dtype=float32)
  """
  op = "jaxops.rope"
  x = validation.float_array(op, "x", x, complex=True)
  validation.rank(op, "x", x, low=4, high=4, labels="[batch, seq, heads, head_dim]")
  positions = validation.integer_array(op, "positions", positions)
  validation.shape(op, "positions", positions, x.shape[1:2], x.shape[:2],
                   of="x's [seq] or [batch, seq]")
  positions = positions.astype(jnp.int32)
  theta = validation.static_float(op, "theta", theta, low=0.0, low_open=True)
  style = validation.choice(op, "style", style, _STYLES)
  rotary_dim = _check_rotary_dim(op, rotary_dim, x.shape[-1])
  if not primitive.use_kernel(op, implementation, {"x": x.dtype}):
    return reference.rope(x, positions, theta=theta, style=style, rotary_dim=rotary_dim)
  if positions.ndim == 1:
    positions = positions[None]
  return rope_p(x, positions, theta=theta, rotary_dim=rotary_dim, interleaved=style == "gptj",
                inverse=False)[0]


# -- argument handling ---------------------------------------------------------------


def _check_rotary_dim(op, rotary_dim, head_dim):
  """An even int in [2, head_dim]; None means head_dim, which must then be one."""
  expected = f"be an even int in [2, head_dim = {head_dim}]"
  if rotary_dim is None:
    if head_dim < 2 or head_dim % 2:
      raise validation.value_error(
          op, "rotary_dim", expected + " (None rotates all head_dim features, which must then "
          "be even)", "None")
    return head_dim
  rotary_dim = validation.static_int(op, "rotary_dim", rotary_dim)
  if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
    raise validation.value_error(op, "rotary_dim", expected, str(rotary_dim))
  return rotary_dim
