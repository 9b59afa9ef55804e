"""jax.export of programs that call jaxops kernels, run again in a fresh process."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops.testing import assert_tree_close, random_inputs


def _model(params, x, labels):
  """A small transformer block's worth of ops, and the gradient of its loss."""

  def loss(params, x):
    h = jaxops.rms_norm(x, params["norm"])
    q = jaxops.rope(h.reshape(2, 8, 2, 8), jnp.arange(8))
    out = jaxops.attention(q, q, q, is_causal=True).reshape(2, 8, 16)
    h = jaxops.swiglu(out, h) + x
    logits = jaxops.layer_norm(h) @ params["unembed"]
    return jaxops.cross_entropy(logits, labels)

  value, grads = jax.value_and_grad(loss)(params, x)
  hvp = jax.jvp(lambda x: jax.grad(loss, argnums=1)(params, x), (x,), (x,))[1]
  return value, grads, hvp


def _inputs():
  x, norm, unembed = random_inputs(0, [(2, 8, 16), (16,), (16, 11)])
  labels = jax.random.randint(jax.random.key(1), (2, 8), 0, 11)
  return {"norm": norm, "unembed": unembed}, x, labels


def test_export_checks_name_every_kernel():
  names = {check.is_custom_call() for check in jaxops.export_checks()}
  assert {"jaxops_attention_fwd", "jaxops_attention_bwd", "jaxops_layer_norm_fwd",
          "jaxops_cross_entropy_bwd", "jaxops_rope"} <= names


def test_export_without_the_checks_is_refused():
  with pytest.raises(ValueError, match="custom call"):
    jax.export.export(jax.jit(_model))(*_inputs())


def test_serialized_program_runs_in_a_fresh_process(tmp_path):
  args = _inputs()
  exported = jax.export.export(jax.jit(_model), disabled_checks=jaxops.export_checks())(*args)
  (tmp_path / "model.bin").write_bytes(exported.serialize())
  np.savez(tmp_path / "inputs.npz", norm=args[0]["norm"], unembed=args[0]["unembed"], x=args[1],
           labels=args[2])
  script = textwrap.dedent("""
      import sys
      import jax, numpy as np
      import jaxops  # registers the kernels the program calls
      path = sys.argv[1]
      exported = jax.export.deserialize(bytearray(open(path + "/model.bin", "rb").read()))
      a = np.load(path + "/inputs.npz")
      value, grads, hvp = exported.call({"norm": a["norm"], "unembed": a["unembed"]}, a["x"],
                                        a["labels"])
      np.savez(path + "/outputs.npz", value=value, norm=grads["norm"],
               unembed=grads["unembed"], hvp=hvp)
  """)
  subprocess.run([sys.executable, "-P", "-c", script, str(tmp_path)], check=True, timeout=300)
  out = np.load(tmp_path / "outputs.npz")
  value, grads, hvp = _model(*args)
  assert_tree_close((out["value"], out["norm"], out["unembed"], out["hvp"]),
                    (value, grads["norm"], grads["unembed"], hvp), atol=1e-5, rtol=1e-5)
  assert "jaxops_attention_bwd" in exported.mlir_module()  # the kernels, not references
