"""Trace-time argument checks shared by the public ops.

Every public op validates its arguments before anything reaches a kernel, so a
bad call fails with a ValueError/TypeError that names the op and the argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def check_array(op: str, name: str, value):
  if not isinstance(value, _ARRAY_TYPES):
    raise TypeError(f"{op}: {name} must be an array, got {type(value).__name__}")
  return jnp.asarray(value)


def check_float_array(op: str, name: str, value, *, min_rank: int = 0,
                      non_empty_last_axis: bool = True):
  value = check_array(op, name, value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
        f"{op}: {name} must have a floating dtype (float32, bfloat16 or float16), "
        f"got {value.dtype}")
  if value.ndim < min_rank:
    raise ValueError(f"{op}: {name} must have rank >= {min_rank}, got shape {value.shape}")
  if non_empty_last_axis and value.ndim and value.shape[-1] == 0:
    raise ValueError(f"{op}: {name} must have a non-empty last axis, got shape {value.shape}")
  return value


def check_param_vector(op: str, name: str, value, x):
  """An optional per-feature parameter of x's last axis, cast to x's dtype."""
  if value is None:
    return None
  value = check_float_array(op, name, value)
  if value.shape != (x.shape[-1],):
    raise ValueError(
        f"{op}: {name} must have shape ({x.shape[-1]},) to match the last axis of x "
        f"{x.shape}, got {value.shape}")
  return value.astype(x.dtype)


def check_matching(op: str, name: str, value, x):
  """``value`` must have x's shape and dtype."""
  if value.shape != x.shape:
    raise ValueError(f"{op}: {name} must have the shape of x {x.shape}, got {value.shape}")
  if value.dtype != x.dtype:
    raise TypeError(f"{op}: {name} must have the dtype of x ({x.dtype}), got {value.dtype}")
  return value


def check_static_int(op: str, name: str, value) -> int:
  """A Python (or numpy) integer known at trace time; bools are refused."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{op}: {name} must be a Python int, got {type(value).__name__}")
  return int(value)


def check_static_float(op: str, name: str, value, *, low: float, high: float) -> float:
  """A Python (or numpy) real known at trace time, in [low, high]."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise TypeError(f"{op}: {name} must be a Python float, got {type(value).__name__}")
  value = float(value)
  if not low <= value <= high:
    raise ValueError(f"{op}: {name} must be in [{low}, {high}], got {value}")
  return value
