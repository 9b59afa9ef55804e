"""Training the decoder LM: loss, a jitted AdamW step (single device or data-parallel
over a mesh), and its compiled memory figure. Shared by the demo, the
benchmark and the tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxops
from jaxops.models.blocks import lm_loss
from jaxops.models.config import DecoderConfig
from jaxops.models.decoder import linen_model


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of the demo and the benchmark: AdamW with a warm-up-cosine schedule."""
  peak_learning_rate: float = 3e-3
  warmup_steps: int = 20
  total_steps: int = 200
  weight_decay: float = 0.01

  def schedule(self):
    """Linear warm-up, then cosine decay to a tenth of the peak at ``total_steps``."""
    warmup = min(self.warmup_steps, self.total_steps // 2)
    return optax.warmup_cosine_decay_schedule(
        0.0, self.peak_learning_rate, warmup, max(self.total_steps, warmup + 1),
        end_value=self.peak_learning_rate / 10)


def make_optimizer(opt: OptimizerConfig, implementation: str | None):
  """``jaxops.optim.adamw`` (b1 0.9, b2 0.95) on ``opt``'s schedule and weight decay."""
  return jaxops.optim.adamw(opt.schedule(), b1=0.9, b2=0.95, weight_decay=opt.weight_decay,
                            implementation=implementation)


def loss_fn(variables, batch, config: DecoderConfig):
  """Next-token loss of ``batch`` [B, T + 1]: inputs batch[:, :-1], labels batch[:, 1:].

  Args:
    variables: the linen variables of a :class:`~jaxops.models.decoder.DecoderLM`.
    batch: int32 ``[B, T + 1]``.
    config: the model's configuration.

  Returns:
    The mean next-token cross-entropy, a float32 scalar.
  """
  logits = linen_model(config).apply(variables, batch[:, :-1])
  return lm_loss(logits, batch[:, 1:], ignore_index=config.ignore_index,
                 implementation=config.implementation)


def data_mesh(num_devices: int) -> Mesh:
  """A one-axis ``Mesh`` named ``"data"`` of the first ``num_devices`` devices."""
  devices = jax.devices()
  if num_devices > len(devices):
    raise ValueError(f"asked for {num_devices} devices, JAX sees {len(devices)}; for host CPU "
                     "devices set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                     "importing jax")
  return Mesh(np.array(devices[:num_devices]), ("data",))


def make_train_step(config: DecoderConfig, tx, mesh: Mesh | None = None):
  """jit of (variables, opt_state, batch) -> (variables, opt_state, loss).

  Variables and optimizer state are donated (updated in place by the AdamW
  kernel). With ``mesh`` the batch is split over its "data" axis and the
  parameters and optimizer state are replicated: data parallelism, the
  gradient all-reduce inserted by XLA's partitioner.

  Args:
    config: the model's configuration.
    tx: the optimizer, a :func:`jaxops.optim.adamw` (its ``step`` is used).
    mesh: optional mesh with a ``"data"`` axis (:func:`data_mesh`).

  Returns:
    The jitted step.
  """

  def step(variables, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(variables, batch, config)
    variables, opt_state = tx.step(grads, opt_state, variables)
    return variables, opt_state, loss

  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  return jax.jit(step, donate_argnums=(0, 1), in_shardings=(replicated, replicated, by_batch),
                 out_shardings=(replicated, replicated, replicated))


def place(tree, mesh: Mesh | None, spec=P()):
  """Puts ``tree`` on the mesh with ``spec`` (default replicated); as is without a mesh."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, tree)
  return jax.device_put(tree, NamedSharding(mesh, spec))


def temp_bytes(compiled) -> int | None:
  """XLA's temporary allocation of a compiled step: its peak working memory
  beyond arguments and outputs."""
  try:
    return compiled.memory_analysis().temp_size_in_bytes
  except Exception:  # not every backend reports a memory analysis
    return None


def run_steps(compiled_step, variables, opt_state, batches, *, mesh: Mesh | None = None,
              on_step=None):
  """Runs ``compiled_step`` over the iterable ``batches`` (numpy [B, T + 1]);
  returns (variables, opt_state, losses as floats). ``on_step(i, loss,
  variables, opt_state)`` sees each step's result (the float conversion of the
  loss waits for the step to finish, so timings taken there are real).

  Args:
    compiled_step: a step from :func:`make_train_step`.
    variables: the model's variables.
    opt_state: the optimizer's state.
    batches: an iterable of int32 ``[B, T + 1]`` numpy batches.
    mesh: the step's mesh, if any: batches are sharded over its ``"data"`` axis.
    on_step: optional callback ``on_step(i, loss, variables, opt_state)``.

  Returns:
    ``(variables, opt_state, losses)``.
  """
  losses = []
  for i, batch in enumerate(batches):
    variables, opt_state, loss = compiled_step(variables, opt_state,
                                               place(batch, mesh, P("data")))
    losses.append(float(loss))
    if on_step is not None:
      on_step(i, losses[-1], variables, opt_state)
  return variables, opt_state, losses
