"""``python -m jaxops.demo`` end to end on a tiny model: a run resumed from its
checkpoint continues with the same losses, and data-parallel training over 2
devices (host devices, made by a subprocess before jax starts, where the
default backend is the CPU; skipped on a machine with one GPU) gives the
single-device losses."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxops import demo
from support import meshes

TINY_FLAGS = ["--steps", "6", "--batch", "4", "--seq-len", "32", "--d-model", "32",
              "--layers", "1", "--heads", "2", "--kv-heads", "1", "--corpus-bytes", "131072",
              "--no-compare", "--sample-tokens", "0"]


def _env_with_checkout():
  """The environment for a subprocess that imports this jaxops (and sets its own
  device count). The subprocesses run with ``python -P``, as the README's
  commands do, so a source checkout in the working directory (whose jaxops has
  no compiled extension) does not shadow the jaxops under test."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(demo.__file__)))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
  env.pop("XLA_FLAGS", None)
  return env


def _losses(path):
  with open(path) as f:
    return json.load(f)["jaxops"]["losses"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """Six steps in one go, saving a checkpoint at step 3 (and 6)."""
  tmp = tmp_path_factory.mktemp("straight")
  log = tmp / "log.json"
  demo.main(TINY_FLAGS + ["--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "3",
                          "--log-json", str(log)])
  return tmp / "ckpt", _losses(log)


def test_resumed_run_continues_with_the_same_losses(straight_run, tmp_path):
  checkpoints, losses = straight_run
  assert len(losses) == 6
  resumed_dir = tmp_path / "ckpt"
  shutil.copytree(checkpoints / "step_3", resumed_dir / "step_3")
  log = tmp_path / "log.json"
  demo.main(TINY_FLAGS + ["--checkpoint-dir", str(resumed_dir), "--resume",
                          "--log-json", str(log)])
  np.testing.assert_array_equal(_losses(log), losses[3:])
  assert os.path.isdir(resumed_dir / "step_6")


def test_two_devices_give_the_single_device_losses(straight_run, tmp_path):
  meshes.require_devices(2)
  _, losses = straight_run
  log = tmp_path / "log.json"
  result = subprocess.run([sys.executable, "-P", "-m", "jaxops.demo", "--devices", "2", *TINY_FLAGS,
                           "--log-json", str(log)], env=_env_with_checkout(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "data-parallel over 2 devices" in result.stdout
  np.testing.assert_allclose(_losses(log), losses, rtol=1e-5, atol=1e-5)


_COLLECTIVES_SCRIPT = """
import json, re, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
from jax.sharding import PartitionSpec
from jaxops.models import data, decoder, training
from jaxops.models.config import DecoderConfig

config = DecoderConfig(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       implementation=sys.argv[1])
tx = training.make_optimizer(training.OptimizerConfig(total_steps=6), config.implementation)
variables = decoder.init_params(config)
mesh = training.data_mesh(2)
args = (training.place(variables, mesh), training.place(tx.init(variables), mesh),
        training.place(data.batch_at(data.stdlib_corpus(1 << 16), 0, 4, 32), mesh,
                       PartitionSpec("data")))
hlo = training.make_train_step(config, tx, mesh).lower(*args).compile().as_text()
print(json.dumps({op: len(re.findall(op + r"\\(", hlo)) for op in ("all-gather", "all-reduce")}))
"""


@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_data_parallel_step_splits_the_batch(implementation):
  """The whole step is partitioned, with the kernels (through their sharding
  rules) as with every op on the jnp reference: no all-gather (the batch stays
  split), gradients all-reduced."""
  meshes.require_devices(2)
  result = subprocess.run([sys.executable, "-P", "-c", _COLLECTIVES_SCRIPT, implementation],
                          env=_env_with_checkout(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  collectives = json.loads(result.stdout.strip().splitlines()[-1])
  assert collectives["all-gather"] == 0 and collectives["all-reduce"] > 0, collectives


def test_serve_streams_prompts_through_the_paged_cache(capsys):
  """``--serve``: continuous batching over the paged cache, then the jnp
  reference over a contiguous one; both finish every request."""
  flags = [f for f in TINY_FLAGS if f != "--no-compare"]
  demo.main(flags + ["--compare-steps", "1", "--serve", "--serve-requests", "5",
                     "--serve-new-tokens", "6", "--serve-batch", "2", "--page-size", "4"])
  out = capsys.readouterr().out
  assert "serving 5 prompts" in out
  assert "   5/5 requests" in out
  assert "jaxops / xla:" in out and "x cache memory" in out
  lines = {line.split()[0]: line.split() for line in out.splitlines()
           if line.split()[:2] in (["jaxops", "paged"], ["xla", "contiguous"])}
  assert set(lines) == {"jaxops", "xla"}
