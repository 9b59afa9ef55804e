"""Dtypes the kernels lack: float64 (under x64) and complex64.

With ``implementation=None`` every public op runs its jnp reference for them
(complex only where the op's math has a complex form), and must then give the
values and the gradients of the function it replaces (jax.nn, Flax, optax; for
rope, an independent rotation by complex multiplication), under jit and vmap.
``implementation="ffi"`` raises a TypeError naming the argument, its dtype and
the supported dtypes; integer inputs are refused whatever the implementation.

One table, one row per op: how to draw its inputs for a dtype, which of them
are differentiated, the jaxops call and the call it replaces.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxops
from jaxops import reference

_HIGHEST = jax.lax.Precision.HIGHEST
_SEQ, _HEADS, _DIM, _VOCAB = 4, 2, 8, 6


def _normal(rng, shape, dtype):
  x = rng.standard_normal(shape)
  if np.issubdtype(dtype, np.complexfloating):
    x = x + 1j * rng.standard_normal(shape)
  return jnp.asarray(x.astype(dtype))


def _real(dtype):
  return np.finfo(dtype).dtype


def _flax(module, params, *args):
  return module.apply({"params": params}, *args)


def _causal_mask(n):
  return jnp.tril(jnp.ones((n, n), bool))


def _rope_by_complex_multiplication(x, positions):
  """NeoX rope as the product of the pair (x1 + i x2) with exp(i angle), the
  angle float32(position) * float32 frequency as the op specifies; complex x
  rotates its real and imaginary parts alike."""
  if jnp.iscomplexobj(x):
    return (_rope_by_complex_multiplication(jnp.real(x), positions)
            + 1j * _rope_by_complex_multiplication(jnp.imag(x), positions)).astype(x.dtype)
  half = x.shape[-1] // 2
  angle = positions.astype(jnp.float32)[:, None] * reference.rope_frequencies(x.shape[-1], 1e4)
  rotor = jnp.exp(1j * angle.astype(x.dtype))[None, :, None, :]
  z = (x[..., :half] + 1j * x[..., half:]) * rotor
  return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Op:
  """inputs(rng, dtype) -> arrays; grad_args: the differentiated ones;
  ffi_argument: the argument the "ffi" error names; complex_ok: whether the
  op has a complex form (else complex is a TypeError naming ffi_argument)."""
  inputs: Callable
  grad_args: tuple[int, ...]
  ours: Callable
  theirs: Callable
  ffi_argument: str
  complex_ok: bool = True


def _attention_inputs(rng, dtype):
  return tuple(_normal(rng, (1, _SEQ, _HEADS, _DIM), dtype) for _ in range(3))


def _rows(rng, dtype):
  return (_normal(rng, (3, _DIM), dtype),)


def _norm_inputs(rng, dtype):
  return (_normal(rng, (3, _DIM), dtype), _normal(rng, (_DIM,), _real(dtype)),
          _normal(rng, (_DIM,), _real(dtype)))


def _gated(rng, dtype):
  return _normal(rng, (3, _DIM), dtype), _normal(rng, (3, _DIM), dtype)


def _ce_inputs(rng, dtype):
  return _normal(rng, (5, _VOCAB), dtype), jnp.asarray(rng.integers(0, _VOCAB, 5))


def _linear_ce_inputs(rng, dtype):
  return (_normal(rng, (5, _DIM), dtype), _normal(rng, (_DIM, _VOCAB), dtype),
          jnp.asarray(rng.integers(0, _VOCAB, 5)))


def _embedding_inputs(rng, dtype):
  return _normal(rng, (_VOCAB, _DIM), dtype), jnp.asarray(rng.integers(0, _VOCAB, (2, 3)))


OPS = {
    "attention": Op(
        _attention_inputs, (0, 1, 2), jaxops.attention,
        lambda q, k, v: nn.dot_product_attention(q, k, v, precision=_HIGHEST), "query"),
    "layer_norm": Op(
        _norm_inputs, (0, 1, 2), jaxops.layer_norm,
        lambda x, w, b: _flax(nn.LayerNorm(1e-5, use_fast_variance=False), {"scale": w, "bias": b}, x),
        "x"),
    "rms_norm": Op(
        lambda rng, dtype: _norm_inputs(rng, dtype)[:2], (0, 1), jaxops.rms_norm,
        lambda x, w: _flax(nn.RMSNorm(), {"scale": w}, x), "x"),
    "add_rms_norm": Op(
        lambda rng, dtype: (*_gated(rng, dtype), _norm_inputs(rng, dtype)[1]), (0, 1, 2),
        jaxops.add_rms_norm,
        lambda x, r, w: (_flax(nn.RMSNorm(), {"scale": w}, x + r), x + r), "x"),
    "softmax": Op(_rows, (0,), jaxops.softmax, jax.nn.softmax, "x"),
    "log_softmax": Op(_rows, (0,), jaxops.log_softmax, jax.nn.log_softmax, "x"),
    "causal_softmax": Op(
        lambda rng, dtype: (_normal(rng, (_DIM, _DIM), dtype),), (0,), jaxops.causal_softmax,
        lambda x: jax.nn.softmax(x, where=_causal_mask(_DIM)), "x"),
    "cross_entropy": Op(
        _ce_inputs, (0,), jaxops.cross_entropy,
        lambda z, y: optax.softmax_cross_entropy_with_integer_labels(z, y).mean(), "logits",
        complex_ok=False),
    "linear_cross_entropy": Op(
        _linear_ce_inputs, (0, 1), jaxops.linear_cross_entropy,
        lambda x, w, y: optax.softmax_cross_entropy_with_integer_labels(
            jnp.matmul(x, w, precision=_HIGHEST), y).mean(), "x", complex_ok=False),
    "gelu": Op(_rows, (0,), jaxops.gelu, jax.nn.gelu, "x"),
    "gelu_exact": Op(
        _rows, (0,), lambda x: jaxops.gelu(x, approximate=False),
        lambda x: jax.nn.gelu(x, approximate=False), "x", complex_ok=False),
    "silu": Op(_rows, (0,), jaxops.silu, jax.nn.silu, "x"),
    "swiglu": Op(_gated, (0, 1), jaxops.swiglu, lambda g, u: jax.nn.silu(g) * u, "gate"),
    "geglu": Op(_gated, (0, 1), jaxops.geglu, lambda g, u: jax.nn.gelu(g) * u, "gate"),
    "rope": Op(
        lambda rng, dtype: (_normal(rng, (1, _SEQ, _HEADS, _DIM), dtype),
                            jnp.arange(_SEQ) * 7), (0,),
        jaxops.rope, _rope_by_complex_multiplication, "x"),
    "embedding": Op(
        _embedding_inputs, (0,), jaxops.embedding,
        lambda table, ids: _flax(nn.Embed(_VOCAB, _DIM), {"embedding": table}, ids), "table"),
    "patch_embed": Op(
        lambda rng, dtype: (_normal(rng, (1, 4, 6, 3), dtype), _normal(rng, (2, 2, 3, _DIM), dtype),
                            _normal(rng, (_DIM,), dtype)), (0, 1, 2),
        lambda x, k, b, **kwargs: jaxops.patch_embed(x, k, b, patch_size=2, **kwargs),
        lambda x, k, b: _flax(nn.Conv(_DIM, (2, 2), strides=2, padding="VALID", precision=_HIGHEST),
                              {"kernel": k, "bias": b}, x).reshape(1, 6, _DIM), "images",
        complex_ok=False),
    # A 2:4 weight (traced compress keeps its nonzeros); x differentiated.
    "sparse_linear": Op(
        lambda rng, dtype: (_normal(rng, (_SEQ, _DIM), dtype), _normal(rng, (3, _DIM), dtype)
                            * jnp.asarray([1, 0, 0, 1, 0, 1, 1, 0], dtype)), (0,),
        lambda x, w, **k: jaxops.sparse.linear(x, jaxops.sparse.compress(jnp.real(w)), **k),
        lambda x, w: jnp.matmul(x, w.T, precision=_HIGHEST), "x", complex_ok=False),
}

DTYPES = {"float64": np.float64, "complex64": np.complex64}
# (rtol, atol) of values and gradients against the replaced function
_TOLERANCE = {"float64": (1e-10, 1e-12), "complex64": (2e-5, 2e-5)}


def _batched(rng, op, dtype):
  """Two independent draws of the op's inputs stacked on a leading axis."""
  first, second = op.inputs(rng, dtype), op.inputs(rng, dtype)
  return tuple(jnp.stack([a, b]) for a, b in zip(first, second))


