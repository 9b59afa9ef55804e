"""The CUDA kernels of the activations, rope, embedding and AdamW
(cuda/{activations,rope,embedding,adamw}.cu) executed on the CPU by the harness.

tests/cuda_harness compiles the unchanged kernels and CUDA FFI handlers with g++
and lowers the production primitives to them: the same public functions, custom
VJPs and batching rules as on a GPU. The tests are those of test_activations.py,
test_rope.py, test_embedding.py and test_adamw.py, run again here on shapes
that cover one and many blocks (the harness runs every CUDA thread, so shapes
stay small); every test asserts that kernels ran in the harness.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cuda_harness.fixtures import harness, kernels_ran  # noqa: F401  (autouse fixtures)
import test_activations as activations_tests
import test_adamw as adamw_tests
import test_embedding as embedding_tests
import test_rope as rope_tests
import jaxops
from jaxops import reference
from jaxops.testing import FLOAT_DTYPES, assert_close, assert_tree_close, random_inputs

DTYPE_IDS = lambda d: jnp.dtype(d).name


# -- activations ----------------------------------------------------------------------

ACTIVATIONS = activations_tests.OPS
ACTIVATION_IDS = activations_tests.OP_IDS


@pytest.mark.parametrize("name,fn,ref,arity", ACTIVATIONS, ids=ACTIVATION_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(), (7,), (13, 127), (3, 4099)], ids=str)
def test_activation_forward(name, fn, ref, arity, dtype, shape):
  activations_tests.test_forward_matches_reference(name, fn, ref, arity, dtype, shape)


@pytest.mark.parametrize("name,fn,ref,arity", ACTIVATIONS, ids=ACTIVATION_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1,), (5, 3), (2, 4099)], ids=str)
def test_activation_vjp(name, fn, ref, arity, dtype, shape):
  activations_tests.test_vjp_matches_reference(name, fn, ref, arity, dtype, shape)


@pytest.mark.parametrize("name,fn,ref,arity", ACTIVATIONS, ids=ACTIVATION_IDS)
def test_activation_vmap(name, fn, ref, arity):
  activations_tests.test_vmap_in_axes(name, fn, ref, arity)


def test_activation_special_values():
  activations_tests.test_special_values()


@pytest.mark.parametrize("name,fn", [
    ("gelu_tanh", functools.partial(jaxops.gelu, approximate=True)),
    ("gelu_erf", functools.partial(jaxops.gelu, approximate=False)),
    ("silu", jaxops.silu),
])
def test_activation_accuracy_in_ulps(name, fn):
  activations_tests.test_float32_accuracy_in_ulps(name, fn)


# -- rope ----------------------------------------------------------------------------

ROPE_CASES = [c for c in rope_tests.CASES if c[0] != rope_tests.SHAPES[-1]]
ROPE_IDS = [i for c, i in zip(rope_tests.CASES, rope_tests.CASE_IDS) if c in ROPE_CASES]


@pytest.mark.parametrize("shape,style,rotary_dim", ROPE_CASES, ids=ROPE_IDS)
@pytest.mark.parametrize("dtype,per_batch", [(jnp.float32, False), (jnp.bfloat16, True),
                                             (jnp.float16, True)],
                         ids=["float32-pos[S]", "bfloat16-pos[B,S]", "float16-pos[B,S]"])
def test_rope_forward(shape, style, rotary_dim, dtype, per_batch):
  rope_tests.test_forward_matches_reference(shape, style, rotary_dim, dtype, per_batch)


@pytest.mark.parametrize("style", rope_tests.STYLES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_rope_vjp(style, dtype):
  rope_tests.test_vjp_matches_reference((2, 7, 3, 10), style, 4, dtype)


def test_rope_large_positions_inverse_and_vmap():
  rope_tests.test_large_positions_and_theta()
  rope_tests.test_inverse_undoes_the_rotation_and_preserves_norms()
  rope_tests.test_vmap_in_axes("gptj")


# -- embedding -----------------------------------------------------------------------

EMBEDDING_CASES = embedding_tests.CASES[:-1]


@pytest.mark.parametrize("table_shape,ids_shape", EMBEDDING_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_embedding_forward_and_vjp(table_shape, ids_shape, dtype):
  embedding_tests.test_forward_matches_reference(table_shape, ids_shape, dtype)
  embedding_tests.test_vjp_matches_reference(table_shape, ids_shape, dtype)


def test_embedding_clamping_accumulation_and_vmap():
  embedding_tests.test_out_of_range_ids_are_clamped()
  embedding_tests.test_gradient_is_deterministic_and_accumulates_in_float32()
  embedding_tests.test_vmap_of_grad_and_grad_of_vmap()
  embedding_tests.test_no_ids_and_zero_width()


# -- adamw ---------------------------------------------------------------------------


def test_adamw_matches_optax():
  kwargs = dict(b1=0.8, b2=0.99, eps=1e-7, weight_decay=0.1)
  steps = 12
  ours, _ = adamw_tests._train(jaxops.optim.adamw(adamw_tests.SCHEDULE, **kwargs),
                               adamw_tests._params(), steps)
  theirs, _ = adamw_tests._train(optax.adamw(adamw_tests.SCHEDULE, **kwargs),
                                 adamw_tests._params(), steps)
  assert_tree_close(ours[-1], theirs[-1], atol=1e-6, rtol=1e-5)
  fused, _ = adamw_tests._train(jaxops.optim.adamw(adamw_tests.SCHEDULE, **kwargs),
                                adamw_tests._params(), steps, fused=True)
  assert_tree_close(fused[-1], ours[-1], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=DTYPE_IDS)
def test_adamw_low_precision(dtype):
  adamw_tests.test_low_precision_parameters(dtype)


# -- races ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_thread_order(harness, seed):
  """Threads and blocks in a random order: a result that depends on it is a
  race. The embedding gradient (row counts, scan, warp placement) is the one
  kernel here whose threads cooperate."""
  harness.configure("fibers", seed=seed)
  try:
    table, = random_inputs(seed, [(37, 9)])
    ids = jax.random.randint(jax.random.key(seed), (5, 61), -2, 40)
    dout, = random_inputs(seed + 10, [(5, 61, 9)])
    grad = jax.vjp(lambda t: jaxops.embedding(t, ids), table)[1](dout)[0]
    grad_ref = reference.embedding_grad(dout, ids, 37)
    assert_close(grad, grad_ref, atol=1e-5, rtol=1e-5)
    activations_tests.test_vjp_matches_reference(*ACTIVATIONS[3], jnp.bfloat16, (3, 700))
  finally:
    harness.configure()


def test_os_thread_mode(harness):
  harness.configure("threads")
  try:
    embedding_tests.test_vjp_matches_reference((31, 17), (4, 1, 9), jnp.float32)
    rope_tests.test_vjp_matches_reference((2, 7, 3, 10), "neox", None, jnp.float16)
  finally:
    harness.configure()


def test_embedding_gradient_is_bitwise_deterministic(harness):
  table, = random_inputs(7, [(16, 33)])
  ids = jax.random.randint(jax.random.key(8), (300,), 0, 16)
  dout, = random_inputs(9, [(300, 33)])
  grad_fn = jax.jit(lambda t, d: jax.vjp(lambda t: jaxops.embedding(t, ids), t)[1](d)[0])
  first = np.asarray(grad_fn(table, dout))
  for seed in (4, 5):
    harness.configure("fibers", seed=seed)
    try:
      np.testing.assert_array_equal(np.asarray(grad_fn(table, dout + 0.0)), first)
    finally:
      harness.configure()
