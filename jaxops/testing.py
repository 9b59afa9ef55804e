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
# that itself ran in float32 differs by. The references here run at JAX's
# default matmul precision, and on a GPU that is TF32 (errors ~1e-3): compare
# float32 results under ``jax.default_matmul_precision("highest")``, as
# jaxops' test suite does throughout (tests/conftest.py).
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

  Args:
    dtype: a float dtype of :data:`TOLERANCES`.
    reduce_size: the number of terms each result sums.

  Returns:
    ``(atol, rtol)``.

  Examples:
    >>> jaxops.testing.tolerance(jnp.bfloat16)
    (0.016, 0.016)
    >>> jaxops.testing.tolerance(jnp.float32, reduce_size=1024)
    (8e-05, 8e-05)
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

  Args:
    actual: an array (anything ``np.asarray`` takes).
    expected: an array of ``actual``'s shape.
    dtype: the dtype whose tolerances apply; default: the actual's.
    atol: absolute tolerance, overriding the dtype's.
    rtol: relative tolerance, overriding the dtype's.
    reduce_size: the reduction length the tolerances grow with (:func:`tolerance`).
    name: a label for the message.
    worst: how many of the worst elements the message lists.

  Raises:
    AssertionError: the shapes differ or an element is out of tolerance.

  Examples:
    >>> jaxops.testing.assert_close(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0 + 1e-6]))
    >>> jaxops.testing.assert_close(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.5]), name="y")
    Traceback (most recent call last):
    ...
    AssertionError: y: 1 of 2 elements mismatch (50.00%); dtype float32, atol=1e-05, rtol=1e-05; ...
      index: actual vs expected (delta)
      (1,): 2 vs 2.5 (0.5)
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
  """``assert_close`` over matching pytrees, naming each leaf by its path.

  Args:
    actual: a pytree of arrays.
    expected: a pytree of ``actual``'s structure.
    **kwargs: as :func:`assert_close`'s.

  Raises:
    AssertionError: the structures differ or a leaf is out of tolerance.
  """
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


def _generator(key) -> np.random.Generator:
  """A NumPy generator: ``key`` itself, or one seeded by an int or a JAX PRNG key's data."""
  if isinstance(key, np.random.Generator):
    return key
  if isinstance(key, (int, np.integer)):
    return np.random.default_rng(int(key))
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  return np.random.default_rng(np.asarray(data).astype(np.uint64).ravel())


def random_normal(key, shape, dtype=jnp.float32, scale: float = 1.0, offset: float = 0.0):
  """Normal samples generated in float32 and rounded to ``dtype``.

  Drawn and rounded on the host with NumPy (ml_dtypes rounds to nearest even, as
  XLA does), seeded by ``key``: an int, a JAX PRNG key or a NumPy generator. The
  tests need thousands of inputs of hundreds of shapes, and eager ``jax.random``
  compiles a program per shape: that was a fifth of an op test's time.

  Args:
    key: an int seed, a JAX PRNG key or a ``np.random.Generator``.
    shape: the shape.
    dtype: the dtype of the result.
    scale: the standard deviation.
    offset: the mean.

  Returns:
    A ``jax.Array`` of ``shape`` and ``dtype``.

  Examples:
    >>> x = jaxops.testing.random_normal(0, (2, 3), jnp.bfloat16)
    >>> x.shape, x.dtype
    ((2, 3), dtype(bfloat16))
  """
  sample = _generator(key).standard_normal(tuple(shape), dtype=np.float32)
  sample = np.float32(offset) + np.float32(scale) * sample
  return jnp.asarray(sample.astype(jnp.dtype(dtype)))


def random_inputs(seed: int, shapes: Sequence[tuple], dtype=jnp.float32, **kwargs):
  """Normal inputs of several shapes from one seed.

  Args:
    seed: an int.
    shapes: one shape per input.
    dtype: the inputs' dtype.
    **kwargs: ``scale`` and ``offset``, as :func:`random_normal`'s.

  Returns:
    A list of arrays, one per shape, from independent generators.
  """
  generators = np.random.default_rng(seed).spawn(len(shapes))
  return [random_normal(g, s, dtype, **kwargs) for g, s in zip(generators, shapes)]


def upcast(tree, dtype=jnp.float32):
  """Floating leaves cast to ``dtype`` (for running the reference in float32).

  Args:
    tree: a pytree.
    dtype: the float dtype to cast to.

  Returns:
    ``tree`` with its floating leaves cast (integer and boolean leaves unchanged).
  """
  return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


