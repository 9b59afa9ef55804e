"""The CUDA lowering of the activations, rope, embedding and AdamW, checked on a
machine without a GPU.

``lower(lowering_platforms=("cuda",))`` must name the CUDA handlers' targets
with operands, results and attributes of the types those handlers bind
(xla_ffi/<family>_common.h, shared with the CPU handlers): a mismatch, such as
an f64 attribute against ``Attr<float>``, fails only when the program runs on
a GPU.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import pytest

import jaxops
from support.lowering import DTYPES, T, check_binding, custom_calls

# target -> (operand dtypes, result dtypes), as bound in C++; the attributes
# come from the targets' contract.
BUFFERS = {
    "jaxops_gelu_fwd": ((T,), (T,)),
    "jaxops_gelu_bwd": ((T, T), (T,)),
    "jaxops_silu_fwd": ((T,), (T,)),
    "jaxops_silu_bwd": ((T, T), (T,)),
    "jaxops_swiglu_fwd": ((T, T), (T,)),
    "jaxops_swiglu_bwd": ((T, T, T), (T, T)),
    "jaxops_geglu_fwd": ((T, T), (T,)),
    "jaxops_geglu_bwd": ((T, T, T), (T, T)),
    "jaxops_rope": ((T, "i32"), (T, "f32")),
    "jaxops_embedding_fwd": ((T, "i32"), (T,)),
    "jaxops_embedding_bwd": ((T, "i32"), (T, "i32")),
    # scalars, then per leaf grads, params, m (optax's default: the
    # parameters' dtype), v; the test below lowers two leaves in one call.
    "jaxops_adamw": (("f32",) + (T, T, T, "f32") * 2, (T, T, "f32") * 2),
}


def _check_binding(call, dtype):
  check_binding(call, dtype, BUFFERS)


def _activation_vjp(op):
  unary = {"gelu": lambda x, u: jaxops.gelu(x, implementation="ffi"),
           "silu": lambda x, u: jaxops.silu(x, implementation="ffi"),
           "swiglu": lambda x, u: jaxops.swiglu(x, u, implementation="ffi"),
           "geglu": lambda x, u: jaxops.geglu(x, u, False, implementation="ffi")}[op]

  def fwd_bwd(x, u):
    y, vjp = jax.vjp(unary, x, u)
    return y, vjp(y)

  return fwd_bwd


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["gelu", "silu", "swiglu", "geglu"])
def test_activations_lower_to_the_cuda_targets(op, dtype):
  x = jnp.ones((3, 5, 7), dtype)
  calls = custom_calls(_activation_vjp(op), x, x)
  assert [c[0] for c in calls] == [f"jaxops_{op}_fwd", f"jaxops_{op}_bwd"]
  for call in calls:
    _check_binding(call, dtype)
    assert all(shape == x.shape for shape, _ in call[1] + call[2])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("per_batch", [False, True])
def test_rope_lowers_with_its_table_workspace(dtype, per_batch):
  x = jnp.ones((2, 5, 3, 16), dtype)
  positions = jnp.ones((2, 5) if per_batch else (5,), jnp.int32)

  def fwd_bwd(x):
    y, vjp = jax.vjp(lambda x: jaxops.rope(x, positions, style="gptj", rotary_dim=6,
                                           implementation="ffi"), x)
    return y, vjp(y)

  forward, backward = custom_calls(fwd_bwd, x)
  for call in (forward, backward):
    _check_binding(call, dtype)
    assert call[1][1][0] == ((2, 5) if per_batch else (1, 5))
    assert call[2][1][0] == ((2 if per_batch else 1) * 5, 6)  # the cos/sin table
  assert "inverse = false" in forward[4] and "inverse = true" in backward[4]
  assert "interleaved = true" in forward[4] and "rotary_dim = 6 : i64" in forward[4]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_embedding_lowers_with_its_sort_workspace(dtype):
  table = jnp.ones((11, 6), dtype)
  ids = jnp.ones((2, 7), jnp.int32)

  def fwd_bwd(table):
    y, vjp = jax.vjp(lambda t: jaxops.embedding(t, ids, implementation="ffi"), table)
    return y, vjp(y)

  forward, backward = custom_calls(fwd_bwd, table)
  _check_binding(forward, dtype)
  _check_binding(backward, dtype)
  assert forward[2][0][0] == (2, 7, 6)
  # The sort's 14 keys padded to one 2048-key tile (two int32 each), then each
  # of the 11 rows' first and end position.
  assert backward[2] == [((11, 6), DTYPES[dtype]), ((2 * 2048 + 2 * 11,), "i32")]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fused", [False, True])
def test_adamw_lowers_one_call_for_all_leaves_with_aliases(dtype, fused):
  tx = jaxops.optim.adamw(1e-3, weight_decay=0.1, implementation="ffi")
  params = {"a": jnp.ones((4, 3), dtype), "b": jnp.ones((5,), dtype)}
  if fused:
    fn = lambda g, s, p: tx.step(g, s, p)
  else:
    fn = tx.update
  (call,) = custom_calls(fn, params, tx.init(params), params)
  assert call[0] == "jaxops_adamw"
  _check_binding(call, dtype)
  assert f"apply_updates = {'true' if fused else 'false'}" in call[4]
  assert call.integers["decayed_leaves"] == 2
  # m and v are written in place, and by step the new parameters over the
  # old: per leaf i, results 3i.. over operands 1 + 4i.. (after the scalars).
  leaf_aliases = ((0, 2), (1, 3), (2, 4)) if fused else ((1, 3), (2, 4))
  aliases = [(output + 3 * i, operand + 4 * i) for i in range(2) for output, operand in leaf_aliases]
  for output, operand in aliases:
    assert (f"output_tuple_indices = [{output}], operand_index = {operand}," in call[4]), call[4]
  assert call[4].count("output_operand_alias<") == len(aliases)


def _built_with_cuda():
  return shutil.which("nvcc") is not None or bool(os.environ.get("CUDACXX"))


@pytest.mark.skipif(not _built_with_cuda(), reason="no nvcc: the build is CPU-only")
def test_cuda_module_registers_these_targets():
  import jaxops._jaxops_cuda as cuda_module

  assert set(BUFFERS) <= set(cuda_module.registrations())
