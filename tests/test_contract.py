"""The contract of each op lives once, in C++: these tests fail when Python and
C++ disagree on it.

Each target's name, the attributes its handlers bind (name and type) and the
size of its hidden workspace are declared in xla_ffi/<family>_common.h, bound
and registered by the handlers from those declarations, and exported by the
nanobind modules (``contract()``, ``workspace()``, ``limits()``), which the
Python side reads (jaxops/_src/ffi_targets.py). Checked here: every module
registers exactly the targets it declares, the CPU and CUDA modules declare
the same, every primitive's target is declared, and what the primitives lower
to, on the CPU and for CUDA, carries the declared attribute types and the
workspace the C++ function sizes.
"""

import importlib

import jax
import jax.numpy as jnp
import pytest

import jaxops
from jaxops._src import ffi_targets
from jaxops._src.primitive import ALL_PRIMITIVES, FfiPrimitive
from support.lowering import contract_attribute_types, contract_workspace, custom_calls


def _modules():
  modules = {"cpu": importlib.import_module("jaxops._jaxops_cpu")}
  try:
    modules["cuda"] = importlib.import_module("jaxops._jaxops_cuda")
  except ImportError:  # a build without nvcc
    pass
  return modules


KERNEL_TARGETS = sorted({p.target for p in ALL_PRIMITIVES if p.target is not None})


@pytest.mark.parametrize("platform", list(_modules()))
def test_each_module_registers_exactly_the_targets_it_declares(platform):
  module = _modules()[platform]
  assert sorted(module.registrations()) == sorted(module.contract())


def test_the_cpu_and_cuda_modules_declare_the_same_contract():
  modules = _modules()
  if "cuda" not in modules:
    pytest.skip("no nvcc: the build is CPU-only")
  assert modules["cuda"].contract() == modules["cpu"].contract()
  assert modules["cuda"].limits() == modules["cpu"].limits()


@pytest.mark.parametrize("platform", list(_modules()))
def test_every_primitive_target_is_declared_and_nothing_else(platform):
  assert KERNEL_TARGETS == sorted(_modules()[platform].contract())


@pytest.mark.parametrize("prim", [p for p in ALL_PRIMITIVES if p.target is not None],
                         ids=lambda p: p.name)
def test_reference_params_are_not_kernel_attributes(prim):
  assert prim.contract == ffi_targets.contract(prim.target)
  assert not set(prim.reference_params) & set(prim.contract.attributes)


def test_a_target_cpp_does_not_declare_is_an_error_at_definition():
  count = len(ALL_PRIMITIVES)
  with pytest.raises(KeyError, match="jaxops_no_such_op"):
    FfiPrimitive(name="jaxops_no_such_op", target="jaxops_no_such_op",
                 abstract_eval=lambda x: (x,), reference=lambda x: (x,))
  assert len(ALL_PRIMITIVES) == count


def test_workspace_functions_reject_bad_queries_with_exceptions():
  module = _modules()["cpu"]
  with pytest.raises(IndexError):
    module.workspace("jaxops_layer_norm_bwd", [], {"groups": 1}, "cpu")
  with pytest.raises(ValueError):
    module.workspace("jaxops_layer_norm_bwd", [[4], [4, 8]], {"groups": 0}, "cpu")
  with pytest.raises(IndexError, match="rotary_dim"):
    module.workspace("jaxops_rope", [[1, 2, 1, 4], [1, 2]], {}, "cpu")
  with pytest.raises(ValueError, match="no workspace"):
    module.workspace("jaxops_rms_norm_fwd", [[2, 4], [4]], {}, "cpu")
  with pytest.raises(ValueError, match="platform"):
    module.workspace("jaxops_rope", [[1, 2, 1, 4], [1, 2]], {"rotary_dim": 4}, "tpu")


def test_python_reads_the_cuda_head_dim_limit_from_cpp():
  from jaxops._src import attention

  assert attention._CUDA_MAX_HEAD_DIM == _modules()["cpu"].limits()["cuda_attention_max_head_dim"]


# -- what the primitives lower to -------------------------------------------------------

def _vjp(f):
  def fwd_bwd(*args):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(y)

  return fwd_bwd


def _jvp(f):
  return lambda *args: jax.jvp(f, args, args)


def _grad(f):
  return jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=tuple(range(1)))


FFI = {"implementation": "ffi"}
X = jnp.linspace(-2, 2, 4 * 6 * 40, dtype=jnp.float32).reshape(4, 6, 40)
W = jnp.linspace(0.5, 1.5, 40, dtype=jnp.float32)
LABELS = jnp.arange(24).reshape(4, 6) % 40
Q = jnp.linspace(-1, 1, 2 * 5 * 4 * 16, dtype=jnp.float32).reshape(2, 5, 4, 16)
KV = Q[:, :, :2]
ROPE_X = Q
TABLE = X[0]
IDS = jnp.arange(8).reshape(2, 4) % 6

