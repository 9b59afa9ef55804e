"""Trace-time argument rules shared by every public op, one rule per kind of argument.

Every public function (and every Flax wrapper, for the arguments it passes
through) checks its arguments here, in Python, before a primitive is bound: a
bad call fails with an exception that names the op and the argument, never
inside a kernel. One message style::

    <op>: <argument> must <be/have what is expected>, got <what was passed>

``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong value or
shape. The rules:

- arrays: :func:`array` accepts a ``jax.Array`` (traced or not), a NumPy array
  or a NumPy scalar; not lists or Python numbers (an op never guesses a dtype).
  :func:`float_array`, :func:`integer_array` and :func:`bool_array` also check
  the dtype (any floating dtype, and any complex one for the ops whose math
  has a complex form, unless ``dtypes`` names the allowed ones).
- static scalars (known at trace time; a traced value is refused with a
  ``TypeError``): :func:`static_float` takes a Python or NumPy real number
  (ints included), finite, within optional bounds whose open or closed ends the
  message states; :func:`static_int` a Python or NumPy integer that fits in
  int64 (or ``bits``), with :func:`positive_int` / :func:`non_negative_int`;
  :func:`static_bool` a Python or NumPy bool. ``bool`` is not a number here
  (``epsilon=True`` is a TypeError) and strings are never numbers.
- :func:`int_scalar`: a Python int or an integer scalar array, which may be
  traced (attention's ``query_offset``).
- :func:`axis`: a static int in ``[-ndim, ndim)``, returned normalised.
- :func:`choice`: one of a few values (strings, or None); anything else is a
  ``ValueError`` whatever its type, since the value is what is wrong.
- shapes: :func:`rank`, :func:`shape` (one of the allowed shapes),
  :func:`same_as` (another array's shape and dtype), :func:`broadcastable`
  (to a shape, NumPy rules) and :func:`non_empty_axis`.

A rule that one op alone needs (attention's window pair, rope's even
``rotary_dim``) is written in the op from these rules and
:func:`type_error` / :func:`value_error`, which give the same message style.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_ARRAY_TYPES = (jax.Array, np.ndarray)
_INTEGERS = (int, np.integer)
_REALS = (int, float, np.integer, np.floating)
_BOOLS = (bool, np.bool_)


# -- the message style ---------------------------------------------------------------


def type_error(op: str, name: str, expected: str, actual: str) -> TypeError:
  """``expected`` starts with its verb ("be a Python int", "have dtype bool")."""
  return TypeError(f"{op}: {name} must {expected}, got {actual}")


def value_error(op: str, name: str, expected: str, actual: str) -> ValueError:
  return ValueError(f"{op}: {name} must {expected}, got {actual}")


def describe(value: Any) -> str:
  """What the caller passed, as the ``got ...`` part of a message: the type,
  and the value when it is short (``bool True`` and ``int 1`` differ)."""
  if isinstance(value, jax.core.Tracer):
    return f"a traced {value.aval.str_short()}"
  if isinstance(value, _ARRAY_TYPES):
    return f"an array {value.dtype}{list(value.shape)}"
  if value is None or isinstance(value, (bool, int, float, str, np.generic)):
    text = repr(value.item() if isinstance(value, np.generic) else value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return text if value is None else f"{type(value).__name__} {text}"
  return type(value).__name__


def _number(value) -> str:
  return repr(float(value)) if isinstance(value, float) else str(value)


def _interval(low, high, low_open: bool, high_open: bool) -> str:
  """'in [0.0, 1.0)', '> 0.0', '<= 1' ..., or '' without bounds."""
  if low is not None and high is not None:
    return (f"in {'(' if low_open else '['}{_number(low)}, {_number(high)}"
            f"{')' if high_open else ']'}")
  if low is not None:
    return f"{'>' if low_open else '>='} {_number(low)}"
  if high is not None:
    return f"{'<' if high_open else '<='} {_number(high)}"
  return ""


def _inside(value, low, high, low_open: bool, high_open: bool) -> bool:
  above = low is None or (value > low if low_open else value >= low)
  below = high is None or (value < high if high_open else value <= high)
  return above and below


# -- arrays and dtypes ---------------------------------------------------------------


def array(op: str, name: str, value, *, dtypes=None, expected: str | None = None) -> jax.Array:
  """An array; with ``dtypes`` (a JAX dtype category such as ``jnp.floating``,
  or a sequence of dtypes) its dtype must be one of them. ``expected`` words
  the dtype requirement for the message."""
  if not _is_array(value):
    raise type_error(op, name, "be an array", describe(value))
  value = jnp.asarray(value)
  if dtypes is not None and not _dtype_in(value.dtype, dtypes):
    raise type_error(op, name, expected or f"have dtype {_dtype_names(dtypes)}", str(value.dtype))
  return value


def _is_array(value) -> bool:
  if isinstance(value, jax.Array):
    return True
  if not isinstance(value, (np.ndarray, np.generic)):
    return False
  # Numbers (bfloat16 included) and bools: JAX has no strings, objects or dates.
  return value.dtype == np.bool_ or jnp.issubdtype(value.dtype, jnp.number)


def _dtype_in(dtype, dtypes) -> bool:
  if isinstance(dtypes, type):  # a category: jnp.floating, jnp.integer
    return jnp.issubdtype(dtype, dtypes)
  return any(jnp.dtype(dtype) == jnp.dtype(d) for d in dtypes)


def _dtype_names(dtypes) -> str:
  names = [str(jnp.dtype(d)) for d in dtypes]
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def float_array(op: str, name: str, value, *, dtypes: Sequence[Any] | None = None,
                complex: bool = False):
  """A floating-point array: any floating dtype (or complex one too, with
  ``complex``), or one of ``dtypes``."""
  if dtypes is not None:
    return array(op, name, value, dtypes=dtypes)
  if complex:
    return array(op, name, value, dtypes=jnp.inexact,
                 expected="have a floating or complex dtype")
  return array(op, name, value, dtypes=jnp.floating, expected="have a floating dtype")


def integer_array(op: str, name: str, value):
  return array(op, name, value, dtypes=jnp.integer, expected="have an integer dtype")


def bool_array(op: str, name: str, value):
  return array(op, name, value, dtypes=(jnp.bool_,))


def floating_dtype(op: str, name: str, dtype) -> None:
  """For values that need not be arrays (an optimizer's pytree leaves)."""
  if not jnp.issubdtype(dtype, jnp.floating):
    raise type_error(op, name, "have a floating dtype", str(jnp.dtype(dtype)))


# -- static scalars ------------------------------------------------------------------


def static_float(op: str, name: str, value, *, low=None, high=None, low_open: bool = False,
                 high_open: bool = False) -> float:
  """A finite real number known at trace time, optionally in a range."""
  if isinstance(value, _BOOLS) or not isinstance(value, _REALS):
    raise type_error(op, name, "be a Python float or int", describe(value))
  value = float(value)
  if not math.isfinite(value):
    raise value_error(op, name, "be finite", _number(value))
  if not _inside(value, low, high, low_open, high_open):
    raise value_error(op, name, "be " + _interval(low, high, low_open, high_open), _number(value))
  return value


def static_int(op: str, name: str, value, *, low=None, high=None, bits: int = 64) -> int:
  """An integer known at trace time, in the closed range [low, high] and in
  the ``bits``-bit signed range the kernels' attributes hold."""
  if isinstance(value, _BOOLS) or not isinstance(value, _INTEGERS):
    raise type_error(op, name, "be a Python int", describe(value))
  value = int(value)
  if not -2**(bits - 1) <= value < 2**(bits - 1):
    raise value_error(op, name, f"fit in int{bits}", str(value))
  if not _inside(value, low, high, False, False):
    raise value_error(op, name, "be " + _interval(low, high, False, False), str(value))
  return value


def positive_int(op: str, name: str, value) -> int:
  return static_int(op, name, value, low=1)


def non_negative_int(op: str, name: str, value) -> int:
  return static_int(op, name, value, low=0)


def static_bool(op: str, name: str, value) -> bool:
  if not isinstance(value, _BOOLS):
    raise type_error(op, name, "be a Python bool", describe(value))
  return bool(value)


def int_scalar(op: str, name: str, value, *, bits: int = 32) -> jax.Array:
  """A Python int (static) or an integer scalar array (which may be traced),
  returned as an int{bits} scalar array."""
  target = jnp.dtype(f"int{bits}")
  if isinstance(value, _INTEGERS) and not isinstance(value, _BOOLS):
    return jnp.asarray(static_int(op, name, value, bits=bits), target)
  expected = "be a Python int or an integer scalar array"
  if not isinstance(value, _ARRAY_TYPES) or not jnp.issubdtype(value.dtype, jnp.integer):
    raise type_error(op, name, expected, describe(value))
  if value.shape != ():
    raise value_error(op, name, expected, f"shape {value.shape}")
  return jnp.asarray(value).astype(target)


def axis(op: str, name: str, value, ndim: int) -> int:
  """An axis of an array of rank ``ndim``, returned in [0, ndim)."""
  value = static_int(op, name, value)
  if not -ndim <= value < ndim:
    raise value_error(op, name, f"be an axis of a rank-{ndim} array, in [{-ndim}, {ndim - 1}]",
                      str(value))
  return value % ndim


def choice(op: str, name: str, value, choices: Sequence[Any]):
  """One of ``choices`` (strings, or None where None means a default)."""
  if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
    listed = ", ".join(repr(c) for c in choices)
    raise value_error(op, name, f"be one of {listed}", describe(value))
  return value if value is None else str(value)


# -- shapes --------------------------------------------------------------------------


def rank(op: str, name: str, value, *, low: int | None = None, high: int | None = None,
         labels: str = "") -> None:
  """``low <= value.ndim <= high``; ``labels`` names the axes ("[B, T, N, H]")."""
  if not _inside(value.ndim, low, high, False, False):
    expected = f"rank {low}" if low == high else "rank " + _interval(low, high, False, False)
    raise value_error(op, name, f"have {expected}{': ' + labels if labels else ''}",
                      f"shape {value.shape}")


def non_empty_axis(op: str, name: str, value, axis_index: int = -1) -> None:
  if value.ndim and value.shape[axis_index] == 0:
    where = "last axis" if axis_index == -1 else f"axis {axis_index}"
    raise value_error(op, name, f"have a non-empty {where}", f"shape {value.shape}")


def shape(op: str, name: str, value, *allowed: Sequence[int], of: str = "") -> None:
  """``value`` has one of the ``allowed`` shapes; ``of`` says where they come
  from ("logits.shape[:-1]"). Works on anything ``np.shape`` measures."""
  actual = tuple(np.shape(value))
  allowed = [tuple(s) for s in allowed]
  if actual not in allowed:
    listed = " or ".join(str(s) for s in allowed)
    raise value_error(op, name, f"have shape {of + ' = ' if of else ''}{listed}",
                      f"{actual}")


def same_as(op: str, name: str, value, other_name: str, other) -> None:
  """``value`` has the shape and the dtype of ``other`` (no broadcasting, no promotion)."""
  if value.shape != other.shape:
    raise value_error(op, name, f"have the shape of {other_name} {other.shape}", str(value.shape))
  if value.dtype != other.dtype:
    raise type_error(op, name, f"have the dtype of {other_name} ({other.dtype})", str(value.dtype))


def broadcastable(op: str, name: str, value, target: Sequence[int], *, of: str) -> None:
  """``value`` broadcasts to ``target`` without changing it (NumPy rules: no
  more axes than the target, each trailing axis 1 or the target's extent)."""
  target = tuple(target)
  try:
    fits = np.broadcast_shapes(value.shape, target) == target
  except ValueError:
    fits = False
  if not fits:
    raise value_error(op, name, f"be broadcastable to {of} {target}", f"shape {value.shape}")
