"""jaxops.sparse: the 2:4 packed weight, prune/compress/decompress, and linear
against its jnp reference (x @ decompress(w).T + bias).

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/sparse.cu) in the harness, whose shapes are small; the rest (packing,
rules, validation) are backend-independent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from jaxops.testing import (
    FLOAT_DTYPES,
    assert_close,
    assert_tree_close,
    check_transformations,
    custom_call_targets,
    derivative_against_reference,
    random_inputs,
    scalarize,
    upcast,
    vmap_against_loop,
)
from support import backends, meshes

sparse = jaxops.sparse


def _sparse_weight(seed, out, in_features, dtype=jnp.float32):
  (w,) = random_inputs(seed, [(out, in_features)], dtype)
  w_pruned, _ = sparse.prune_2_4(w)
  return w_pruned, sparse.compress(w_pruned)


def _reference(x, values, metadata, bias=None):
  return reference.sparse_linear(x, values, metadata, bias)


# -- packing ---------------------------------------------------------------------------


def test_prune_keeps_the_two_largest_magnitudes_ties_to_the_lower_index():
  w = jnp.array([[1.0, -3.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0],
                 [2.0, 2.0, 2.0, 2.0, -1.0, 1.0, 1.0, -5.0]])
  pruned, mask = sparse.prune_2_4(w)
  np.testing.assert_array_equal(mask, [[0, 1, 1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1]])
  np.testing.assert_array_equal(pruned, jnp.where(mask, w, 0.0))
  # A NaN counts as the largest, and every group keeps exactly two.
  _, mask = sparse.prune_2_4(jnp.array([[jnp.nan, jnp.nan, jnp.nan, 1.0]]))
  np.testing.assert_array_equal(mask, [[1, 1, 0, 0]])


def test_packed_layout_is_the_documented_one():
  # Row 0: groups keep (1, 2), (0, 3), (2, 3); row 1: a group of one nonzero and an empty one.
  w = jnp.array([[0, 5, 6, 0, 7, 0, 0, 8, 0, 0, 9, 10],
                 [0, 0, 0, 4, 0, 0, 0, 0, 1, 2, 0, 0]], jnp.float32)
  packed = sparse.compress(w)
  np.testing.assert_array_equal(packed.values, [[5, 6, 7, 8, 9, 10], [0, 4, 0, 0, 1, 2]])
  # Byte 0: positions of values 0..3, low bits first: 1, 2, 0, 3; byte 1: 2, 3 (high nibble unused).
  assert packed.metadata.dtype == jnp.uint8
  np.testing.assert_array_equal(packed.metadata[0], [1 | 2 << 2 | 0 << 4 | 3 << 6, 2 | 3 << 2])
  np.testing.assert_array_equal(packed.metadata[1], [0 | 3 << 2 | 0 << 4 | 1 << 6, 0 | 1 << 2])
  assert packed.shape == (2, 12) and packed.in_features == 12
  assert packed.nbytes == 2 * 6 * 4 + 2 * 2


@pytest.mark.parametrize("out,in_features,dtype", [
    (1, 4, jnp.float32), (7, 12, jnp.bfloat16), (3, 8, jnp.float16), (5, 4100, jnp.float32)],
    ids=lambda v: backends.param_id(v))
def test_compress_decompress_round_trip(out, in_features, dtype):
  w_pruned, packed = _sparse_weight(0, out, in_features, dtype)
  assert packed.values.shape == (out, in_features // 2) and packed.values.dtype == dtype
  assert packed.metadata.shape == (out, sparse.metadata_cols(in_features))
  np.testing.assert_array_equal(sparse.decompress(packed), w_pruned)
  # Under jit the packing is traced (no check) and gives the same leaves.
  traced = jax.jit(sparse.compress)(w_pruned)
  np.testing.assert_array_equal(traced.values, packed.values)
  np.testing.assert_array_equal(traced.metadata, packed.metadata)


def test_a_weight_without_rows_compresses_to_empty_leaves():
  """out = 0: empty values and metadata, concrete or traced, and a layer with
  no outputs (the packing once failed in numpy's reshape of 0 rows)."""
  w = jnp.zeros((0, 12), jnp.float32)
  for packed in (sparse.compress(w), jax.jit(sparse.compress)(w)):
    assert packed.values.shape == (0, 6) and packed.metadata.shape == (0, 2)
    assert sparse.decompress(packed).shape == (0, 12)
  assert sparse.linear(jnp.ones((3, 12)), sparse.compress(w)).shape == (3, 0)


def test_sparse_weight_is_a_pytree():
  _, packed = _sparse_weight(1, 3, 8)
  leaves, treedef = jax.tree.flatten(packed)
  assert [l.dtype for l in leaves] == [jnp.float32, jnp.uint8]
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert isinstance(rebuilt, sparse.SparseWeight) and rebuilt.in_features == 8
  doubled = jax.jit(lambda w: jax.tree.map(lambda v: v * 2 if v.dtype != jnp.uint8 else v, w))(packed)
  np.testing.assert_array_equal(doubled.values, 2 * packed.values)


def test_compress_names_the_first_dense_group():
  w = jnp.ones((3, 8)).at[:, 2:4].set(0.0).at[:, 6:8].set(0.0)
  w = w.at[1, 6].set(1.0)
  with pytest.raises(ValueError, match=r"row 1, group 1 \(columns 4..7\) has 3 nonzeros"):
    sparse.compress(w)
  with pytest.raises(ValueError, match="positive multiple of 4"):
    sparse.compress(jnp.ones((2, 6)))
  with pytest.raises(ValueError, match="positive multiple of 4"):
    sparse.prune_2_4(jnp.ones((2, 10)))
  with pytest.raises(ValueError, match=r"w must have rank 2"):
    sparse.compress(jnp.ones(8))
  with pytest.raises(TypeError, match="w must have a floating dtype"):
    sparse.compress(jnp.ones((2, 8), jnp.int32))


# -- linear: values ------------------------------------------------------------------

# Size-1 axes, one group, odd group counts, in = 4100 (vector steps and a tail),
# the GEMV path (<= 64 rows, 8-row blocks and a remainder) and the GEMM path.
SHAPES = [((1, 4), 1), ((3, 12), 7), ((8, 4100), 5), ((2, 3, 12), 130), ((67, 260), 19)]
# CUDA: one group, odd group counts, more rows than a warp's block of 8, more
# groups than a warp has lanes. bfloat16/float16 take the sparse tensor-core
# forward (16 outputs x 8 rows x 32 inputs per instruction): one row, `in` not a
# multiple of 32, `out` and rows not multiples of 16 and 8, several row tiles.
HARNESS_SHAPES = [((1, 4), 1), ((3, 12), 7), ((9, 36), 5), ((2, 260), 3), ((33, 68), 19)]


@backends.parametrize("x_shape,out,dtype", {
    backends.CPU: backends.with_dtypes(SHAPES, [SHAPES[2], SHAPES[4]]),
    backends.HARNESS: backends.with_dtypes(HARNESS_SHAPES[:4],
                                           [HARNESS_SHAPES[0], HARNESS_SHAPES[4]])})
def test_linear_matches_reference(backend, x_shape, out, dtype):
  (x, b) = random_inputs(1, [x_shape, (out,)], dtype)
  _, packed = _sparse_weight(2, out, x_shape[-1], dtype)
  for bias in (None, b):
    y = jax.jit(sparse.linear)(x, packed, bias)
    assert y.dtype == dtype and y.shape == x_shape[:-1] + (out,)
    expected = _reference(*upcast([x, packed.values]), packed.metadata,
                          None if bias is None else upcast(bias))
    assert_close(y, expected, dtype=dtype, reduce_size=x_shape[-1] // 2)


def test_linear_promotes_mixed_dtypes(backend):
  x = random_inputs(3, [(4, 16)], jnp.bfloat16)[0]
  _, packed = _sparse_weight(4, 6, 16, jnp.float32)
  y = sparse.linear(x, packed)
  assert y.dtype == jnp.float32
  assert_close(y, _reference(x.astype(jnp.float32), packed.values, packed.metadata))


def test_implementations_agree_and_kernel_is_used():
  x = random_inputs(5, [(10, 24)])[0]
  _, packed = _sparse_weight(6, 11, 24)
  assert_close(sparse.linear(x, packed, implementation="ffi"),
               sparse.linear(x, packed, implementation="xla"))
  assert custom_call_targets(functools.partial(sparse.linear, implementation="ffi"),
                             x, packed) == ["jaxops_sparse_linear_fwd"]
  assert "jaxops_" not in str(jax.make_jaxpr(
      functools.partial(sparse.linear, implementation="xla"))(x, packed))


@backends.parametrize("dtype", {backends.CPU: [jnp.float32],
                                backends.HARNESS: [jnp.float32, jnp.bfloat16]})
def test_equal_positions_add_like_decompress(backend, dtype):
  """Metadata naming one position twice or in descending order (not made by
  compress): every path adds like decompress (the tensor-core path reorders and
  merges them for the hardware)."""
  values = jnp.array([[1.0, 2.0, 3.0, 4.0]], dtype)
  metadata = jnp.array([[0b11_11_01_01]], jnp.uint8)
  packed = sparse.SparseWeight(values, metadata, 8)
  x = jnp.arange(1.0, 9.0, dtype=dtype)[None]
  np.testing.assert_array_equal(sparse.decompress(packed), [[0, 3, 0, 0, 0, 0, 0, 7]])
  assert_close(sparse.linear(x, packed), jnp.array([[2 * 3 + 8 * 7.0]], dtype), dtype=dtype)
  descending = sparse.SparseWeight(values, jnp.array([[0b01_10_00_11]], jnp.uint8), 8)
  assert_close(sparse.linear(x, descending), jnp.array([[4 * 1 + 1 * 2 + 7 * 3 + 6 * 4.0]], dtype),
               dtype=dtype)


@pytest.mark.backends(backends.HARNESS)
def test_low_precision_forward_takes_the_sparse_tensor_cores(harness):
  """bfloat16 (float16: the same template): one mma.sp per 16 outputs x 8 rows
  x 32 inputs, here over two blocks of 4 warps (67 outputs); float32: none."""
  x = random_inputs(7, [(9, 36)])[0]
  _, packed = _sparse_weight(8, 67, 36)
  for dtype, instructions in ((jnp.bfloat16, 5 * 2 * 2), (jnp.float32, 0)):
    values = packed.values.astype(dtype)
    before = harness.sparse_mmas()
    y = sparse.linear(x.astype(dtype), sparse.SparseWeight(values, packed.metadata, 36))
    assert harness.sparse_mmas() - before == instructions, dtype
    assert_close(y, _reference(*upcast([x.astype(dtype), values]), packed.metadata), dtype=dtype,
                 reduce_size=18)


@pytest.mark.parametrize("rows,dtype", [(13, jnp.float32), (37, jnp.float32), (21, jnp.bfloat16),
                                       (1, jnp.float32), (2, jnp.bfloat16), (8, jnp.float16)])
def test_gemv_blocks_chunks_and_any_metadata(rows, dtype):
  """The CPU GEMV paths with random metadata bytes (repeated and descending
  positions included) and 20 outputs, 500 values per row. float32 takes the
  rows-along-lanes GEMV: 13 rows in one block of 16 lanes, 37 rows in blocks of
  16, 16 and 5 (outputs in blocks of 4, the last one short). bfloat16 takes the
  k-chunked permute GEMV with AVX-512: row blocks of 4 and a remainder, a block
  of 18 outputs and a short one, several k-chunks and a tail; without AVX-512
  the rows-along-lanes GEMV (bfloat16/float16 rows converted per block of
  outputs). 1 and 2 rows: the permute GEMVs (AVX2: 8 values a step, 62 steps
  and a tail of 4); the generic variant's scalar rows-along-lanes GEMV (1 row)."""
  x = random_inputs(11, [(rows, 1000)], dtype)[0]
  values = random_inputs(12, [(20, 500)], dtype)[0]
  metadata = jax.random.randint(jax.random.key(13), (20, 125), 0, 256).astype(jnp.uint8)
  y = sparse.linear(x, sparse.SparseWeight(values, metadata, 1000))
  assert y.dtype == dtype
  assert_close(y, _reference(*upcast([x, values]), metadata), dtype=dtype, reduce_size=500)


# -- linear: NaN and infinities --------------------------------------------------------

# CPU: one row (the permute GEMV), 3 and 37 rows (the rows-along-lanes GEMV),
# 70 rows (the decompressed-panel GEMM), bfloat16/float16 GEMV. Harness: the
# float32 SIMT forward, the bfloat16/float16 tensor-core forward.
NON_FINITE_CASES = {
    backends.CPU: [(1, jnp.float32), (3, jnp.float32), (37, jnp.float32), (70, jnp.float32),
                   (2, jnp.bfloat16), (5, jnp.float16)],
    backends.HARNESS: [(3, jnp.float32), (9, jnp.bfloat16), (9, jnp.float16)]}


def _poisoned(x, entries):
  for (r, c), value in entries:
    x = x.at[r, c].set(value)
  return x


@backends.parametrize("rows,dtype", NON_FINITE_CASES)
def test_non_finite_x_reaches_the_outputs_that_prune_its_column(backend, rows, dtype):
  """The dense product multiplies every pruned zero, and 0 * NaN = 0 * inf =
  NaN: a NaN or infinite x[r, c] makes y[r, o] NaN wherever output o prunes
  column c (and NaN or +-inf where it keeps it), on every path, though the
  GEMV paths and the tensor-core forward multiply only the kept values."""
  in_features, out = 40, 13
  x, = random_inputs(14, [(rows, in_features)], dtype)
  _, packed = _sparse_weight(15, out, in_features, dtype)
  x = _poisoned(x, [((0, 5), np.nan), ((rows - 1, 22), np.inf), ((rows // 2, 35), -np.inf)])
  y = jax.jit(sparse.linear)(x, packed)
  expected = _reference(*upcast([x, packed.values]), packed.metadata)
  # The +inf row holds both kinds of outputs: NaN (pruned) and +inf (kept);
  # with one row, the NaN reaches every output.
  nan_counts = np.isnan(np.asarray(expected)).sum(axis=-1)
  assert 0 < nan_counts[rows - 1] < out if rows > 1 else nan_counts[0] == out
  assert_close(y, expected, dtype=dtype, reduce_size=in_features // 2)


@backends.parametrize("rows,dtype", NON_FINITE_CASES)
def test_non_finite_cotangent_reaches_the_pruned_columns(backend, rows, dtype):
  """dx = dy W multiplies the pruned zeros too: a NaN or infinite dy[r, o]
  makes dx[r, c] NaN at every column c that output o prunes."""
  in_features, out = 40, 13
  x, dy = random_inputs(16, [(rows, in_features), (rows, out)], dtype)
  _, packed = _sparse_weight(17, out, in_features, dtype)
  dy = _poisoned(dy, [((0, 3), np.nan), ((rows - 1, 7), np.inf), ((rows // 2, 11), -np.inf)])
  _, pullback = jax.vjp(lambda x: sparse.linear(x, packed), x)
  dx, = jax.jit(pullback)(dy)
  expected = reference.sparse_linear_dx(*upcast([dy, packed.values]), packed.metadata, in_features)
  nan_counts = np.isnan(np.asarray(expected)).sum(axis=-1)
  assert 0 < nan_counts[rows - 1] < in_features if rows > 1 else nan_counts[0] == in_features
  assert_close(dx, expected, dtype=dtype, reduce_size=out)


# -- linear: derivatives -------------------------------------------------------------

DERIVATIVE_SHAPES = [((1, 4), 1), ((3, 12), 7), ((2, 5, 36), 9), ((20, 64), 19)]
CPU_DERIVATIVE_SHAPES = [DERIVATIVE_SHAPES[i] for i in (0, 2, 3)]


@backends.parametrize("mode,x_shape,out,dtype", {
    backends.CPU: backends.with_dtypes([(m, *s) for m in ("vjp", "jvp") for s in CPU_DERIVATIVE_SHAPES],
                               [("vjp", *CPU_DERIVATIVE_SHAPES[1])]),
    backends.HARNESS: backends.with_dtypes([(m, *s) for m in ("vjp", "jvp") for s in DERIVATIVE_SHAPES[1:3]],
                                   [("vjp", *DERIVATIVE_SHAPES[2])])})
def test_derivatives_match_reference(backend, mode, x_shape, out, dtype):
  x, b = random_inputs(7, [x_shape, (out,)], dtype)
  _, packed = _sparse_weight(8, out, x_shape[-1], dtype)
  f = jax.jit(lambda x, v, b: sparse.linear(x, sparse.SparseWeight(v, packed.metadata,
                                                                     x_shape[-1]), b))
  r = lambda x, v, b: _reference(x, v, packed.metadata, b)
  rows = int(np.prod(x_shape[:-1]))
  derivative_against_reference(mode, f, r, [x, packed.values, b], dtype=dtype,
                               reduce_size=max(x_shape[-1], out, rows))


@pytest.mark.parametrize("rows,in_features,out,dtype", [
    (37, 1036, 70, jnp.float32), (5, 300, 129, jnp.float32), (29, 524, 67, jnp.bfloat16)])
def test_value_gradient_over_column_chunks_and_output_blocks(rows, in_features, out, dtype):
  """The CPU value gradient (the sampled product dy^T x at the kept columns):
  without AVX-512, each block of 64 outputs takes its dense product with x in
  chunks of 256 columns and keeps its values; column counts past the chunks
  and not a multiple of the vector width (1036, 300, 524: a scalar tail),
  several output blocks and a short last one, prime row counts. AVX-512 takes
  16 values a step and the same tail."""
  x, dy = random_inputs(21, [(rows, in_features), (rows, out)], dtype)
  _, packed = _sparse_weight(22, out, in_features, dtype)
  _, pullback = jax.vjp(lambda v: sparse.linear(x, sparse.SparseWeight(v, packed.metadata,
                                                                     in_features)), packed.values)
  dvalues, = jax.jit(pullback)(dy)
  _, reference_pullback = jax.vjp(lambda v: _reference(*upcast([x]), v, packed.metadata),
                                  upcast([packed.values])[0])
  expected, = reference_pullback(upcast([dy])[0])
  assert_close(dvalues, expected, dtype=dtype, reduce_size=rows)


def test_value_gradient_is_the_sampled_product_and_keeps_the_pattern(backend):
  x = random_inputs(9, [(6, 20)])[0]
  w_pruned, packed = _sparse_weight(10, 5, 20)
  grad = jax.grad(lambda w: jnp.sum(jnp.sin(sparse.linear(x, w))), allow_int=True)(packed)
  assert grad.metadata.dtype == jax.dtypes.float0
  dense_grad = jax.grad(lambda w: jnp.sum(jnp.sin(x @ w.T)))(w_pruned)
  kept = reference.sparse_2_4_columns(packed.metadata, 20)
  assert_close(grad.values, jnp.take_along_axis(dense_grad, kept, axis=-1))
  # One SGD step on the values keeps the dropped positions at zero.
  stepped = sparse.SparseWeight(packed.values - 0.1 * grad.values, packed.metadata, 20)
  dropped = ~np.asarray(sparse.prune_2_4(w_pruned)[1])
  assert not np.any(np.asarray(sparse.decompress(stepped))[dropped])


def test_check_grads_order_2():
  x, b = random_inputs(11, [(3, 8), (5,)])
  _, packed = _sparse_weight(12, 5, 8)
  f = lambda x, v, b: sparse.linear(x, sparse.SparseWeight(v, packed.metadata, 8), b)
  check_grads(f, (x, packed.values, b), order=2, atol=2e-2, rtol=2e-2)


def test_forward_mode_and_every_transformation():
  x, b = random_inputs(13, [(3, 12), (7,)])
  _, packed = _sparse_weight(14, 7, 12)
  f = lambda x, v, b: sparse.linear(x, sparse.SparseWeight(v, packed.metadata, 12), b)
  r = lambda x, v, b: _reference(x, v, packed.metadata, b)
  check_transformations(f, r, [x, packed.values, b], forward_kernel="jaxops_sparse_linear_fwd",
                        checkpoint_name="jaxops.sparse.linear", atol=1e-4, rtol=1e-4)


def test_each_mode_runs_the_kernels():
  """grad: the forward, dx and sampled dvalues kernels; jvp: the forward kernel."""
  x, b = random_inputs(15, [(4, 16), (6,)])
  _, packed = _sparse_weight(16, 6, 16)
  f = lambda x, v, b: sparse.linear(x, sparse.SparseWeight(v, packed.metadata, 16), b)
  grad = jax.grad(scalarize(f), argnums=(0, 1, 2))
  assert custom_call_targets(grad, x, packed.values, b) == [
      "jaxops_sparse_linear_fwd", "jaxops_sparse_linear_dx", "jaxops_sparse_linear_dvalues"]
  jvp = lambda *p: jax.jvp(f, p, p)
  assert set(custom_call_targets(jvp, x, packed.values, b)) == {"jaxops_sparse_linear_fwd"}


def test_vmap_in_axes(backend):
  x, b = random_inputs(17, [(3, 4, 12), (7,)])
  _, packed = _sparse_weight(18, 7, 12)
  f = lambda x, v, m, b: sparse.linear(x, sparse.SparseWeight(v, m, 12), b)
  v, m = packed.values, packed.metadata
  vmap_against_loop(f, [x, v, m, b], (0, None, None, None))
  vmap_against_loop(f, [jnp.moveaxis(x, 0, 1), v, m, b], (1, None, None, None))
  # A stacked sparse weight (and bias), with x shared or batched.
  stacked = [sparse.compress(sparse.prune_2_4(w)[0])
             for w in random_inputs(19, [(7, 12)] * 3)]
  vs = jnp.stack([s.values for s in stacked])
  ms = jnp.stack([s.metadata for s in stacked])
  bs = jnp.stack([b, 2 * b, -b])
  vmap_against_loop(f, [x[0], vs, ms, bs], (None, 0, 0, 0))
  vmap_against_loop(f, [x, vs, ms, None], (0, 0, 0, None))
  # Nested vmap over two leading axes of x.
  nested = jax.vmap(jax.vmap(f, in_axes=(0, None, None, None)), in_axes=(0, None, None, None))
  xs = jnp.stack([x, 2 * x])
  assert_close(nested(xs, v, m, b), _reference(xs, v, m, b))


def test_vmap_of_grad_and_grad_of_vmap(backend):
  x, b = random_inputs(20, [(4, 5, 16), (6,)])
  _, packed = _sparse_weight(21, 6, 16)
  f = lambda x, v, b: sparse.linear(x, sparse.SparseWeight(v, packed.metadata, 16), b)
  r = lambda x, v, b: _reference(x, v, packed.metadata, b)
  loss = lambda g: lambda *a: jnp.sum(jnp.sin(g(*a)))
  in_axes = (0, None, None)
  per_example = jax.vmap(jax.grad(loss(f), (0, 1, 2)), in_axes=in_axes)(x, packed.values, b)
  per_example_ref = jax.vmap(jax.grad(loss(r), (0, 1, 2)), in_axes=in_axes)(x, packed.values, b)
  assert_tree_close(per_example, per_example_ref, atol=5e-5, rtol=5e-5)
  summed = lambda g: lambda *a: jnp.sum(jax.vmap(loss(g), in_axes=in_axes)(*a))
  assert_tree_close(jax.grad(summed(f), (0, 1, 2))(x, packed.values, b),
                    jax.grad(summed(r), (0, 1, 2))(x, packed.values, b), atol=5e-5, rtol=5e-5)


# -- bad input -------------------------------------------------------------------------

_, _PACKED = _sparse_weight(22, 3, 8)


@pytest.mark.parametrize("call,error,match", [
    (lambda: sparse.linear(jnp.ones((2, 12)), _PACKED), ValueError,
     r"x must have a last axis of sparse_w's in = 8"),
    (lambda: sparse.linear(jnp.ones((2, 8), jnp.int32), _PACKED), TypeError,
     "x must have a floating dtype"),
    (lambda: sparse.linear(jnp.float32(1.0), _PACKED), ValueError, "x must have rank >= 1"),
    (lambda: sparse.linear(jnp.ones((2, 8)), jnp.ones((3, 8))), TypeError,
     "sparse_w must be a jaxops.sparse.SparseWeight"),
    (lambda: sparse.linear(jnp.ones((2, 8)), _PACKED, jnp.ones(4)), ValueError,
     r"bias must have shape \[out\] = \(3,\)"),
    (lambda: sparse.linear(jnp.ones((2, 8)), sparse.SparseWeight(
        _PACKED.values, _PACKED.metadata.astype(jnp.int32), 8)), TypeError,
     "sparse_w.metadata must have dtype uint8"),
    (lambda: sparse.linear(jnp.ones((2, 8)), sparse.SparseWeight(
        _PACKED.values, _PACKED.metadata[:, :0], 8)), ValueError,
     r"sparse_w.metadata must have shape \[out, ceil\(in / 8\)\]"),
    (lambda: sparse.linear(jnp.ones((2, 8)), sparse.SparseWeight(
        _PACKED.values[:, :3], _PACKED.metadata, 8)), ValueError,
     r"sparse_w.values must have shape \[out, in / 2\]"),
    (lambda: sparse.linear(jnp.ones((2, 6)), sparse.SparseWeight(
        _PACKED.values[:, :3], _PACKED.metadata, 6)), ValueError,
     "sparse_w.in_features must be a positive multiple of 4"),
    (lambda: sparse.linear(jnp.ones((2, 8)), _PACKED, implementation="cuda"), ValueError,
     "implementation must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("target,operands,results,match", [
    # y with the wrong number of outputs
    ("jaxops_sparse_linear_fwd", [np.ones((2, 8), np.float32), np.ones((3, 4), np.float32),
                                  np.zeros((3, 1), np.uint8), np.ones((0,), np.float32)],
     [((2, 4), np.float32)], "y has shape"),
    # metadata of the wrong width
    ("jaxops_sparse_linear_fwd", [np.ones((2, 8), np.float32), np.ones((3, 4), np.float32),
                                  np.zeros((3, 2), np.uint8), np.ones((0,), np.float32)],
     [((2, 3), np.float32)], "metadata has shape"),
    # odd values width (in not a multiple of 4)
    ("jaxops_sparse_linear_dx", [np.ones((2, 3), np.float32), np.ones((3, 3), np.float32),
                                 np.zeros((3, 1), np.uint8)],
     [((2, 6), np.float32)], "values must be"),
    # x rows unlike dy's
    ("jaxops_sparse_linear_dvalues", [np.ones((2, 3), np.float32), np.ones((4, 8), np.float32),
                                      np.zeros((3, 1), np.uint8)],
     [((3, 4), np.float32)], "x has shape"),
    # bias of the wrong length, integer data
    ("jaxops_sparse_linear_fwd", [np.ones((2, 8), np.float32), np.ones((3, 4), np.float32),
                                  np.zeros((3, 1), np.uint8), np.ones((5,), np.float32)],
     [((2, 3), np.float32)], "bias has shape"),
    ("jaxops_sparse_linear_dx", [np.ones((2, 3), np.int32), np.ones((3, 4), np.int32),
                                 np.zeros((3, 1), np.uint8)],
     [((2, 8), np.int32)], "unsupported dtype"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, match):
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(jax.jit(lambda *a: call(*a, allow_tf32=np.bool_(False)))(*operands))


# -- Flax --------------------------------------------------------------------------------


def test_linen_sparse_dense_matches_dense_on_the_pruned_kernel():
  import flax.linen as nn
  from jaxops.flax import linen

  x = random_inputs(23, [(3, 5, 16)])[0]
  dense = nn.Dense(7)
  dense_params = dense.init(jax.random.key(0), x)["params"]
  converted = linen.SparseDense.from_dense_params(dense_params)
  pruned = {"kernel": sparse.prune_2_4(dense_params["kernel"].T)[0].T,
            "bias": dense_params["bias"] + 0.5}
  converted["params"]["bias"] = pruned["bias"]
  layer = linen.SparseDense(7)
  assert_close(layer.apply(converted, x), dense.apply({"params": pruned}, x))
  # init gives packed parameters of the declared shapes; the positions are
  # integer state in their own collection, outside the trained parameters.
  variables = layer.init(jax.random.key(1), x)
  params, sparsity = variables["params"], variables["sparsity"]
  assert set(params) == {"kernel_values", "bias"} and params["kernel_values"].shape == (7, 8)
  assert params["bias"].shape == (7,) and sparsity["kernel_metadata"].dtype == jnp.uint8
  # bfloat16 compute, no bias; plain jax.grad over the params reaches values and bias.
  half = linen.SparseDense(7, use_bias=False, dtype=jnp.bfloat16)
  y = half.apply({"params": {"kernel_values": params["kernel_values"]}, "sparsity": sparsity}, x)
  assert y.dtype == jnp.bfloat16
  grads = jax.grad(lambda p: jnp.sum(layer.apply({"params": p, "sparsity": sparsity}, x) ** 2))(
      params)
  assert grads["kernel_values"].shape == (7, 8) and grads["bias"].shape == (7,)


def test_nnx_sparse_dense_matches_linear_on_the_pruned_kernel():
  from flax import nnx
  from jaxops.flax import nnx as jnnx

  x = random_inputs(24, [(4, 12)])[0]
  linear = nnx.Linear(12, 5, rngs=nnx.Rngs(0))
  layer = jnnx.SparseDense.from_linear(linear)
  pruned = sparse.prune_2_4(linear.kernel[...].T)[0].T
  assert_close(layer(x), x @ pruned + linear.bias[...])
  # nnx.grad over Params leaves the metadata (a SparseMetadata variable) alone.
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert sorted(leaf.shape for leaf in jax.tree.leaves(grads)) == [(5,), (5, 6)]
  fresh = jnnx.SparseDense(12, 5, rngs=nnx.Rngs(1), use_bias=False)
  assert fresh(x).shape == (4, 5) and fresh.bias is None


# -- sharding ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_sharded_over_tokens_and_out_runs_on_local_shards(kind):
  """x's tokens on "data", the weight's out on "model": values and gradients as
  unsharded, the kernels in the program, no all-gather."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  axis_type = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = meshes.make_mesh((4, 2), ("data", "model"), axis_type[kind])
  x, b = random_inputs(25, [(8, 6, 32), (16,)])
  _, packed = _sparse_weight(26, 16, 32)
  args = [x, packed.values, packed.metadata, b]
  specs = [P("data"), P("model"), P("model"), P("model")]

  def loss(x, v, m, b):
    return jnp.sum(jnp.sin(sparse.linear(x, sparse.SparseWeight(v, m, 32), b)))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3)))
  expected = step(*args)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    compiled = step.lower(*placed).compile()
    result = compiled(*placed)
  assert_tree_close(result, expected, atol=1e-5, rtol=1e-5)
  hlo = compiled.as_text()
  for target in ("jaxops_sparse_linear_fwd", "jaxops_sparse_linear_dx",
                 "jaxops_sparse_linear_dvalues"):
    assert target in hlo
  assert "all-gather" not in hlo