# name -> (function, arguments): together they reach every kernel target.
PROGRAMS = {
    "layer_norm": (_vjp(lambda x, w: jaxops.layer_norm(x, w, w, **FFI)), (X, W)),
    "layer_norm_jvp": (_jvp(lambda x, w: jaxops.layer_norm(x, w, w, **FFI)), (X, W)),
    "per_example_layer_norm": (jax.vmap(jax.grad(
        lambda x, w: jaxops.layer_norm(x, w, **FFI).sum(), argnums=1), in_axes=(0, None)),
        (X, W)),
    "rms_norm": (_vjp(lambda x, w: jaxops.rms_norm(x, w, **FFI)), (X, W)),
    "rms_norm_jvp": (_jvp(lambda x, w: jaxops.rms_norm(x, w, **FFI)), (X, W)),
    "add_rms_norm": (_vjp(lambda x, r, w: jaxops.add_rms_norm(x, r, w, **FFI)), (X, X, W)),
    "gelu": (_vjp(lambda x: jaxops.gelu(x, approximate=True, **FFI)), (X,)),
    "silu": (_vjp(lambda x: jaxops.silu(x, **FFI)), (X,)),
    "swiglu": (_vjp(lambda g, u: jaxops.swiglu(g, u, **FFI)), (X, X)),
    "geglu": (_vjp(lambda g, u: jaxops.geglu(g, u, False, **FFI)), (X, X)),
    "softmax": (_vjp(lambda x: jaxops.softmax(x, **FFI)), (X,)),
    "softmax_jvp": (_jvp(lambda x: jaxops.softmax(x, **FFI)), (X,)),
    "log_softmax": (_vjp(lambda x: jaxops.log_softmax(x, **FFI)), (X,)),
    "log_softmax_jvp": (_jvp(lambda x: jaxops.log_softmax(x, **FFI)), (X,)),
    "causal_softmax": (_vjp(lambda x: jaxops.causal_softmax(x, query_offset=2, **FFI)), (X,)),
    "causal_softmax_jvp": (_jvp(lambda x: jaxops.causal_softmax(x, query_offset=2, **FFI)),
                           (X,)),
    "cross_entropy": (_vjp(lambda x: jaxops.cross_entropy(x, LABELS, label_smoothing=0.1, **FFI)),
                      (X,)),
    "cross_entropy_jvp": (_jvp(lambda x: jaxops.cross_entropy(x, LABELS, z_loss=1e-4, **FFI)),
                          (X,)),
    "linear_cross_entropy": (jax.grad(lambda x, w: jaxops.linear_cross_entropy(
        x, w, LABELS[0], **FFI), argnums=(0, 1)), (X[0, :, :16], X[0].T[:16])),
    "rope": (_vjp(lambda x: jaxops.rope(x, jnp.arange(5), rotary_dim=8, **FFI)), (ROPE_X,)),
    "embedding": (_vjp(lambda t: jaxops.embedding(t, IDS, **FFI)), (TABLE,)),
    "adamw": (lambda p: jaxops.optim.adamw(1e-3, weight_decay=0.1, **FFI).step(
        p, jaxops.optim.adamw(1e-3, **FFI).init(p), p), ({"a": W},)),
    "attention": (_vjp(lambda q, k, v: jaxops.attention(q, k, v, is_causal=True, **FFI)),
                  (Q, KV, KV)),
    "attention_jvp": (_jvp(lambda q, k, v: jaxops.attention(q, k, v, local_window_size=(2, 1),
                                                            **FFI)), (Q, KV, KV)),
    "paged_attention": (lambda q, pages: jaxops.paged_attention(
        q, pages, pages, jnp.array([[0, 1], [1, 0]], jnp.int32), jnp.array([7, 3], jnp.int32),
        logits_soft_cap=5.0, local_window_size=4, **FFI), (Q[:, 0], Q)),
    "paged_kv_update": (lambda pages, rows: jaxops.paged_kv_update(
        pages, pages, rows, rows, jnp.arange(5, dtype=jnp.int32), **FFI), (Q, Q[0])),
    "sample": (lambda x: jaxops.sample(jax.random.key(0), x[0], top_k=5, top_p=0.9, **FFI),
               (X,)),
    "topk_router": (_vjp(lambda x: jaxops.topk_router(x, 3, num_groups=4, group_topk=2,
                                                      expert_bias=W, **FFI)[0]), (X,)),
    "topk_router_jvp": (_jvp(lambda x: jaxops.topk_router(x, 3, score="sigmoid", **FFI)[0]),
                        (X,)),
    "patch_embed": (_vjp(lambda i, k, b: jaxops.patch_embed(
        i, k, b, patch_size=2, pos_embed=jnp.ones((5, 3)), cls_token=b, **FFI)),
        (X[:2, :4, :16].reshape(2, 4, 4, 4), X[0, :4, :12].reshape(2, 2, 4, 3), W[:3])),
    "sparse_linear": (_vjp(lambda x, w, b: jaxops.sparse.linear(
        x, jaxops.sparse.compress(jaxops.sparse.prune_2_4(w)[0]), b, **FFI)), (X, X[0], W[:6])),
}


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def lowered(request):
  """platform -> every custom call of PROGRAMS lowered for it."""
  return request.param, [call for fn, args in PROGRAMS.values()
                         for call in custom_calls(fn, *args, platform=request.param)]


def test_the_programs_reach_every_kernel_target(lowered):
  _, calls = lowered
  assert sorted({call.target for call in calls}) == KERNEL_TARGETS


def test_lowered_attributes_have_the_declared_names_and_types(lowered):
  _, calls = lowered
  for call in calls:
    assert call.attributes == contract_attribute_types(call.target), call.target


def test_lowered_workspaces_are_what_cpp_sizes(lowered):
  platform, calls = lowered
  for call in calls:
    if ffi_targets.contract(call.target).has_workspace:
      assert call.results[-1] == contract_workspace(call, platform), call.target

