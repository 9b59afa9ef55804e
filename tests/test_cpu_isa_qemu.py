"""jaxops on emulated x86-64 CPUs without AVX-512 (qemu-x86_64, user mode).

The installed build runs under `qemu-x86_64 -cpu <model>`, whose CPUID reports
that model's features and whose translator refuses (SIGILL) instructions the
model lacks. Haswell has AVX2/FMA/F16C but no AVX-512: the dispatcher must pick
avx2 and refuse JAXOPS_CPU_ISA=avx512. Sandy Bridge has AVX but no AVX2: it
must pick generic. (jaxlib itself needs AVX, so an older model such as Nehalem
cannot run JAX at all.) Skipped without qemu-x86_64 (Debian: apt-get install
qemu-user); about 20 s per model on an idle 2-core machine.
"""

import os
import platform
import shutil
import subprocess
import sys

import pytest

from jaxops import _jaxops_cpu

QEMU = shutil.which("qemu-x86_64")
pytestmark = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64", reason="needs qemu-x86_64 on an x86-64 host")

# rms_norm's value and gradients against the reference, on a shape that leaves
# vector tails; prints the variant in use. One op: every XLA compilation runs
# emulated (the lower variants' op coverage is tests/test_cpu_isa.py's).
OPS_SCRIPT = """
import jax, jax.numpy as jnp
import jaxops
from jaxops import reference
from jaxops.testing import assert_close
x = jnp.sin(jnp.arange(3 * 37, dtype=jnp.float32)).reshape(3, 37) * 3.0
w = jnp.cos(jnp.arange(37, dtype=jnp.float32))
loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
assert_close(jaxops.rms_norm(x, w), reference.rms_norm(x, w))
for actual, expected in zip(jax.grad(loss(jaxops.rms_norm), (0, 1))(x, w),
                            jax.grad(loss(reference.rms_norm), (0, 1))(x, w)):
  assert_close(actual, expected, reduce_size=37)
print("variant", jaxops.cpu_isa())
"""

# Loads the dispatcher module by path (no JAX) and asks for the variable's variant.
FORCED_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_jaxops_cpu", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("best", module.best_cpu_isa())
try:
  module.registrations()
except RuntimeError as error:
  print("error", error)
else:
  print("loaded", module.cpu_isa())
"""


def _run(model, script, isa, *args):
  env = {k: v for k, v in os.environ.items() if k not in ("JAXOPS_CPU_ISA", "XLA_FLAGS")}
  if isa:
    env["JAXOPS_CPU_ISA"] = isa
  result = subprocess.run([QEMU, "-cpu", model, sys.executable, "-P", "-c", script, *args],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f"{model}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
  return result.stdout


@pytest.mark.parametrize("model,variant", [("Haswell", "avx2"), ("SandyBridge", "generic")])
def test_ops_run_on_a_cpu_without_avx512(model, variant):
  assert f"variant {variant}\n" in _run(model, OPS_SCRIPT, None)


def test_a_variant_above_the_cpu_is_refused():
  out = _run("Haswell", FORCED_SCRIPT, "avx512", _jaxops_cpu.__file__)
  assert "best avx2\n" in out
  assert ("error JAXOPS_CPU_ISA=avx512 asks for CPU kernels this CPU cannot run; its best is "
          "avx2. Set JAXOPS_CPU_ISA to a variant at or below it, or unset it") in out
