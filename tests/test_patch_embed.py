"""patch_embed against its jnp reference (lax.conv_general_dilated + adds).

Tests taking `backend` run on the CPU kernels and on the CUDA kernels
(cuda/patch_embed.cu) in the harness (tests/support/backends.py); the harness's
shapes straddle the CUDA tiles (64 patch rows x 64 columns, steps of 32) and
stay small. The rest (rules, kernel selection, validation) are backend-independent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from jaxops import reference
from support import backends, meshes
from jaxops import testing

# (batch, height, width, channels, patch, dim): p = 1, 3, 16; C = 1, 3;
# D = 1, 7, primes; H != W; a single patch and a single pixel; an even patch
# length and D a multiple of 16 (bfloat16: the AVX512_BF16 path where the CPU has it;
# float32: the kernel read in place); more patch rows than one 48-row panel, in
# a partial last panel (60 rows), with class-token rows stored by both threads.
CPU_CASES = [(1, 1, 1, 1, 1, 1), (2, 6, 9, 3, 3, 7), (3, 5, 10, 1, 5, 31),
             (2, 32, 16, 3, 16, 17), (3, 8, 4, 2, 2, 48), (5, 28, 21, 2, 7, 32)]
# CUDA: more than one 64-row tile of patches (2 x 7 x 5 = 70), a patch longer
# than a 64-column tile (3 x 3 x 8 = 72), D past one tile (67).
HARNESS_CASES = [(1, 1, 1, 1, 1, 1), (2, 21, 15, 1, 3, 7), (1, 6, 3, 8, 3, 67)]
DERIVATIVE_CASES = [(1, 1, 1, 1, 1, 1), (2, 6, 9, 3, 3, 7), (2, 32, 16, 3, 16, 17)]
HARNESS_DERIVATIVES = [(2, 21, 15, 1, 3, 7), (1, 6, 3, 8, 3, 67)]
# All, none, each alone, and pos_embed with the class token (its row 0).
OPTIONAL = [dict(bias=b, pos=p, cls=c) for b, p, c in
            [(True, True, True), (False, False, False), (True, False, False),
             (False, True, False), (False, False, True), (False, True, True)]]


def make_args(seed, case, dtype, *, bias=True, pos=True, cls=True):
  """[images, kernel, bias, pos_embed, cls_token] (None where absent), patch_size."""
  b, h, w, c, p, d = case
  tokens = (h // p) * (w // p) + (1 if cls else 0)
  images, kernel, bias_v, pos_v, cls_v = testing.random_inputs(
      seed, [(b, h, w, c), (p, p, c, d), (d,), (tokens, d), (d,)], dtype)
  kernel = (kernel / np.sqrt(p * p * c)).astype(dtype)
  return [images, kernel, bias_v if bias else None, pos_v if pos else None,
          cls_v if cls else None], p


def _bind(fn, args, patch_size, **kwargs):
  """fn as a function of the present (non-None) arrays only."""
  where = [i for i, a in enumerate(args) if a is not None]

  def f(*arrays):
    full = list(args)
    for i, a in zip(where, arrays):
      full[i] = a
    images, kernel, bias, pos, cls = full
    return fn(images, kernel, bias, patch_size=patch_size, pos_embed=pos, cls_token=cls,
              **kwargs)

  return f, [args[i] for i in where]


def _reduce_size(case):
  b, h, w, c, p, d = case
  return max(p * p * c, b * (h // p) * (w // p) + 1)


# Low precision on the cases that take the bf16 dot-product path (even patch
# length, D a multiple of 16) and a CUDA case past one tile.
@backends.parametrize("case,dtype", {
    backends.CPU: backends.with_dtypes([(c,) for c in CPU_CASES],
                                     [(CPU_CASES[1],), (CPU_CASES[4],), (CPU_CASES[5],)]),
    backends.HARNESS: backends.with_dtypes([(c,) for c in HARNESS_CASES], [(HARNESS_CASES[2],)])})
def test_forward_matches_reference(backend, case, dtype):
  args, p = make_args(0, case, dtype)
  f, present = _bind(jaxops.patch_embed, args, p)
  r, _ = _bind(reference.patch_embed, args, p)
  out = jax.jit(f)(*present)
  assert out.dtype == jnp.dtype(dtype)
  assert out.shape == (case[0], (case[1] // p) * (case[2] // p) + 1, case[5])
  testing.assert_tree_close(out, r(*testing.upcast(present)), dtype=dtype, reduce_size=p * p * case[3])


@pytest.mark.parametrize("dtype", testing.FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@backends.parametrize("mode,case", {
    backends.CPU: [(m, c) for m in ("vjp", "jvp") for c in DERIVATIVE_CASES],
    backends.HARNESS: [(m, c) for m in ("vjp", "jvp") for c in HARNESS_DERIVATIVES]})
def test_derivatives_match_reference(backend, mode, case, dtype):
  args, p = make_args(2, case, dtype)
  f, present = _bind(jax.jit(jaxops.patch_embed, static_argnames="patch_size"), args, p)
  r, _ = _bind(reference.patch_embed, args, p)
  testing.derivative_against_reference(mode, f, r, present, dtype=dtype, reduce_size=_reduce_size(case))


# Which operands are present changes only pointers the kernels test for null:
# every combination on the CPU; the harness runs them all present, and its
# sanitizer driver all present and all absent.
@pytest.mark.backends(backends.CPU)
@pytest.mark.parametrize("optional", OPTIONAL, ids=lambda o: "-".join(k for k, v in o.items() if v) or "none")
def test_optional_operands(backend, optional):
  case = (2, 6, 4, 3, 2, 9)
  args, p = make_args(1, case, jnp.float32, **optional)
  f, present = _bind(jaxops.patch_embed, args, p)
  r, _ = _bind(reference.patch_embed, args, p)
  for mode in ("vjp", "jvp"):
    testing.derivative_against_reference(mode, f, r, present, reduce_size=_reduce_size(case))


def test_check_grads_order_2():
  args, p = make_args(3, (2, 4, 6, 2, 2, 5), jnp.float32)
  f, present = _bind(jaxops.patch_embed, args, p)
  check_grads(f, present, order=2, atol=2e-2, rtol=2e-2)


def test_forward_mode_and_every_transformation():
  args, p = make_args(4, (2, 4, 2, 3, 2, 3), jnp.float32)
  f, present = _bind(jaxops.patch_embed, args, p)
  r, _ = _bind(reference.patch_embed, args, p)
  testing.check_transformations(f, r, present, forward_kernel="jaxops_patch_embed_fwd",
                        checkpoint_name="jaxops.patch_embed", atol=1e-4, rtol=1e-4)


def test_each_mode_runs_the_fused_kernels():
  """grad: the forward and the one backward kernel; jvp: the forward kernel for
  the value and for each of the two bilinear tangent terms."""
  args, p = make_args(5, (2, 4, 4, 3, 2, 16), jnp.float32)
  f, present = _bind(jaxops.patch_embed, args, p)
  grad = jax.grad(testing.scalarize(f), argnums=tuple(range(len(present))))
  assert testing.custom_call_targets(grad, *present) == ["jaxops_patch_embed_fwd",
                                                 "jaxops_patch_embed_bwd"]
  jvp = lambda *a: jax.jvp(f, a, a)
  assert testing.custom_call_targets(jvp, *present) == ["jaxops_patch_embed_fwd"] * 3


def test_vmap_in_axes(backend):
  args, p = make_args(6, (2, 4, 6, 3, 2, 7), jnp.float32)
  f, present = _bind(jaxops.patch_embed, args, p)
  images, rest = present[0], present[1:]
  stacked = jnp.stack([images * (1 + 0.1 * i) for i in range(3)])
  # Images batched on axis 0, then on their channel axis (folded into the batch).
  testing.vmap_against_loop(f, [stacked] + rest, (0,) + (None,) * len(rest))
  testing.vmap_against_loop(f, [jnp.moveaxis(stacked, 0, 4)] + rest, (4,) + (None,) * len(rest))
  # Every operand batched (the batched parameters take the reference path).
  batched = [jnp.stack([a + 0.1 * i for i in range(3)]) for a in present]
  testing.vmap_against_loop(f, batched, (0,) * len(present))


@pytest.mark.backends(backends.CPU)
def test_vmap_of_grad(backend):
  """Per-example gradients of every operand (the reference under vmap), and the
  image gradient alone (folded into the batch of one backward kernel call)."""
  args, p = make_args(7, (1, 4, 4, 3, 2, 5), jnp.float32)
  f, present = _bind(jaxops.patch_embed, args, p)
  r, _ = _bind(reference.patch_embed, args, p)
  stacked = jnp.stack([present[0] * (1 + 0.2 * i) for i in range(3)])
  in_axes = (0,) + (None,) * (len(present) - 1)
  for argnums in (tuple(range(len(present))), (0,)):
    got = jax.vmap(jax.grad(testing.scalarize(f), argnums), in_axes=in_axes)(stacked, *present[1:])
    want = jax.vmap(jax.grad(testing.scalarize(r), argnums), in_axes=in_axes)(stacked, *present[1:])
    testing.assert_tree_close(got, want, atol=5e-5, rtol=5e-5)


def test_implementations_agree():
  args, p = make_args(8, (2, 6, 9, 3, 3, 7), jnp.float32)
  f = functools.partial(jaxops.patch_embed, args[0], args[1], args[2], patch_size=p,
                        pos_embed=args[3], cls_token=args[4])
  testing.assert_tree_close(f(implementation="ffi"), f(implementation="xla"))
  assert "jaxops_patch_embed_fwd" in str(jax.make_jaxpr(lambda: f(implementation="ffi"))())
  assert "jaxops_" not in str(jax.make_jaxpr(lambda: f(implementation="xla"))())


def test_vision_transformer_shapes_are_accepted():
  """google-research/vision_transformer keeps cls [1, 1, D] and pos [1, N + 1, D]."""
  args, p = make_args(9, (2, 4, 4, 3, 2, 5), jnp.float32)
  images, kernel, bias, pos, cls = args
  out = jaxops.patch_embed(images, kernel, bias, patch_size=p, pos_embed=pos[None],
                           cls_token=cls[None, None])
  testing.assert_tree_close(out, jaxops.patch_embed(images, kernel, bias, patch_size=p, pos_embed=pos,
                                            cls_token=cls))


# -- bad input -------------------------------------------------------------------

_IMG = jnp.ones((2, 8, 12, 3))
_KER = jnp.ones((4, 4, 3, 5))


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxops.patch_embed(jnp.ones((2, 9, 12, 3)), _KER, patch_size=4), ValueError,
     "images must have a height that is a positive multiple of patch_size=4"),
    (lambda: jaxops.patch_embed(jnp.ones((2, 8, 10, 3)), _KER, patch_size=4), ValueError,
     "images must have a width that is a positive multiple of patch_size=4"),
    (lambda: jaxops.patch_embed(jnp.ones((8, 12, 3)), _KER, patch_size=4), ValueError,
     r"images must have rank 4: \[B, H, W, C\]"),
    (lambda: jaxops.patch_embed(_IMG, jnp.ones((4, 4, 2, 5)), patch_size=4), ValueError,
     "kernel must have shape"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=2), ValueError, "kernel must have shape"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=0), ValueError, "patch_size must be >= 1"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=4.0), TypeError, "patch_size must be a Python int"),
    (lambda: jaxops.patch_embed(_IMG, _KER, jnp.ones(4), patch_size=4), ValueError, "bias must have shape"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=4, pos_embed=jnp.ones((7, 5))), ValueError,
     "pos_embed must have shape"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=4, pos_embed=jnp.ones((6, 5)),
                                cls_token=jnp.ones(5)), ValueError, "pos_embed must have shape"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=4, cls_token=jnp.ones((1, 5))), ValueError,
     "cls_token must have shape"),
    (lambda: jaxops.patch_embed(_IMG, _KER.astype(jnp.bfloat16), patch_size=4), TypeError,
     r"kernel must have the dtype of images \(float32\)"),
    (lambda: jaxops.patch_embed(_IMG.astype(jnp.int32), _KER, patch_size=4), TypeError,
     "images must have a floating dtype"),
    (lambda: jaxops.patch_embed(_IMG, _KER, patch_size=4, implementation="cuda"), ValueError,
     "implementation must be one of"),
])
def test_bad_input_is_a_clear_error(call, error, match):
  with pytest.raises(error, match=match):
    call()


_F32 = np.float32


@pytest.mark.parametrize("target,operands,results,attrs,match", [
    # tokens shaped unlike [B, N, D]
    ("jaxops_patch_embed_fwd", [np.ones((1, 4, 4, 3), _F32), np.ones((2, 2, 3, 5), _F32)]
     + [np.ones((0,), _F32)] * 3, [((1, 5, 5), _F32)], {"patch_size": np.int64(2)},
     "tokens has shape"),
    # height not a multiple of the patch
    ("jaxops_patch_embed_fwd", [np.ones((1, 5, 4, 3), _F32), np.ones((2, 2, 3, 5), _F32)]
     + [np.ones((0,), _F32)] * 3, [((1, 4, 5), _F32)], {"patch_size": np.int64(2)},
     "not multiples of patch_size"),
    # kernel for another patch size
    ("jaxops_patch_embed_fwd", [np.ones((1, 4, 4, 3), _F32), np.ones((2, 2, 3, 5), _F32)]
     + [np.ones((0,), _F32)] * 3, [((1, 1, 5), _F32)], {"patch_size": np.int64(4)},
     "kernel has shape"),
    # pos_embed of the wrong length
    ("jaxops_patch_embed_fwd", [np.ones((1, 4, 4, 3), _F32), np.ones((2, 2, 3, 5), _F32),
                                np.ones((0,), _F32), np.ones((3, 5), _F32), np.ones((0,), _F32)],
     [((1, 4, 5), _F32)], {"patch_size": np.int64(2)}, "pos_embed has shape"),
    # a gradient that is wanted but sized as absent
    ("jaxops_patch_embed_bwd", [np.ones((1, 4, 5), _F32), np.ones((1, 4, 4, 3), _F32),
                                np.ones((2, 2, 3, 5), _F32)],
     [((0,), _F32), ((2, 2, 3, 5), _F32)] + [((0,), _F32)] * 3,
     {"patch_size": np.int64(2), "wanted": np.int64(1)}, "dimages has shape"),
    # a class-token gradient without a class-token row
    ("jaxops_patch_embed_bwd", [np.ones((1, 4, 5), _F32), np.ones((1, 4, 4, 3), _F32),
                                np.ones((2, 2, 3, 5), _F32)],
     [((0,), _F32)] * 4 + [((5,), _F32)], {"patch_size": np.int64(2), "wanted": np.int64(16)},
     "no class-token row"),
])
def test_handler_rejects_inconsistent_buffers(target, operands, results, attrs, match):
  """A handler fed buffers the public API never passes returns an error, never crashes."""
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(s, d) for s, d in results])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(*operands, **attrs, allow_tf32=np.bool_(False)))


# -- sharding --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_batch_and_dim_shard_locally(kind):
  """Images sharded over the batch and the kernel over D (tensor parallelism):
  values and every gradient equal the unsharded run, with no all-gather."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  axis_type = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = meshes.make_mesh((4, 2), ("data", "model"), axis_type[kind])
  args, p = make_args(10, (8, 4, 6, 3, 2, 16), jnp.float32)
  f, present = _bind(jaxops.patch_embed, args, p)
  specs = [P("data"), P(None, None, None, "model"), P("model"), P(None, "model"), P("model")]
  step = jax.jit(jax.value_and_grad(testing.scalarize(f), argnums=tuple(range(5))))
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(present, specs)]
    compiled = step.lower(*placed).compile()
    testing.assert_tree_close(compiled(*placed), step(*present), atol=1e-4, rtol=1e-4)
  hlo = compiled.as_text()
  assert "jaxops_patch_embed_fwd" in hlo and "jaxops_patch_embed_bwd" in hlo
  assert "all-gather" not in hlo
