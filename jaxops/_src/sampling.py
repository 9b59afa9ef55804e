"""sample: draw one token per row of logits (temperature, top-k, top-p, min-p).

The randomness is one uniform per row, drawn here from the caller's key with
``jax.random.uniform`` and handed to the kernel as an operand: the kernel and
the jnp reference (``implementation="xla"``) compute the same arithmetic on the
same uniforms, so they return the same tokens for the same key. Every
parameter (temperature, top_k, top_p, min_p) is a per-row operand, so changing
it never recompiles.

The output is integer: the op is not differentiable, its JVP gives float0
tangents (``autodiff.not_differentiable``). vmap folds the mapped axis into
the rows; on a mesh the rows shard and the vocabulary stays whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import not_differentiable
from jaxops._src.primitive import FfiPrimitive, batch_to_front
from jaxops._src.sharding import leading_axes


def _sample_batch_rule(prim, args, dims):
  """The vmapped axis becomes more rows: [n, batch, ...] -> [n * batch, ...]."""
  args, size = batch_to_front(args, dims, (0, 1, 2))
  (tokens,) = prim(*(a.reshape(size * a.shape[1], *a.shape[2:]) for a in args))
  return (tokens.reshape(size, -1),), (0,)


# A row's float parameters, packed in one [batch, 4] operand in the order of
# params/sampling.h (RowFloat); top_k is an int32 [batch] operand.
def _pack_row_floats(uniforms, temperature, top_p, min_p):
  return jnp.stack([uniforms, temperature, top_p, min_p], axis=-1)


def _sample_reference(logits, row_floats, top_k):
  uniforms, temperature, top_p, min_p = (row_floats[:, i] for i in range(4))
  return (reference.sample_with_uniforms(logits, uniforms, temperature, top_k, top_p, min_p),)


sample_p = FfiPrimitive(
    name="jaxops_sample", target="jaxops_sample",
    abstract_eval=lambda logits, row_floats, top_k: (
        jax.core.ShapedArray(logits.shape[:1], jnp.int32),),
    reference=_sample_reference,
    batch_rule=_sample_batch_rule,
    # Rows shard with their parameters; the vocabulary stays whole.
    sharding=leading_axes("xxs -> s"))

not_differentiable(sample_p)


def _is_key(key) -> bool:
  if not isinstance(key, (jax.Array, np.ndarray)):
    return False
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.shape == ()
  # A raw (legacy) threefry key: uint32[2].
  return key.dtype == jnp.uint32 and key.shape == (2,)


def _row_param(op, name, value, batch, dtype, check_static):
  """A Python scalar (checked here) or an array of shape () or [batch]
  (traced values are clamped by the kernel), as ``dtype`` [batch]."""
  if isinstance(value, (jax.Array, np.ndarray)):
    is_int = jnp.issubdtype(dtype, jnp.integer)
    array = (validation.integer_array if is_int else validation.float_array)(op, name, value)
    validation.shape(op, name, array, (), (batch,))
    return jnp.broadcast_to(array.astype(dtype), (batch,))
  return jnp.full((batch,), check_static(value), dtype)


def sample(key, logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None,
           implementation=None):
  """Draws one token id per row of ``logits`` [batch, vocab]: int32 [batch].

  Per row, in this order: the logits are divided by ``temperature``; the
  ``top_k`` most likely tokens are kept (ties: lower index first, as
  ``lax.top_k``); of those, the shortest run of most likely tokens whose
  probability, renormalised over the top-k, reaches ``top_p``; of those, the
  tokens with probability >= ``min_p`` times the largest. A token outside the
  kept set is never returned. The draw is the inverse CDF of the kept tokens'
  renormalised probabilities, in index order, at one uniform per row from
  ``jax.random.uniform(key, (batch,))``; the kernel and the jnp reference
  (``implementation="xla"``) return the same tokens for the same key, except
  where the uniform or the top-p mass falls within a rounding error of a
  boundary between two tokens (measure zero: their sums are added in
  different orders).

  Temperature 0 is greedy: the argmax (lowest index on ties). ``+inf``
  logits share the whole mass equally. A row containing a NaN logit, or whose
  logits are all ``-inf``, returns -1: a serving loop can detect the broken row
  (a token sampled from it would be meaningless).

  Every parameter is a Python scalar, checked here, or an array of shape ()
  or [batch] (one per row), passed to the kernel as an operand: changing it
  never recompiles. Array values are not checked but clamped in the kernel and
  the reference alike: temperature NaN or <= 0 is greedy; top_k <= 0 or >=
  vocab keeps everything; top_p NaN or >= 1 is off, <= 0 keeps the most likely
  token; min_p NaN is 0, and it is clipped to [0, 1].

  Not differentiable (integer result): ``jax.grad``/``jax.jvp`` of code around
  it see a zero (float0) tangent.

  Args:
    key: a PRNG key (``jax.random.key``; a legacy uint32[2] key is accepted).
    logits: [batch, vocab], vocab >= 1: float32, bfloat16 or float16 (the
      kernel), or float64 (the jnp reference).
    temperature: >= 0; 0 is greedy.
    top_k: int; None, <= 0 or >= vocab: no top-k filter.
    top_p: in (0, 1]; None or 1: no top-p filter.
    min_p: in [0, 1]; None or 0: no min-p filter.
    implementation: ``None`` (kernel where available, else the jnp
      reference), ``"ffi"`` (the kernel, or an error) or ``"xla"`` (reference).

  Returns:
    int32 ``[batch]``: one token per row, or -1 for a row with a NaN logit or
    whose logits are all -inf.

  Raises:
    TypeError: ``logits`` is not a floating-point array, ``key`` is not a PRNG
      key, or a parameter has the wrong type.
    ValueError: ``logits`` is not ``[batch, vocab]`` with ``vocab >= 1``, or a
      Python-scalar parameter is out of range or an array parameter is not of
      shape ``()`` or ``[batch]``.

  Examples:
    >>> logits = jnp.array([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
    >>> jaxops.sample(jax.random.key(0), logits, temperature=0.0)     # greedy
    Array([1, 0], dtype=int32)
    >>> jaxops.sample(jax.random.key(0), logits, top_k=1)             # top-1 is greedy too
    Array([1, 0], dtype=int32)
  """
  op = "jaxops.sample"
  if not _is_key(key):
    raise validation.type_error(op, "key", "be a PRNG key (jax.random.key, or a uint32[2] "
                                "legacy key)", validation.describe(key))
  logits = validation.float_array(op, "logits", logits)
  validation.rank(op, "logits", logits, low=2, high=2, labels="[batch, vocab]")
  validation.non_empty_axis(op, "logits", logits)
  batch, vocab = logits.shape
  temperature = _row_param(op, "temperature", temperature, batch, jnp.float32,
                           lambda v: validation.static_float(op, "temperature", v, low=0))
  static_top_k = None
  if top_k is None:
    top_k = 0
  elif not isinstance(top_k, (jax.Array, np.ndarray)):
    top_k = validation.static_int(op, "top_k", top_k, bits=32)
    static_top_k = top_k if 0 < top_k < vocab else None
  top_k = _row_param(op, "top_k", top_k, batch, jnp.int32, lambda v: v)
  top_p = _row_param(op, "top_p", 1.0 if top_p is None else top_p, batch, jnp.float32,
                     lambda v: validation.static_float(op, "top_p", v, low=0, high=1,
                                                       low_open=True))
  min_p = _row_param(op, "min_p", 0.0 if min_p is None else min_p, batch, jnp.float32,
                     lambda v: validation.static_float(op, "min_p", v, low=0, high=1))
  uniforms = jax.random.uniform(key, (batch,), jnp.float32)
  if not primitive.use_kernel(op, implementation, {"logits": logits.dtype}):
    return reference.sample_with_uniforms(logits, uniforms, temperature, top_k, top_p, min_p,
                                          static_top_k=static_top_k)
  return sample_p(logits, _pack_row_floats(uniforms, temperature, top_p, min_p), top_k)[0]
