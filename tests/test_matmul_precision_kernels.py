"""What the CUDA kernels with products inside compute under each float32
precision setting (docs/precision.md), against a float64 reference.

At the default precision the float32 products of attention (forward, backward,
forward mode) run on the TF32 tensor cores (mma.sync m16n8k8, operands rounded
to nearest, cuda/attention_fragments.cuh) and patch_embed's too (wmma
m16n16k8, operands rounded by ``wmma::__float_to_tf32``); at "highest" on the
CUDA cores in full float32. The harness counts the emulated tensor-core
instructions (mma.sync and wmma) by operand type, so a test sees which path
ran; on a GPU (JAXOPS_TEST_GPU=1) the same tests compare the results alone. The test session runs at "highest"
(tests/conftest.py): each test sets both contexts itself.

Tolerances. "highest" is float32: the suite's float32 tolerance for a
reduction as long as the op's (jaxops.testing.tolerance). The default is TF32:
rounding an operand to 10 explicit mantissa bits has a relative error of at
most u = 2^-11, so each term of a product is off by at most 2u of itself. With
unit-normal inputs the terms of a dot, and their errors, have random signs: a
dot's error grows like the square root of its length, as the dot does, and
stays a few u of the result's scale at every length (attention's 1/sqrt(head
dim) keeps its logits at unit scale too). Attention's results are two products
deep, and the softmax maps a logits error Δs to p (Δs - Σ p Δs), at most twice
Δs: an estimate of 2u + 2 * 2u = 6u of the result's scale, to which the test
allows 8u of its largest element (3.9e-3; measured up to 1.4u). It is an
estimate for such inputs, not a worst-case bound (that one grows with the
sums' lengths), and far from both float32's error (~1e-7) and a wrong product
(O(1)). patch_embed is one product deep and gets the same allowance. Each test
also checks that the default lands farther from float64 than float32's
tolerance: a TF32 result within it would mean the TF32 path did not run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops import reference
from jaxops.testing import assert_close, random_inputs, tolerance
from support import backends

FFI = {"implementation": "ffi"}
TF32_UNIT_ROUNDOFF = 2.0 ** -11
TF32_BOUND = 8 * TF32_UNIT_ROUNDOFF
KERNEL_BACKENDS = (backends.HARNESS, backends.GPU)


def _float64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _tensor_core_instructions(harness):
  """{operand type: emulated mma.sync and wmma instructions so far}."""
  return {o: harness.mma_syncs(o) + harness.wmma_mmas(o) for o in ("tf32", "half", "bfloat16")}


def _run(fn, setting, backend, *args):
  """(fn(*args) under the precision ``setting``, {operand type: tensor-core
  instructions} it ran in the harness; None on a GPU)."""
  harness = backends.harness() if backend == backends.HARNESS else None
  before = _tensor_core_instructions(harness) if harness else None
  with jax.default_matmul_precision(setting):
    result = jax.block_until_ready(jax.jit(fn)(*args))
  counts = ({o: n - before[o] for o, n in _tensor_core_instructions(harness).items()}
            if harness else None)
  return result, counts


def _check_both_settings(fn, args, expected, backend, reduce_size, tf32_instructions=None):
  """fn at "highest" within float32's tolerance of ``expected`` (float64), at the
  default within the TF32 bound and farther than float32's tolerance; in the
  harness, TF32 instructions ran at the default only (``tf32_instructions`` of
  them when given)."""
  highest, highest_counts = _run(fn, "highest", backend, *args)
  default, default_counts = _run(fn, "default", backend, *args)
  atol, rtol = tolerance(jnp.float32, reduce_size)
  far_from_float32 = False
  for name, got_highest, got_default, want in zip(
      _names(expected), jax.tree.leaves(highest), jax.tree.leaves(default),
      jax.tree.leaves(_float64(expected))):
    assert_close(got_highest, want, dtype=jnp.float32, reduce_size=reduce_size,
                 name=f"highest {name}")
    scale = np.abs(want).max()
    assert_close(got_default, want, atol=TF32_BOUND * scale, rtol=0.0, name=f"default {name}")
    error = np.abs(np.asarray(got_default, np.float64) - want)
    far_from_float32 |= bool((error > atol + rtol * np.abs(want)).any())
  assert far_from_float32, "the default's results are as close as float32's: no TF32 product"
  if backend == backends.HARNESS:
    assert highest_counts["tf32"] == 0
    assert default_counts["tf32"] > 0
    if tf32_instructions is not None:
      assert default_counts["tf32"] == tf32_instructions


def _names(tree):
  return [jax.tree_util.keystr(path) or "result"
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# -- attention ---------------------------------------------------------------------------------

# Head dims that select every float32 configuration of the tensor-core kernels
# (cuda/attention_forward.cu, _backward.cu, _jvp.cu pad the head dim to 64, 128
# or 256): 32, 80, 192; at "highest" the SIMT kernels' tile sizes (64x64
# throughout, 64x64 and 32x32, 32x32 and 16x16).
HEAD_DIMS = [32, 80, 192]
B, T, S, N, K = 1, 40, 56, 2, 1


def _attention_inputs(seed, head_dim):
  return random_inputs(seed, [(B, T, N, head_dim), (B, S, K, head_dim), (B, S, K, head_dim),
                              (B, T, N, head_dim)])


def _attention(q, k, v):
  return jaxops.attention(q, k, v, **FFI)


def _reference(q, k, v):
  return reference.attention_with_logsumexp(q, k, v)[0]


@pytest.mark.backends(*KERNEL_BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_forward(backend, head_dim):
  q, k, v, _ = _attention_inputs(0, head_dim)
  with jax.enable_x64(True):
    expected = _reference(*_float64((q, k, v)))
  tf32_instructions = None
  if head_dim == 32:
    # One block of 4 warps per head (64 query rows, the head dim padded to 64),
    # one tile of 64 keys; the 3 warps with rows below T = 40 each run
    # S = Q K^T (8 key tiles of 8 over 64 / 8 k-steps) and O += P V (8
    # column tiles of 8 over 64 / 8 k-steps) on mma.sync m16n8k8.
    tf32_instructions = N * 3 * (8 * 8 + 8 * 8)
  _check_both_settings(_attention, (q, k, v), expected, backend, S, tf32_instructions)


@pytest.mark.backends(*KERNEL_BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_vjp(backend, head_dim):
  q, k, v, dout = _attention_inputs(1, head_dim)

  def vjp(fn, q, k, v, dout):
    return jax.vjp(fn, q, k, v)[1](dout)

  with jax.enable_x64(True):
    expected = vjp(_reference, *_float64((q, k, v, dout)))
  _check_both_settings(lambda *a: vjp(_attention, *a), (q, k, v, dout), expected, backend,
                       max(S, head_dim))


@pytest.mark.backends(*KERNEL_BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_jvp(backend, head_dim):
  """Every tangent present: the fused kernel's tangent products dQ K^T + Q dK^T
  and e (ds - c) V + e dV all run (at "highest", the SIMT kernel's
  [dQ | Q] [K | dK]^T and [e (ds - c) | e] [V ; dV] over their full widths)."""
  q, k, v, dq = _attention_inputs(2, head_dim)
  dk, dv = random_inputs(3, [k.shape, v.shape])

  def jvp(fn, q, k, v, dq, dk, dv):
    return jax.jvp(fn, (q, k, v), (dq, dk, dv))

  with jax.enable_x64(True):
    expected = jvp(_reference, *_float64((q, k, v, dq, dk, dv)))
  _check_both_settings(lambda *a: jvp(_attention, *a), (q, k, v, dq, dk, dv), expected, backend,
                       max(S, 2 * head_dim))


@pytest.mark.backends(backends.HARNESS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_attention_does_not_depend_on_the_setting(backend, dtype):
  """16-bit products take their own tensor cores at every setting: the same
  instructions, the same results."""
  q, k, v, dout = (x.astype(dtype) for x in _attention_inputs(4, 32))
  fn = lambda q, k, v, dout: jax.vjp(_attention, q, k, v)[1](dout)
  operand = "bfloat16" if dtype == jnp.bfloat16 else "half"
  default, default_counts = _run(fn, "default", backend, q, k, v, dout)
  highest, highest_counts = _run(fn, "highest", backend, q, k, v, dout)
  assert default_counts == highest_counts and default_counts[operand] > 0
  assert default_counts["tf32"] == 0
  jax.tree.map(lambda a, b: assert_close(a, b, atol=0, rtol=0), default, highest)


# -- patch_embed -------------------------------------------------------------------------------

# 2 images of 24 x 24 x 3 in patches of 4: 72 patch rows of 48 pixels (more
# than a 64-row tile; a patch row spans two 32-column steps), D = 80 (two
# column tiles).
IMAGES, PATCH, DIM = (2, 24, 24, 3), 4, 80


def _embed(images, kernel, bias, implementation="ffi"):
  return jaxops.patch_embed(images, kernel, bias, patch_size=PATCH, implementation=implementation)


@pytest.mark.backends(*KERNEL_BACKENDS)
def test_patch_embed_forward_and_vjp(backend):
  images, kernel, bias = random_inputs(5, [IMAGES, (PATCH, PATCH, 3, DIM), (DIM,)])
  dtokens = random_inputs(6, [(2, (24 // PATCH) ** 2, DIM)])[0]

  def fwd_bwd(embed, images, kernel, bias, dtokens):
    tokens, vjp = jax.vjp(embed, images, kernel, bias)
    return tokens, vjp(dtokens)

  with jax.enable_x64(True):
    expected = fwd_bwd(lambda *a: _embed(*a, implementation="xla"),
                       *_float64((images, kernel, bias, dtokens)))
  rows = 2 * (24 // PATCH) ** 2
  _check_both_settings(lambda *a: fwd_bwd(_embed, *a), (images, kernel, bias, dtokens), expected,
                       backend, max(rows, DIM, PATCH * PATCH * 3))
