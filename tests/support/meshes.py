"""Meshes of the devices that exist, for the sharding tests.

On the CPU, tests/conftest.py asks XLA for 8 host devices, so every mesh of the
suite fits. On a GPU (JAXOPS_TEST_GPU=1) the default backend has as many
devices as the machine has GPUs, often one: a test whose mesh needs more is
skipped, saying how many it needs and how many there are.
"""

from __future__ import annotations

import math

import jax
import pytest


def require_devices(count: int) -> list:
  """The first ``count`` devices of JAX's default backend; skips the test if it has fewer."""
  devices = jax.devices()
  if len(devices) < count:
    pytest.skip(f"needs {count} devices, JAX's default backend ({jax.default_backend()}) has "
                f"{len(devices)}")
  return devices[:count]


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...],
              axis_type=jax.sharding.AxisType.Auto) -> jax.sharding.Mesh:
  """``jax.make_mesh`` over the first devices of the default backend, every axis
  of ``axis_type``; skips the test where there are too few devices."""
  devices = require_devices(math.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=devices)