def _values_and_grads(fn, args, grad_args):
  """jit of vmap of fn, and the gradient of sum |fn|^2 (real for complex outputs)."""
  def loss(*args):
    out = jax.vmap(fn)(*args)
    return sum(jnp.sum(jnp.abs(o) ** 2) for o in jax.tree.leaves(out)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, grad_args, has_aux=True))(*args)
  return out, grads


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(OPS))
def test_implementation_none_falls_back_to_the_reference(name, dtype_name):
  op, dtype = OPS[name], DTYPES[dtype_name]
  with jax.enable_x64(True):
    args = _batched(np.random.default_rng(0), op, dtype)
    if dtype_name == "complex64" and not op.complex_ok:
      with pytest.raises(TypeError, match=f"{op.ffi_argument} must have a floating dtype"):
        op.ours(*(a[0] for a in args))
      return
    ours, our_grads = _values_and_grads(op.ours, args, op.grad_args)
    theirs, their_grads = _values_and_grads(op.theirs, args, op.grad_args)
  rtol, atol = _TOLERANCE[dtype_name]
  for a, b in zip(jax.tree.leaves((ours, our_grads)), jax.tree.leaves((theirs, their_grads))):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                               atol=atol * max(1.0, float(np.max(np.abs(b)))))


# complex is refused whatever the implementation where it has no form (the test above)
_FFI_CASES = [(n, d) for n, op in OPS.items() for d in DTYPES if op.complex_ok or d == "float64"]


