"""Serializing programs that call jaxops kernels with ``jax.export``.

``jax.export`` refuses custom calls it does not know to be stable unless they
are named in ``disabled_checks``; jaxops' kernels are FFI custom calls, so a
program that uses them is exported with :func:`export_checks`. The serialized
program names the kernels by target, so the process that runs it must have
registered them: ``import jaxops`` before ``jax.export.deserialize``.
"""

from __future__ import annotations

import jax

from jaxops._src.primitive import ALL_PRIMITIVES


def kernel_targets() -> tuple[str, ...]:
  """Every custom-call target a jaxops program may lower to (on any platform)."""
  return tuple(sorted({p.target for p in ALL_PRIMITIVES if p.target is not None}))


def export_checks() -> list[jax.export.DisabledSafetyCheck]:
  """The ``disabled_checks`` for ``jax.export.export`` of a program using jaxops.

  ``jax.export`` refuses custom calls it does not know as stable; jaxops'
  kernels are registered by ``import jaxops``, so a process that imports jaxops
  can run the exported program.

  Returns:
    A list of ``jax.export.DisabledSafetyCheck``, one per kernel target.

  Examples:
    >>> f = jax.jit(lambda x: jaxops.rms_norm(x))
    >>> exported = jax.export.export(f, disabled_checks=jaxops.export_checks())(jnp.ones((2, 8)))
    >>> blob = exported.serialize()         # elsewhere, after `import jaxops`:
    >>> jax.export.deserialize(blob).call(jnp.ones((2, 8))).shape
    (2, 8)
  """
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in kernel_targets()]