# -- transformation checks --------------------------------------------------------


def vjp_against_reference(fn: Callable, reference: Callable, args: Sequence, *, seed: int = 0,
                          argnums: Sequence[int] | None = None, **close_kwargs):
  """Compares ``jax.vjp`` of ``fn`` and ``reference`` at ``args`` for a random cotangent.

  The reference runs on float32 copies of the arguments, so a low-precision
  kernel is checked against the exact gradient rather than against another
  low-precision computation, under one jit (eagerly, each of its primitives
  would be compiled on its own). Returns (fn's outputs, fn's input gradients).

  Args:
    fn: the function under test.
    reference: the function it must match (run on float32 copies).
    args: the arguments of both.
    seed: seeds the random cotangent.
    argnums: the arguments to differentiate; default all.
    **close_kwargs: tolerances, as :func:`assert_close`'s.

  Raises:
    AssertionError: outputs or gradients differ.
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
  keys = iter(np.random.default_rng(seed).spawn(len(jax.tree.leaves(out))))
  cotangent = jax.tree.map(lambda o: random_normal(next(keys), o.shape, o.dtype), out)
  grads = vjp(cotangent)

  @jax.jit
  def reference_vjp(primals, cotangent):
    ref_out, ref_vjp = jax.vjp(restrict(reference, True), *primals)
    return ref_out, ref_vjp(cotangent)

  ref_out, ref_grads = reference_vjp(upcast(diff_args), upcast(cotangent))
  assert_tree_close(out, ref_out, name="outputs", **close_kwargs)
  assert_tree_close(grads, ref_grads, name="vjp", **close_kwargs)
  return out, grads


def vmap_against_loop(fn: Callable, args: Sequence, in_axes, **close_kwargs):
  """``jax.vmap(fn, in_axes)`` equals applying ``fn`` to each slice in turn.

  Args:
    fn: the function under test.
    args: its arguments.
    in_axes: as ``jax.vmap``'s (one per argument, or one for all).
    **close_kwargs: tolerances, as :func:`assert_close`'s.

  Returns:
    The batched result.

  Raises:
    AssertionError: the batched and looped results differ.
  """
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


# -- forward mode and every transformation ------------------------------------------


def _restrict(f, args, argnums, cast):
  """f as a function of ``args[i]`` for i in argnums (the others fixed, upcast with cast)."""
  fixed = upcast(list(args)) if cast else list(args)

  def g(*diff):
    full = list(fixed)
    for i, d in zip(argnums, diff):
      full[i] = d
    return f(*full)

  return g


def _random_like(seed, tree):
  leaves, treedef = jax.tree.flatten(tree)
  keys = np.random.default_rng(seed).spawn(max(len(leaves), 1))
  return jax.tree.unflatten(
      treedef, [random_normal(k, jnp.shape(x), jnp.asarray(x).dtype) for k, x in zip(keys, leaves)])


def jvp_against_reference(fn: Callable, reference: Callable, args: Sequence, *, seed: int = 0,
                          argnums: Sequence[int] | None = None, **close_kwargs):
  """Compares ``jax.jvp`` of ``fn`` and ``reference`` at ``args`` for random tangents.

  As :func:`vjp_against_reference`, the reference runs on float32 copies, under one jit.
  Returns (fn's outputs, fn's output tangents).

  Args:
    fn: the function under test.
    reference: the function it must match.
    args: the arguments of both.
    seed: seeds the random tangents.
    argnums: the arguments with tangents; default all.
    **close_kwargs: tolerances, as :func:`assert_close`'s.

  Raises:
    AssertionError: outputs or tangents differ.
  """
  argnums = tuple(range(len(args))) if argnums is None else tuple(argnums)
  primals = [args[i] for i in argnums]
  tangents = _random_like(seed, primals)
  out, tangent_out = jax.jvp(_restrict(fn, args, argnums, False), primals, tangents)
  ref_out, ref_tangent = jax.jit(lambda p, t: jax.jvp(
      _restrict(reference, args, argnums, True), p, t))(upcast(primals), upcast(tangents))
  assert_tree_close(out, ref_out, name="outputs", **close_kwargs)
  assert_tree_close(tangent_out, ref_tangent, name="jvp", **close_kwargs)
  return out, tangent_out


def derivative_against_reference(mode: str, fn: Callable, reference: Callable, args: Sequence,
                                 **kwargs):
  """:func:`vjp_against_reference` (``mode="vjp"``) or :func:`jvp_against_reference`
  (``"jvp"``): reverse or forward mode against the reference.

  Args:
    mode: ``"vjp"`` or ``"jvp"``.
    fn: the function under test.
    reference: the function it must match.
    args: the arguments of both.
    **kwargs: as the chosen check's.
  """
  check = {"vjp": vjp_against_reference, "jvp": jvp_against_reference}[mode]
  return check(fn, reference, args, **kwargs)


def scalarize(f: Callable) -> Callable:
  """A scalar function of f's outputs with non-zero second derivatives.

  Args:
    f: a function of arrays.

  Returns:
    ``sum(sin(y))`` over f's floating outputs ``y``, in float32.
  """

  def scalar(*args):
    leaves = [x for x in jax.tree.leaves(f(*args)) if _is_float(x)]
    return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in leaves)

  return scalar


def check_transformations(fn: Callable, reference: Callable, args: Sequence, *,
                          argnums: Sequence[int] | None = None, seed: int = 0,
                          forward_kernel: str | None = None, checkpoint_name: str | None = None,
                          **close_kwargs) -> None:
  """The transformations an op composes with, each against the reference (float32 args).

  ``jax.jacfwd`` == ``jax.jacrev``; ``jax.hessian`` and ``jvp(grad)`` /
  ``grad(jvp)`` of a scalar function of the outputs; ``jvp`` under ``vmap`` and
  ``vmap`` under ``jvp``, and ``vmap`` of ``jvp(grad)`` and of ``grad(jvp)``;
  ``jax.linearize``; ``jax.eval_shape``; ``jax.checkpoint``
  without a policy and with ``save_only_these_names(checkpoint_name)``. With
  ``forward_kernel`` (a primitive name) and ``checkpoint_name``, the named
  policy must keep the residuals: the forward kernel runs once in the
  differentiated program, not again in the backward pass.

  Args:
    fn: the function under test.
    reference: the function it must match (typically from ``jaxops.reference``).
    args: float32 arguments of both.
    argnums: the arguments to differentiate; default all.
    seed: seeds the random tangents.
    forward_kernel: the forward primitive's name, to check the checkpoint policy.
    checkpoint_name: the op's residual name (``"jaxops.<op>"``).
    **close_kwargs: tolerances, as :func:`assert_close`'s.

  Raises:
    AssertionError: a transformation's result differs from the reference's.

  Examples:
    >>> x = jaxops.testing.random_normal(0, (2, 8))
    >>> jaxops.testing.check_transformations(jaxops.rms_norm, jaxops.reference.rms_norm, (x,))
  """
  argnums = tuple(range(len(args))) if argnums is None else tuple(argnums)
  f = _restrict(fn, args, argnums, False)
  r = _restrict(reference, args, argnums, False)
  primals = tuple(args[i] for i in argnums)
  tangents = tuple(_random_like(seed + 1, list(primals)))
  s, sr = scalarize(f), scalarize(r)

  every = tuple(range(len(primals)))
  # Each check is one jitted program: eagerly, every primitive of a second-order
  # program would be compiled on its own.
  jac_fwd = jax.jit(jax.jacfwd(f, argnums=every))(*primals)
  jac_rev = jax.jit(jax.jacrev(f, argnums=every))(*primals)
  assert_tree_close(jac_fwd, jac_rev, name="jacfwd vs jacrev", **close_kwargs)

  hess = jax.jit(jax.hessian(s, argnums=every))(*primals)
  hess_ref = jax.jit(jax.hessian(sr, argnums=every))(*primals)
  assert_tree_close(hess, hess_ref, name="hessian", **close_kwargs)

  hvp = jax.jit(lambda g: jax.jvp(jax.grad(g, argnums=every), primals, tangents)[1],
                static_argnums=0)
  assert_tree_close(hvp(s), hvp(sr), name="jvp(grad)", **close_kwargs)
  grad_of_jvp = jax.jit(lambda g: jax.grad(
      lambda *p: scalarize(lambda *q: jax.jvp(g, q, tangents)[1])(*p), argnums=every)(*primals),
      static_argnums=0)
  assert_tree_close(grad_of_jvp(f), grad_of_jvp(r), name="grad(jvp)", **close_kwargs)

  # A batch of two: the arguments and a perturbed copy.
  batched = tuple(jnp.stack([p, p + 0.125 * t]) for p, t in zip(primals, tangents))
  batched_t = tuple(jnp.stack([t, -t]) for t in tangents)
  vmap_jvp = jax.jit(lambda g: jax.vmap(lambda p, t: jax.jvp(g, p, t))(batched, batched_t),
                     static_argnums=0)
  assert_tree_close(vmap_jvp(f), vmap_jvp(r), name="vmap(jvp)", **close_kwargs)
  jvp_vmap = jax.jit(lambda g: jax.jvp(jax.vmap(g), batched, batched_t), static_argnums=0)
  assert_tree_close(jvp_vmap(f), jvp_vmap(r), name="jvp(vmap)", **close_kwargs)
  vmap_jvp_grad = jax.jit(lambda g: jax.vmap(
      lambda p, t: jax.jvp(jax.grad(g, argnums=every), p, t)[1])(batched, batched_t),
      static_argnums=0)
  assert_tree_close(vmap_jvp_grad(s), vmap_jvp_grad(sr), name="vmap(jvp(grad))", **close_kwargs)
  vmap_grad_jvp = jax.jit(lambda g: jax.vmap(lambda p, t: jax.grad(
      lambda *q: scalarize(lambda *u: jax.jvp(g, u, t)[1])(*q), argnums=every)(*p))(
          batched, batched_t), static_argnums=0)
  assert_tree_close(vmap_grad_jvp(f), vmap_grad_jvp(r), name="vmap(grad(jvp))", **close_kwargs)

  out, linear = jax.linearize(f, *primals)
  assert_tree_close(linear(*tangents), jax.jvp(r, primals, tangents)[1], name="linearize",
                    **close_kwargs)
  shapes = jax.eval_shape(f, *primals)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
      lambda a: (a.shape, a.dtype), out)

  # A linear function of the outputs: its backward pass needs the op's residuals
  # but not its outputs, so a policy that saves the residuals needs no forward.
  weights = _random_like(seed + 2, out)
  linear_scalar = lambda *p: sum(jnp.vdot(w.astype(jnp.float32), y.astype(jnp.float32))
                                 for w, y in zip(jax.tree.leaves(weights), jax.tree.leaves(f(*p))))
  expected = jax.jit(jax.grad(linear_scalar, argnums=every))(*primals)
  policies = {"no policy": None}
  if checkpoint_name is not None:
    policies["names"] = jax.checkpoint_policies.save_only_these_names(checkpoint_name)
  for label, policy in policies.items():
    remat = jax.grad(jax.checkpoint(linear_scalar, policy=policy), argnums=every)
    assert_tree_close(jax.jit(remat)(*primals), expected, name=f"checkpoint ({label})",
                      **close_kwargs)
    if forward_kernel is not None and policy is not None:
      runs = count_primitive(jax.make_jaxpr(remat)(*primals).jaxpr, forward_kernel)
      assert runs == 1, (f"{forward_kernel} runs {runs} times: the {checkpoint_name!r} policy "
                         "should save its residuals for the backward pass")


def count_primitive(jaxpr, name: str) -> int:
  """How many equations of ``jaxpr`` (and of the jaxprs inside it) apply ``name``.

  Args:
    jaxpr: a ``jax.make_jaxpr`` result (closed or open jaxpr).
    name: a primitive's name, e.g. ``"jaxops_layer_norm_fwd"``.

  Returns:
    The count, an int.
  """
  from jax.extend.core import jaxprs_in_params
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for sub in jaxprs_in_params(eqn.params):
      count += count_primitive(getattr(sub, "jaxpr", sub), name)
  return count


def custom_call_targets(fn: Callable, *args) -> list[str]:
  """The custom-call targets of ``jax.jit(fn)`` lowered for the default backend.

  Args:
    fn: the function to lower.
    *args: its arguments.

  Returns:
    The target names, in program order.

  Examples:
    >>> targets = jaxops.testing.custom_call_targets(jaxops.rms_norm, jnp.ones((2, 8)))
    >>> any("rms_norm" in t for t in targets)
    True
  """
  import re
  text = jax.jit(fn).lower(*args).as_text()
  return re.findall(r"stablehlo\.custom_call @(\w+)", text)
