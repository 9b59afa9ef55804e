"""``python -m jaxops.demo`` end to end on a tiny model: a run resumed from its
checkpoint continues with the same losses, and data-parallel training over 2
host devices (a subprocess: XLA_FLAGS must be set before jax starts) gives
the single-device losses."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxops import demo

TINY_FLAGS = ["--steps", "6", "--batch", "4", "--seq-len", "32", "--d-model", "32",
              "--layers", "1", "--heads", "2", "--kv-heads", "1", "--corpus-bytes", "131072",
              "--no-compare", "--sample-tokens", "0"]


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
  _, losses = straight_run
  log = tmp_path / "log.json"
  root = os.path.dirname(os.path.dirname(os.path.abspath(demo.__file__)))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
  env.pop("XLA_FLAGS", None)
  result = subprocess.run([sys.executable, "-m", "jaxops.demo", "--devices", "2", *TINY_FLAGS,
                           "--log-json", str(log)], env=env, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "data-parallel over 2 devices" in result.stdout
  np.testing.assert_allclose(_losses(log), losses, rtol=1e-5, atol=1e-5)