@pytest.mark.parametrize("name,dtype_name", _FFI_CASES)
def test_implementation_ffi_names_the_unsupported_dtype(name, dtype_name):
  op, dtype = OPS[name], DTYPES[dtype_name]
  with jax.enable_x64(True):
    args = op.inputs(np.random.default_rng(0), dtype)
    ffi = lambda *a, **k: op.ours(*a, **k, implementation="ffi")
    if name == "gelu_exact":
      ffi = lambda x: jaxops.gelu(x, approximate=False, implementation="ffi")
    with pytest.raises(TypeError, match=(
        f"implementation='ffi' has no kernel for {op.ffi_argument} of dtype {dtype_name}; "
        "the kernels support float32, bfloat16 and float16")):
      ffi(*args)


def test_integer_inputs_are_refused_whatever_the_implementation():
  for name, op in OPS.items():
    args = op.inputs(np.random.default_rng(0), np.float32)
    first = op.grad_args[0]
    args = (*args[:first], args[first].astype(jnp.int32), *args[first + 1:])
    for implementation in (None, "ffi", "xla"):
      call = (lambda *a: jaxops.gelu(*a, approximate=False, implementation=implementation)
              if name == "gelu_exact" else op.ours(*a, implementation=implementation))
      with pytest.raises(TypeError, match=r"must have a floating( or complex)? dtype, got int32"):
        call(*args)


def test_mixed_dtypes_promote_as_the_replaced_expression():
  """swiglu/geglu's gate and up, add_rms_norm's x and residual: promoted to the
  common dtype, as jax.nn.silu(gate) * up and x + residual are."""
  gate, up = _gated(np.random.default_rng(1), np.float32)
  np.testing.assert_allclose(jaxops.swiglu(gate, up.astype(jnp.bfloat16)),
                             jaxops.swiglu(gate, up.astype(jnp.bfloat16).astype(jnp.float32)))
  with jax.enable_x64(True):
    y = jaxops.geglu(gate, up.astype(jnp.complex64))
    assert y.dtype == jnp.complex64
    np.testing.assert_allclose(y, jax.nn.gelu(gate) * up, rtol=2e-5, atol=2e-6)
    _, h = jaxops.add_rms_norm(gate.astype(jnp.bfloat16), up.astype(jnp.float64))
    assert h.dtype == jnp.float64


# Ops whose float64 fallback is tested in their own files, because the table's
# checks differentiate (sample's and paged attention's results are not
# differentiable; the router's float64 path is checked with its integer ids).
OWN_FALLBACK_TESTS = {
    "sample": "tests/test_sampling.py::test_float64_logits_run_the_reference",
    "topk_router": "tests/test_routing.py::test_float64_takes_the_reference",
    "moe_aux_loss": "tests/test_routing.py::test_float64_takes_the_reference",
    "paged_attention": "tests/test_dtype_fallback.py::test_paged_attention_float64_runs_the_reference",
    "paged_kv_update": "tests/test_dtype_fallback.py::test_paged_attention_float64_runs_the_reference",
    # Called inside jax.shard_map only; the layout helpers reorder any dtype.
    "ring_attention": "tests/test_ring_attention.py::test_float64_runs_the_ring_on_the_reference",
    "zigzag_permute": "tests/test_ring_attention.py::"
                      "test_zigzag_permute_puts_chunks_i_and_2p_minus_1_minus_i_together",
    "zigzag_unpermute": "tests/test_ring_attention.py::"
                        "test_zigzag_permute_puts_chunks_i_and_2p_minus_1_minus_i_together",
}


def test_the_table_covers_every_public_op():
  ops = {n for n in jaxops.__all__ if callable(getattr(jaxops, n))}
  ops -= {"cpu_isa", "export_checks"}
  assert ops <= set(OPS) | set(OWN_FALLBACK_TESTS), ops - set(OPS) - set(OWN_FALLBACK_TESTS)


def test_paged_attention_float64_runs_the_reference():
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    pages = [jnp.asarray(rng.normal(size=(4, 2, 1, 8))) for _ in range(2)]
    rows = [jnp.asarray(rng.normal(size=(3, 1, 8))) for _ in range(2)]
    slots = jnp.asarray([0, 3, 6], jnp.int32)
    tables, lengths = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([4, 3], jnp.int32)
    query = jnp.asarray(rng.normal(size=(2, 2, 8)))
    updated = jaxops.paged_kv_update(*pages, *rows, slots)
    np.testing.assert_array_equal(updated[0], reference.paged_kv_update(*pages, *rows, slots)[0])
    out = jaxops.paged_attention(query, *updated, tables, lengths)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, reference.paged_attention(query, *updated, tables, lengths),
                               rtol=1e-12)
    with pytest.raises(TypeError, match="query"):
      jaxops.paged_attention(query, *updated, tables, lengths, implementation="ffi")
