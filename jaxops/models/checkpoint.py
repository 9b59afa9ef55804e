"""Synchronous checkpoints of a training run with orbax (a dependency of flax).

One directory per saved step, ``<dir>/step_<n>``, holding a single pytree:
``{"variables", "opt_state", "step", "data_position"}``. Restoring needs a
template of the same structure (the freshly initialised state), which also
gives the restored arrays their shardings, so a data-parallel run restores
replicated.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save(directory: str, *, variables, opt_state, step: int, data_position: int) -> str:
  """Saves a training run's state to ``directory/step_<step>`` with orbax; returns that path."""
  path = os.path.join(os.path.abspath(directory), f"step_{step}")
  tree = {"variables": variables, "opt_state": opt_state,
          "step": np.array(step, np.int64), "data_position": np.array(data_position, np.int64)}
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=ocp.args.StandardSave(tree), force=True)
  return path


def latest_step(directory: str) -> int | None:
  """The highest step saved in ``directory``, or None."""
  if not os.path.isdir(directory):
    return None
  steps = [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(directory)) if m]
  return max(steps, default=None)


def restore(directory: str, *, variables, opt_state, step: int | None = None):
  """(variables, opt_state, step, data_position) from ``step`` (default: the
  latest); ``variables``/``opt_state`` are templates of the right structure."""
  step = latest_step(directory) if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint (step_<n> directory) in {directory}")
  path = os.path.join(os.path.abspath(directory), f"step_{step}")
  template = {"variables": variables, "opt_state": opt_state,
              "step": np.array(0, np.int64), "data_position": np.array(0, np.int64)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
    tree = checkpointer.restore(path, args=ocp.args.StandardRestore(abstract))
  return tree["variables"], tree["opt_state"], int(tree["step"]), int(tree["data_position"])
