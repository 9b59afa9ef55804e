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

  Example::

    exported = jax.export.export(jax.jit(model), disabled_checks=jaxops.export_checks())(x)
    blob = exported.serialize()
    # elsewhere, after `import jaxops`:
    y = jax.export.deserialize(blob).call(x)
  """
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in kernel_targets()]
