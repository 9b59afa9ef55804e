"""Test kit for jaxops operators: tolerances, a readable closeness check, and the
checks every op's tests repeat (gradients against the reference, vmap).

``assert_close`` plays the role of an operator library's debug mode: on failure
it reports how many elements mismatch and which ones are worst, with the
actual and expected values and the tolerances in force.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Base (atol, rtol) per dtype for a result that involves no long reduction. A
# low-precision kernel computes in float32 and rounds once at the end, so its
# error is about one unit in the last place of the dtype, plus what a reference
# that itself ran in float32 differs by.
TOLERANCES = {
    jnp.dtype(jnp.float64): (1e-10, 1e-10),
    jnp.dtype(jnp.float32): (1e-5, 1e-5),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
    jnp.dtype(jnp.bfloat16): (1.6e-2, 1.6e-2),
}

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def tolerance(dtype, reduce_size: int = 1) -> tuple[float, float]:
  """(atol, rtol) for ``dtype``, grown with the length of the reduction.

  Rounding errors of a sum of n terms grow like sqrt(n) on average; the factor
  is 1 up to 16 terms.
  """
  atol, rtol = TOLERANCES[jnp.dtype(dtype)]
  scale = max(1.0, math.sqrt(reduce_size) / 4.0)
  return atol * scale, rtol * scale


def assert_close(actual, expected, *, dtype=None, atol: float | None = None,
                 rtol: float | None = None, reduce_size: int = 1, name: str = "",
                 worst: int = 8) -> None:
  """Asserts ``|actual - expected| <= atol + rtol * |expected|`` elementwise.

  Tolerances default to ``tolerance(dtype, reduce_size)`` with ``dtype`` the
  actual's dtype. NaNs must match NaNs and infinities must match exactly. On
  failure the message gives the mismatch count and ratio, the ``worst`` elements
  (index, actual, expected, delta) and the dtype and tolerances.
  """
  actual_np = np.asarray(actual)
  expected_np = np.asarray(expected)
  label = f"{name}: " if name else ""
  if actual_np.shape != expected_np.shape:
    raise AssertionError(f"{label}shape {actual_np.shape} != expected {expected_np.shape}")
  dtype = jnp.dtype(dtype if dtype is not None else jnp.asarray(actual).dtype)
  default_atol, default_rtol = tolerance(dtype, reduce_size) if dtype in TOLERANCES else (0.0, 0.0)
  atol = default_atol if atol is None else atol
  rtol = default_rtol if rtol is None else rtol

  a = actual_np.astype(np.float64)
  e = expected_np.astype(np.float64)
  both_nan = np.isnan(a) & np.isnan(e)
  same_inf = np.isinf(a) & np.isinf(e) & (a == e)
  with np.errstate(invalid="ignore"):
    delta = np.abs(a - e)
    ok = (delta <= atol + rtol * np.abs(e)) | both_nan | same_inf
  if ok.all():
    return
  bad = np.argwhere(~ok)
  excess = np.where(~ok, np.nan_to_num(delta, nan=np.inf) - rtol * np.abs(e), -np.inf)
  order = np.argsort(-excess, axis=None)[: min(worst, len(bad))]
  lines = [
      f"{label}{len(bad)} of {a.size} elements mismatch "
      f"({len(bad) / max(a.size, 1):.2%}); dtype {dtype}, atol={atol:.3g}, rtol={rtol:.3g}; "
      f"max |delta| = {np.nanmax(np.where(ok, 0, delta)):.6g}",
      "  index: actual vs expected (delta)",
  ]
  for flat in order:
    index = np.unravel_index(flat, a.shape) if a.ndim else ()
    lines.append(f"  {tuple(int(i) for i in index)}: {a[index]:.8g} vs {e[index]:.8g} "
                 f"({delta[index]:.3g})")
  raise AssertionError("\n".join(lines))


def assert_tree_close(actual, expected, **kwargs) -> None:
  """``assert_close`` over matching pytrees, naming each leaf by its path."""
  name = kwargs.pop("name", "")
  actual_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
  expected_leaves, _ = jax.tree_util.tree_flatten(expected)
  if len(actual_leaves) != len(expected_leaves):
    raise AssertionError(f"{name}: {len(actual_leaves)} leaves != expected {len(expected_leaves)}")
  for (path, a), e in zip(actual_leaves, expected_leaves):
    assert_close(a, e, name=f"{name}{jax.tree_util.keystr(path)}", **kwargs)


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


# -- inputs ----------------------------------------------------------------------


def random_normal(key, shape, dtype=jnp.float32, scale: float = 1.0, offset: float = 0.0):
  """Normal samples generated in float32 and rounded to ``dtype``."""
  return (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_inputs(seed: int, shapes: Sequence[tuple], dtype=jnp.float32, **kwargs):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [random_normal(k, s, dtype, **kwargs) for k, s in zip(keys, shapes)]


def upcast(tree, dtype=jnp.float32):
  """Floating leaves cast to ``dtype`` (for running the reference in float32)."""
  return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


# -- transformation checks --------------------------------------------------------


def vjp_against_reference(fn: Callable, reference: Callable, args: Sequence, *, seed: int = 0,
                          argnums: Sequence[int] | None = None, **close_kwargs):
  """Compares ``jax.vjp`` of ``fn`` and ``reference`` at ``args`` for a random cotangent.

  The reference runs on float32 copies of the arguments, so a low-precision
  kernel is checked against the exact gradient rather than against another
  low-precision computation. Returns (fn's outputs, fn's input gradients).
  """
  argnums = tuple(range(len(args))) if argnums is None else tuple(argnums)

  def restrict(f, cast):
    def g(*diff):
      full = list(args if not cast else upcast(list(args)))
      for i, d in zip(argnums, diff):
        full[i] = d
      return f(*full)
    return g

  diff_args = [args[i] for i in argnums]
  out, vjp = jax.vjp(restrict(fn, False), *diff_args)
  ref_out, ref_vjp = jax.vjp(restrict(reference, True), *upcast(diff_args))
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(out))))
  cotangent = jax.tree.map(lambda o: random_normal(next(keys), o.shape, o.dtype), out)
  grads = vjp(cotangent)
  ref_grads = ref_vjp(upcast(cotangent))
  assert_tree_close(out, ref_out, name="outputs", **close_kwargs)
  assert_tree_close(grads, ref_grads, name="vjp", **close_kwargs)
  return out, grads


def vmap_against_loop(fn: Callable, args: Sequence, in_axes, **close_kwargs):
  """``jax.vmap(fn, in_axes)`` equals applying ``fn`` to each slice in turn."""
  in_axes = tuple(in_axes) if isinstance(in_axes, (list, tuple)) else (in_axes,) * len(args)
  size = next(a.shape[ax] for a, ax in zip(args, in_axes) if ax is not None)
  batched = jax.vmap(fn, in_axes=in_axes)(*args)
  slices = []
  for i in range(size):
    slice_args = [a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes)]
    slices.append(fn(*slice_args))
  looped = jax.tree.map(lambda *xs: jnp.stack(xs), *slices)
  assert_tree_close(batched, looped, name=f"vmap(in_axes={in_axes})", **close_kwargs)
  return batched
