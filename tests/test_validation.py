"""The argument rules of jaxops._src.validation, one by one, and every public
op's bad arguments: the exception type, and a message in the one style
``<op>: <argument> must <expected>, got <actual>``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxops
from jaxops._src import validation as v
from jaxops.flax import linen as jlinen
from jaxops.flax import nnx as jnnx
from jaxops.models.config import DecoderConfig

OP = "jaxops.op"


def _raises(error, name, expected, call):
  """``call`` raises ``error`` with the message of the one style for ``name``."""
  with pytest.raises(error) as info:
    call()
  message = str(info.value)
  assert message.startswith(f"{OP}: {name} must "), message
  assert re.search(expected, message), message
  assert ", got " in message, message
  return message


# -- static scalars ------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 2, 1.5, np.float32(0.25), np.float64(3.0), np.int64(4)])
def test_static_float_accepts_python_and_numpy_reals(value):
  result = v.static_float(OP, "eps", value)
  assert type(result) is float and result == float(value)


@pytest.mark.parametrize("value,actual", [
    (True, "bool True"), (np.bool_(False), "bool_? False"), ("1e-5", "str '1e-5'"),
    (None, "None"), ([1.0], "list"), (1j, "complex"), (jnp.float32(1.0), r"an array float32\[\]"),
])
def test_static_float_refuses_non_numbers(value, actual):
  _raises(TypeError, "eps", f"be a Python float or int, got {actual}$",
          lambda: v.static_float(OP, "eps", value))


def test_static_float_refuses_traced_values_at_trace_time():
  message = _raises(TypeError, "eps", "got a traced float32",
                    lambda: jax.jit(lambda e: v.static_float(OP, "eps", e))(1.0))
  assert "float32[]" in message


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, np.float32(np.inf)])
def test_static_float_must_be_finite(value):
  _raises(ValueError, "eps", "be finite", lambda: v.static_float(OP, "eps", value))


@pytest.mark.parametrize("bounds,inside,outside,expected", [
    (dict(low=0.0), [0.0, 5], [-1e-9], r"be >= 0\.0, got -1e-09"),
    (dict(low=0.0, low_open=True), [1e-9], [0.0, -1], r"be > 0\.0, got"),
    (dict(high=1.0), [1.0, -5], [1.5], r"be <= 1\.0, got 1\.5"),
    (dict(high=1.0, high_open=True), [0.5], [1.0], r"be < 1\.0, got 1\.0"),
    (dict(low=0.0, high=1.0), [0.0, 1.0], [-0.5, 1.5], r"be in \[0\.0, 1\.0\], got"),
    (dict(low=0.0, high=1.0, high_open=True), [0.0], [1.0], r"be in \[0\.0, 1\.0\), got 1\.0"),
    (dict(low=0.0, high=1.0, low_open=True), [1.0], [0.0], r"be in \(0\.0, 1\.0\], got 0\.0"),
])
def test_static_float_bounds_state_their_open_and_closed_ends(bounds, inside, outside, expected):
  for value in inside:
    assert v.static_float(OP, "eps", value, **bounds) == value
  for value in outside:
    _raises(ValueError, "eps", expected, lambda: v.static_float(OP, "eps", value, **bounds))


def test_static_int():
  assert v.static_int(OP, "n", np.int32(-3)) == -3 and type(v.static_int(OP, "n", np.int8(1))) is int
  for value in (True, np.bool_(True), 2.0, "3", None, jnp.int32(3)):
    _raises(TypeError, "n", "be a Python int", lambda: v.static_int(OP, "n", value))
  _raises(ValueError, "n", "fit in int64, got 9223372036854775808",
          lambda: v.static_int(OP, "n", 2**63))
  _raises(ValueError, "n", "fit in int32", lambda: v.static_int(OP, "n", -2**31 - 1, bits=32))
  _raises(ValueError, "n", r"be in \[2, 8\], got 9", lambda: v.static_int(OP, "n", 9, low=2, high=8))
  assert v.positive_int(OP, "n", 1) == 1 and v.non_negative_int(OP, "n", 0) == 0
  _raises(ValueError, "n", "be >= 1, got 0", lambda: v.positive_int(OP, "n", 0))
  _raises(ValueError, "n", "be >= 0, got -1", lambda: v.non_negative_int(OP, "n", -1))


def test_static_bool():
  assert v.static_bool(OP, "flag", np.bool_(True)) is True
  for value, actual in ((1, "int 1"), ("True", "str 'True'"), (None, "None")):
    _raises(TypeError, "flag", f"be a Python bool, got {actual}$",
            lambda: v.static_bool(OP, "flag", value))


def test_int_scalar_may_be_traced():
  assert v.int_scalar(OP, "offset", 3).dtype == jnp.int32
  assert int(jax.jit(lambda o: v.int_scalar(OP, "offset", o) + 1)(2)) == 3
  _raises(TypeError, "offset", "be a Python int or an integer scalar array, got float 1.5",
          lambda: v.int_scalar(OP, "offset", 1.5))
  _raises(TypeError, "offset", "got bool True", lambda: v.int_scalar(OP, "offset", True))
  _raises(TypeError, "offset", "got an array float32", lambda: v.int_scalar(OP, "offset",
                                                                            jnp.float32(1)))
  _raises(ValueError, "offset", r"got shape \(2,\)",
          lambda: v.int_scalar(OP, "offset", jnp.ones(2, jnp.int32)))
  _raises(ValueError, "offset", "fit in int32", lambda: v.int_scalar(OP, "offset", 2**31))


def test_axis_is_normalised_and_range_checked():
  assert v.axis(OP, "axis", -1, 3) == 2 and v.axis(OP, "axis", np.int64(0), 3) == 0
  _raises(ValueError, "axis", r"be an axis of a rank-2 array, in \[-2, 1\], got 2",
          lambda: v.axis(OP, "axis", 2, 2))
  _raises(ValueError, "axis", "got -3", lambda: v.axis(OP, "axis", -3, 2))
  _raises(TypeError, "axis", "be a Python int, got bool True", lambda: v.axis(OP, "axis", True, 2))


def test_choice():
  assert v.choice(OP, "mode", np.str_("sum"), ("mean", "sum")) == "sum"
  assert v.choice(OP, "impl", None, (None, "ffi")) is None
  # Anything that is not a listed value is a ValueError, whatever its type.
  for value, actual in (("avg", "str 'avg'"), (None, "None"), (1, "int 1"), (["sum"], "list")):
    _raises(ValueError, "mode", f"be one of 'mean', 'sum', got {re.escape(actual)}$",
            lambda: v.choice(OP, "mode", value, ("mean", "sum")))


# -- arrays and dtypes ---------------------------------------------------------------


@pytest.mark.parametrize("value", [np.ones(2), jnp.ones(2), np.float32(1.0), np.int8(3),
                                   np.ones(2, jnp.bfloat16), np.bool_(True)])
def test_array_accepts_numpy_and_jax_arrays_and_numpy_scalars(value):
  assert isinstance(v.array(OP, "x", value), jax.Array)


@pytest.mark.parametrize("value,actual", [
    ([1.0], "list"), (1.0, "float 1.0"), ("x", "str 'x'"), (None, "None"), (np.str_("x"), "str_"),
    (np.array(["a"]), "an array <U1"),
])
def test_array_refuses_what_is_not_an_array(value, actual):
  _raises(TypeError, "x", f"be an array, got {actual}", lambda: v.array(OP, "x", value))


def test_array_accepts_traced_arrays():
  assert jax.jit(lambda x: v.float_array(OP, "x", x) * 2)(jnp.ones(2)).shape == (2,)


def test_dtype_rules():
  assert v.float_array(OP, "x", jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
  _raises(TypeError, "x", "have a floating dtype, got int32",
          lambda: v.float_array(OP, "x", jnp.ones(2, jnp.int32)))
  only = (jnp.float32, jnp.bfloat16)
  assert v.float_array(OP, "x", jnp.ones(2), dtypes=only).dtype == jnp.float32
  _raises(TypeError, "x", "have dtype float32 or bfloat16, got float16",
          lambda: v.float_array(OP, "x", jnp.ones(2, jnp.float16), dtypes=only))
  assert v.integer_array(OP, "ids", np.arange(3, dtype=np.uint8)).dtype == jnp.uint8
  _raises(TypeError, "ids", "have an integer dtype, got float32",
          lambda: v.integer_array(OP, "ids", jnp.ones(2)))
  _raises(TypeError, "mask", "have dtype bool, got int32",
          lambda: v.bool_array(OP, "mask", jnp.ones(2, jnp.int32)))
  v.floating_dtype(OP, "params['w']", jnp.float16)
  _raises(TypeError, "params['w']", "got int32",
          lambda: v.floating_dtype(OP, "params['w']", jnp.int32))


# -- shapes --------------------------------------------------------------------------


def test_shape_rules():
  x = jnp.ones((2, 3))
  v.rank(OP, "x", x, low=1)
  v.rank(OP, "x", x, low=2, high=2)
  _raises(ValueError, "x", r"have rank >= 3, got shape \(2, 3\)", lambda: v.rank(OP, "x", x, low=3))
  _raises(ValueError, "x", r"have rank 4: \[B, T, N, H\], got shape",
          lambda: v.rank(OP, "x", x, low=4, high=4, labels="[B, T, N, H]"))
  _raises(ValueError, "x", r"have rank in \[3, 4\]", lambda: v.rank(OP, "x", x, low=3, high=4))
  v.non_empty_axis(OP, "x", x)
  v.non_empty_axis(OP, "x", jnp.ones(()))
  _raises(ValueError, "x", r"have a non-empty last axis, got shape \(2, 0\)",
          lambda: v.non_empty_axis(OP, "x", jnp.ones((2, 0))))
  _raises(ValueError, "x", "have a non-empty axis 0",
          lambda: v.non_empty_axis(OP, "x", jnp.ones((0, 2)), 0))
  v.shape(OP, "p", jnp.ones(3), (2, 3), (3,))
  _raises(ValueError, "p", r"have shape x.shape\[:1\] = \(2,\) or \(1, 2\), got \(3,\)",
          lambda: v.shape(OP, "p", jnp.ones(3), (2,), (1, 2), of="x.shape[:1]"))


def test_same_as_and_broadcastable():
  x = jnp.ones((2, 3))
  v.same_as(OP, "y", jnp.zeros((2, 3)), "x", x)
  _raises(ValueError, "y", r"have the shape of x \(2, 3\), got \(3, 2\)",
          lambda: v.same_as(OP, "y", jnp.ones((3, 2)), "x", x))
  _raises(TypeError, "y", r"have the dtype of x \(float32\), got float16",
          lambda: v.same_as(OP, "y", x.astype(jnp.float16), "x", x))
  for ok in ((3,), (1, 3), (2, 1), ()):
    v.broadcastable(OP, "b", jnp.ones(ok), x.shape, of="x's shape")
  for bad in ((2,), (1, 2, 3), (3, 3)):
    _raises(ValueError, "b", rf"be broadcastable to x's shape \(2, 3\), got shape",
            lambda: v.broadcastable(OP, "b", jnp.ones(bad), x.shape, of="x's shape"))


# -- every public op: its bad arguments ----------------------------------------------

_x = jnp.ones((2, 4))
_i = jnp.zeros(2, jnp.int32)
_q, _kv = jnp.ones((1, 3, 2, 8)), jnp.ones((1, 5, 1, 8))
_r = jnp.ones((1, 3, 2, 8))
_W = jnp.ones((4, 5))
_ROPE = lambda **kw: jaxops.rope(_r, jnp.arange(3), **kw)  # noqa: E731
_ATTN = lambda **kw: jaxops.attention(_q, _kv, _kv, **kw)  # noqa: E731
_CE = lambda **kw: jaxops.cross_entropy(_x, _i, **kw)  # noqa: E731
_ADAMW = jaxops.optim.adamw(1e-3)
_PAGES = jnp.ones((4, 2, 1, 8))
_ROWS = jnp.ones((3, 1, 8))
_TABLES = jnp.zeros((2, 2), jnp.int32)
_PAGED = lambda query=jnp.ones((2, 2, 8)), block_tables=_TABLES, **kw: (  # noqa: E731
    jaxops.paged_attention(query, _PAGES, _PAGES, block_tables, jnp.ones(2, jnp.int32), **kw))

# (public name, argument, exception, call)
OP_CASES = [
    ("jaxops.layer_norm", "x", TypeError, lambda: jaxops.layer_norm([[1.0]])),
    ("jaxops.layer_norm", "x", TypeError, lambda: jaxops.layer_norm(_x.astype(jnp.int32))),
    ("jaxops.layer_norm", "x", ValueError, lambda: jaxops.layer_norm(jnp.float32(1))),
    ("jaxops.layer_norm", "weight", ValueError, lambda: jaxops.layer_norm(_x, jnp.ones(3))),
    ("jaxops.layer_norm", "bias", TypeError, lambda: jaxops.layer_norm(_x, None, _i)),
    ("jaxops.layer_norm", "epsilon", TypeError, lambda: jaxops.layer_norm(_x, epsilon="1e-5")),
    ("jaxops.layer_norm", "epsilon", TypeError, lambda: jaxops.layer_norm(_x, epsilon=True)),
    ("jaxops.layer_norm", "epsilon", ValueError, lambda: jaxops.layer_norm(_x, epsilon=-1e-5)),
    ("jaxops.layer_norm", "implementation", ValueError,
     lambda: jaxops.layer_norm(_x, implementation="cuda")),
    ("jaxops.rms_norm", "epsilon", ValueError, lambda: jaxops.rms_norm(_x, epsilon=float("nan"))),
    ("jaxops.rms_norm", "x", ValueError, lambda: jaxops.rms_norm(jnp.ones((2, 0)))),
    ("jaxops.add_rms_norm", "residual", ValueError, lambda: jaxops.add_rms_norm(_x, _x[:1])),
    ("jaxops.add_rms_norm", "residual", TypeError,
     lambda: jaxops.add_rms_norm(_x, _x.astype(jnp.int32))),
    ("jaxops.add_rms_norm", "epsilon", TypeError,
     lambda: jaxops.add_rms_norm(_x, _x, epsilon=jnp.float32(1e-6))),
    ("jaxops.softmax", "axis", ValueError, lambda: jaxops.softmax(_x, axis=2)),
    ("jaxops.softmax", "axis", TypeError, lambda: jaxops.softmax(_x, axis=1.0)),
    ("jaxops.softmax", "where", TypeError, lambda: jaxops.softmax(_x, where=_x)),
    ("jaxops.softmax", "where", ValueError,
     lambda: jaxops.softmax(_x, where=jnp.ones((3, 4), bool))),
    ("jaxops.log_softmax", "bias", ValueError, lambda: jaxops.log_softmax(_x, bias=jnp.ones(5))),
    ("jaxops.log_softmax", "x", TypeError, lambda: jaxops.log_softmax(_i)),
    ("jaxops.causal_softmax", "x", ValueError, lambda: jaxops.causal_softmax(jnp.ones(4))),
    ("jaxops.causal_softmax", "query_offset", TypeError,
     lambda: jaxops.causal_softmax(_x, query_offset=1.5)),
    ("jaxops.causal_softmax", "query_offset", TypeError,
     lambda: jaxops.causal_softmax(_x, query_offset=True)),
    ("jaxops.cross_entropy", "labels", TypeError, lambda: jaxops.cross_entropy(_x, _x[:, 0])),
    ("jaxops.cross_entropy", "labels", ValueError, lambda: jaxops.cross_entropy(_x, _i[:1])),
    ("jaxops.cross_entropy", "logits", ValueError,
     lambda: jaxops.cross_entropy(jnp.ones((2, 0)), _i)),
    ("jaxops.cross_entropy", "label_smoothing", ValueError, lambda: _CE(label_smoothing=1.5)),
    ("jaxops.cross_entropy", "label_smoothing", TypeError, lambda: _CE(label_smoothing="0.1")),
    ("jaxops.cross_entropy", "z_loss", ValueError, lambda: _CE(z_loss=float("inf"))),
    ("jaxops.cross_entropy", "ignore_index", TypeError, lambda: _CE(ignore_index=False)),
    ("jaxops.cross_entropy", "reduction", ValueError, lambda: _CE(reduction="avg")),
    ("jaxops.linear_cross_entropy", "weight", ValueError,
     lambda: jaxops.linear_cross_entropy(_x, _W.T, _i)),
    ("jaxops.linear_cross_entropy", "bias", ValueError,
     lambda: jaxops.linear_cross_entropy(_x, _W, _i, bias=jnp.ones(4))),
    ("jaxops.linear_cross_entropy", "z_loss", TypeError,
     lambda: jaxops.linear_cross_entropy(_x, _W, _i, z_loss=True)),
    ("jaxops.gelu", "approximate", TypeError, lambda: jaxops.gelu(_x, approximate="tanh")),
    ("jaxops.gelu", "x", TypeError, lambda: jaxops.gelu(1.0)),
    ("jaxops.silu", "x", TypeError, lambda: jaxops.silu(_i)),
    ("jaxops.swiglu", "up", ValueError, lambda: jaxops.swiglu(_x, _x[:1])),
    ("jaxops.geglu", "up", TypeError, lambda: jaxops.geglu(_x, _x.astype(jnp.int32))),
    ("jaxops.geglu", "approximate", TypeError, lambda: jaxops.geglu(_x, _x, approximate=1)),
    ("jaxops.rope", "x", ValueError, lambda: jaxops.rope(_x, jnp.arange(2))),
    ("jaxops.rope", "positions", TypeError, lambda: jaxops.rope(_r, jnp.arange(3.0))),
    ("jaxops.rope", "positions", ValueError, lambda: jaxops.rope(_r, jnp.arange(4))),
    ("jaxops.rope", "theta", ValueError, lambda: _ROPE(theta=0.0)),
    ("jaxops.rope", "theta", TypeError, lambda: _ROPE(theta="1e4")),
    ("jaxops.rope", "style", ValueError, lambda: _ROPE(style="llama")),
    ("jaxops.rope", "rotary_dim", ValueError, lambda: _ROPE(rotary_dim=3)),
    ("jaxops.rope", "rotary_dim", TypeError, lambda: _ROPE(rotary_dim=4.0)),
    ("jaxops.embedding", "table", ValueError, lambda: jaxops.embedding(jnp.ones(4), _i)),
    ("jaxops.embedding", "table", ValueError, lambda: jaxops.embedding(jnp.ones((0, 4)), _i)),
    ("jaxops.embedding", "ids", TypeError, lambda: jaxops.embedding(_x, _x)),
    ("jaxops.ring_attention", "layout", ValueError,
     lambda: jaxops.ring_attention(_q, _kv, _kv, axis_name="seq", layout="striped")),
    ("jaxops.ring_attention", "strategy", ValueError,
     lambda: jaxops.ring_attention(_q, _kv, _kv, axis_name="seq", strategy="ulysses")),
    ("jaxops.ring_attention", "axis_name", ValueError,
     lambda: jaxops.ring_attention(_q, _kv, _kv, axis_name="seq")),  # outside any shard_map
    ("jaxops.ring_attention", "axis_name", TypeError,
     lambda: jaxops.ring_attention(_q, _kv, _kv, axis_name=0)),
    ("jaxops.zigzag_permute", "x", ValueError, lambda: jaxops.zigzag_permute(_q, 2)),
    ("jaxops.zigzag_permute", "axis_size", ValueError, lambda: jaxops.zigzag_permute(_x, 0)),
    ("jaxops.zigzag_unpermute", "axis", ValueError,
     lambda: jaxops.zigzag_unpermute(_x, 1, axis=2)),
    ("jaxops.attention", "query", ValueError, lambda: jaxops.attention(_x, _x, _x)),
    ("jaxops.attention", "query", TypeError,
     lambda: jaxops.attention(_q.astype(jnp.int32), _kv, _kv)),
    ("jaxops.attention", "key", TypeError,
     lambda: jaxops.attention(_q, _kv.astype(jnp.float16), _kv.astype(jnp.float16))),
    ("jaxops.attention", "value", ValueError, lambda: jaxops.attention(_q, _kv, _kv[:, :4])),
    ("jaxops.attention", "mask", TypeError, lambda: _ATTN(mask=jnp.ones((3, 5)))),
    ("jaxops.attention", "bias", ValueError, lambda: _ATTN(bias=jnp.ones((3, 4)))),
    ("jaxops.attention", "scale", ValueError, lambda: _ATTN(scale=float("inf"))),
    ("jaxops.attention", "scale", TypeError, lambda: _ATTN(scale=True)),
    ("jaxops.attention", "is_causal", TypeError, lambda: _ATTN(is_causal="yes")),
    ("jaxops.attention", "return_residual", TypeError, lambda: _ATTN(return_residual=None)),
    ("jaxops.attention", "local_window_size", ValueError, lambda: _ATTN(local_window_size=-1)),
    ("jaxops.attention", "local_window_size", TypeError, lambda: _ATTN(local_window_size=(1, True))),
    ("jaxops.attention", "query_seq_lengths", ValueError,
     lambda: _ATTN(query_seq_lengths=jnp.ones(2, jnp.int32))),
    ("jaxops.attention", "key_value_seq_lengths", TypeError,
     lambda: _ATTN(key_value_seq_lengths=jnp.ones(1))),
    ("jaxops.attention", "query_offset", ValueError, lambda: _ATTN(query_offset=_i)),
    ("jaxops.attention", "query_offset", TypeError, lambda: _ATTN(query_offset=1.0)),
    ("jaxops.optim.adamw", "learning_rate", TypeError, lambda: jaxops.optim.adamw("1e-3")),
    ("jaxops.optim.adamw", "learning_rate", TypeError, lambda: jaxops.optim.adamw(True)),
    ("jaxops.optim.adamw", "b1", ValueError, lambda: jaxops.optim.adamw(1e-3, b1=1.0)),
    ("jaxops.optim.adamw", "eps", ValueError, lambda: jaxops.optim.adamw(1e-3, eps=-1.0)),
    ("jaxops.optim.adamw", "weight_decay", ValueError,
     lambda: jaxops.optim.adamw(1e-3, weight_decay=float("nan"))),
    ("jaxops.optim.adamw", "implementation", ValueError,
     lambda: jaxops.optim.adamw(1e-3, implementation="gpu")),
    ("jaxops.optim.adamw", "params['n']", TypeError, lambda: _ADAMW.init({"n": _i})),
    ("jaxops.optim.adamw", "grads['w']", ValueError,
     lambda: _ADAMW.update({"w": _x}, _ADAMW.init({"w": _i * 1.0}), {"w": _i * 1.0})),
    ("jaxops.optim.adamw", "state", TypeError,
     lambda: _ADAMW.update({"w": _x}, None, {"w": _x})),
    ("jaxops.optim.adamw", "params", ValueError,
     lambda: _ADAMW.update({"w": _x}, _ADAMW.init({"w": _x}))),
    ("jaxops.paged_attention", "query", TypeError,
     lambda: _PAGED(query=_q[:, 0].astype(jnp.int32))),
    ("jaxops.paged_attention", "block_tables", TypeError,
     lambda: _PAGED(block_tables=_TABLES.astype(jnp.float32))),
    ("jaxops.paged_attention", "scale", TypeError, lambda: _PAGED(scale="x")),
    ("jaxops.paged_kv_update", "slot_mapping", TypeError,
     lambda: jaxops.paged_kv_update(_PAGES, _PAGES, _ROWS, _ROWS, jnp.zeros(3))),
    ("jaxops.paged_kv_update", "key", ValueError,
     lambda: jaxops.paged_kv_update(_PAGES, _PAGES, _ROWS[..., 1:], _ROWS, _i[:1].repeat(3))),
    ("jaxops.sample", "key", TypeError, lambda: jaxops.sample(3, _x)),
    ("jaxops.sample", "logits", TypeError, lambda: jaxops.sample(jax.random.key(0), _i)),
    ("jaxops.sample", "temperature", ValueError,
     lambda: jaxops.sample(jax.random.key(0), _x, temperature=-1.0)),
    ("jaxops.sample", "top_p", ValueError, lambda: jaxops.sample(jax.random.key(0), _x, top_p=1.5)),
    ("jaxops.topk_router", "logits", TypeError, lambda: jaxops.topk_router(_i, 1)),
    ("jaxops.topk_router", "k", ValueError, lambda: jaxops.topk_router(_x, 5)),
    ("jaxops.topk_router", "score", ValueError, lambda: jaxops.topk_router(_x, 2, score="relu")),
    ("jaxops.topk_router", "num_groups", ValueError,
     lambda: jaxops.topk_router(_x, 1, num_groups=3, group_topk=1)),
    ("jaxops.moe_aux_loss", "probs", TypeError,
     lambda: jaxops.moe_aux_loss(_i, jnp.ones(4), 1, 0.01)),
    ("jaxops.moe_aux_loss", "expert_counts", ValueError,
     lambda: jaxops.moe_aux_loss(_x, jnp.ones(3), 1, 0.01)),
    ("jaxops.patch_embed", "images", ValueError,
     lambda: jaxops.patch_embed(jnp.ones((1, 5, 4, 3)), jnp.ones((2, 2, 3, 4)), patch_size=2)),
    ("jaxops.patch_embed", "kernel", ValueError,
     lambda: jaxops.patch_embed(jnp.ones((1, 4, 4, 3)), jnp.ones((2, 2, 2, 4)), patch_size=2)),
    ("jaxops.patch_embed", "patch_size", ValueError,
     lambda: jaxops.patch_embed(jnp.ones((1, 4, 4, 3)), jnp.ones((2, 2, 3, 4)), patch_size=0)),
    ("jaxops.sparse.compress", "w", ValueError, lambda: jaxops.sparse.compress(jnp.ones((3, 6)))),
    ("jaxops.sparse.prune_2_4", "w", ValueError, lambda: jaxops.sparse.prune_2_4(jnp.ones((3, 6)))),
    ("jaxops.sparse.decompress", "sparse_w", TypeError,
     lambda: jaxops.sparse.decompress(jnp.ones((3, 6)))),
    ("jaxops.sparse.linear", "x", ValueError,
     lambda: jaxops.sparse.linear(jnp.ones((2, 6)), jaxops.sparse.compress(jnp.zeros((3, 8))))),
]


@pytest.mark.parametrize("op,argument,error,call", OP_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(OP_CASES)])
def test_bad_argument_of_a_public_op(op, argument, error, call):
  _assert_named_error(op, argument, error, call)


def _assert_named_error(op, argument, error, call):
  with pytest.raises(error) as info:
    call()
  message = str(info.value)
  assert message.startswith(f"{op}: {argument} must "), message
  assert ", got " in message, message


def test_every_public_op_has_bad_argument_cases():
  # Functions without arguments and namespaces have no bad arguments.
  # Namespaces count by their ops (jaxops.sparse.metadata_cols is a size helper).
  namespaces = {"jaxops.optim": ["adamw"],
                "jaxops.sparse": ["compress", "decompress", "linear", "prune_2_4"]}
  no_arguments = {"jaxops.export_checks", "jaxops.cpu_isa"}
  ops = {f"jaxops.{name}" for name in jaxops.__all__} - no_arguments - set(namespaces)
  ops |= {f"{space}.{name}" for space, names in namespaces.items() for name in names}
  assert ops == {case[0] for case in OP_CASES}


def test_errors_happen_at_trace_time_before_any_primitive():
  # Under jit a traced static argument cannot reach a kernel: the trace stops.
  with pytest.raises(TypeError, match="jaxops.rms_norm: epsilon must be a Python float or int, "
                                      "got a traced float32"):
    jax.jit(lambda e: jaxops.rms_norm(_x, epsilon=e))(1e-6)
  with pytest.raises(ValueError, match="jaxops.layer_norm: weight must have shape"):
    jax.make_jaxpr(lambda x, w: jaxops.layer_norm(x, w))(_x, jnp.ones(3))


def test_traced_arrays_stay_allowed_where_they_were():
  lengths = jnp.array([3], jnp.int32)
  f = jax.jit(lambda offset, n: jaxops.attention(_q, _kv, _kv, is_causal=True, query_offset=offset,
                                                 key_value_seq_lengths=n))
  assert f(jnp.int32(2), lengths).shape == _q.shape
  assert jax.jit(lambda p: jaxops.rope(_r, p))(jnp.arange(3)).shape == _r.shape


def test_valid_spellings_stay_accepted():
  """NumPy scalars, ints where floats are asked, lists of window sizes..."""
  jaxops.layer_norm(_x, epsilon=0)
  jaxops.rms_norm(_x, epsilon=np.float32(1e-6))
  jaxops.softmax(_x, axis=np.int64(0))
  jaxops.causal_softmax(_x, query_offset=np.int32(1))
  _CE(label_smoothing=np.float64(0.1), ignore_index=np.int64(-1), reduction=np.str_("sum"))
  jaxops.gelu(_x, approximate=np.bool_(False))
  _ROPE(theta=10000, rotary_dim=np.int64(4))
  _ATTN(local_window_size=[1, 2], query_offset=np.int32(2), scale=1)
  jaxops.optim.adamw(np.float32(1e-3), b1=0, weight_decay=-0.1)


# -- the Flax wrappers: their own configuration, under their own name -----------------


def _linen_call(module, *args):
  return module.init(jax.random.key(0), *args)


WRAPPER_CASES = [
    ("jaxops.flax.linen.LayerNorm", "epsilon", TypeError,
     lambda: _linen_call(jlinen.LayerNorm(epsilon="1e-6"), _x)),
    ("jaxops.flax.linen.RMSNorm", "implementation", ValueError,
     lambda: _linen_call(jlinen.RMSNorm(implementation="gpu"), _x)),
    ("jaxops.flax.linen.Embed", "inputs", TypeError,
     lambda: _linen_call(jlinen.Embed(5, 3), _x)),
    ("jaxops.flax.linen.Embed", "num_embeddings", ValueError,
     lambda: _linen_call(jlinen.Embed(0, 3), _i)),
    ("jaxops.flax.linen.GatedMLP", "activation", ValueError,
     lambda: _linen_call(jlinen.GatedMLP(8, activation="relu"), _x)),
    ("jaxops.flax.linen.RotaryEmbedding", "theta", ValueError,
     lambda: _linen_call(jlinen.RotaryEmbedding(theta=-1.0), _r, jnp.arange(3))),
    ("jaxops.flax.linen.MultiHeadAttention", "num_heads", ValueError,
     lambda: _linen_call(jlinen.MultiHeadAttention(num_heads=3), jnp.ones((1, 2, 8)))),
    ("jaxops.flax.linen.MultiHeadAttention", "num_kv_heads", ValueError,
     lambda: _linen_call(jlinen.MultiHeadAttention(num_heads=4, num_kv_heads=3),
                         jnp.ones((1, 2, 8)))),
    ("jaxops.flax.nnx.LayerNorm", "epsilon", ValueError,
     lambda: jnnx.LayerNorm(4, epsilon=-1.0, rngs=nnx.Rngs(0))),
    ("jaxops.flax.nnx.RMSNorm", "num_features", TypeError,
     lambda: jnnx.RMSNorm(4.0, rngs=nnx.Rngs(0))),
    ("jaxops.flax.nnx.Embed", "inputs", TypeError,
     lambda: jnnx.Embed(5, 3, rngs=nnx.Rngs(0))(_x)),
    ("jaxops.flax.nnx.GatedMLP", "activation", ValueError,
     lambda: jnnx.GatedMLP(4, 8, activation="tanh", rngs=nnx.Rngs(0))),
    ("jaxops.flax.nnx.RotaryEmbedding", "style", ValueError,
     lambda: jnnx.RotaryEmbedding(style="llama")),
    ("jaxops.flax.nnx.MultiHeadAttention", "dropout_rate", ValueError,
     lambda: jnnx.MultiHeadAttention(2, 8, dropout_rate=1.5, rngs=nnx.Rngs(0))),
    ("jaxops.flax.nnx.MultiHeadAttention", "is_causal", TypeError,
     lambda: jnnx.MultiHeadAttention(2, 8, is_causal="yes", rngs=nnx.Rngs(0))),
    ("jaxops.flax.nnx.MultiHeadAttention", "mask", ValueError,
     lambda: jnnx.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))(
         jnp.ones((1, 2, 8)), mask=jnp.ones((2, 2), bool),
         kv_cache=(jnp.zeros((1, 4, 2, 4)), jnp.zeros((1, 4, 2, 4))))),
    ("jaxops.models.DecoderConfig", "num_kv_heads", ValueError,
     lambda: DecoderConfig(num_heads=4, num_kv_heads=3)),
]


@pytest.mark.parametrize("op,argument,error,call", WRAPPER_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in WRAPPER_CASES])
def test_bad_argument_of_a_flax_wrapper(op, argument, error, call):
  _assert_named_error(op, argument, error, call)
