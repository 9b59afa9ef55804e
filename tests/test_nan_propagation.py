"""NaN and +-inf in any input of any op: the kernels give NaN and inf where the reference does.

A training run that diverges must show NaN, not hide it. Each test puts NaN,
+inf and -inf at one position of one floating input at a time and compares the
kernels' outputs, reverse-mode gradients (cotangent of ones) and forward-mode
tangents (tangent of ones) with the reference's: NaN exactly where the
reference has NaN, inf where it has inf, the finite entries within the usual
tolerances (``assert_close``). One jit per op and backend: the poisoned inputs
are arguments, so every sweep step reuses the compiled computation.

With an infinite input, NaN and inf count alike ("not finite"): inf - inf or
0 * inf is NaN in one evaluation order and inf in another.

Attention: NaN or inf in a query, key, value or bias element reaches every
query row that attends it (output, log-sum-exp, gradients, tangents). A key
that no query row of the call attends (at or past key_value_seq_lengths, past
the last row's causal or window limit, before the first row's window) is never
read, so whatever it holds (an unwritten KV-cache tail) reaches no result:
``test_attention_ignores_excluded_keys``. A key that some rows attend and
others exclude may reach the excluding rows too, as in the reference, whose
every row multiplies its zero weights by V (0 * NaN = NaN). The sweep checks
between these two: ``attention_excluding_masked`` (the reference in which an
excluded pair never meets) gives the NaN that must appear, reference.attention
the NaN that may; a derivative may also be NaN where a NaN row spreads (its
other entries must match).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops import reference
from jaxops.testing import assert_close, random_inputs, upcast
from support import backends

SPECIALS = (np.nan, np.inf, -np.inf)


def _poison(args, index, position, value):
  args = list(args)
  x = args[index]
  args[index] = x.reshape(-1).at[position].set(value).reshape(x.shape)
  return args


def _positions(x, last):
  """(position, values): a middle element with each of SPECIALS, and with
  ``last`` the last one (the last batch's last row: past the sequence lengths
  in the attention cases; test_attention_ignores_excluded_keys has the
  infinities there) with NaN."""
  return [(x.size // 2, SPECIALS)] + ([(x.size - 1, (np.nan,))] if last else [])


def _results(fn, diff, ints):
  """fn's outputs, its gradients for a cotangent of ones, its tangents for tangents of ones."""
  def run(*diff):
    f = lambda *d: fn(*d, *ints)
    out, pullback = jax.vjp(f, *diff)
    grads = pullback(jax.tree.map(jnp.ones_like, out))
    _, tangents = jax.jvp(f, diff, tuple(jnp.ones_like(d) for d in diff))
    return {"out": out, "grad": grads, "tangent": tangents}
  return run


def _check(actual, expected, upper, derivative, infinite, dtype, reduce_size):
  """assert_close (NaN exactly where ``expected`` has it) when upper is None.
  Else (see the module docstring) ``expected``'s NaN must be there, more may
  be where ``upper`` has NaN (any derivative: anywhere), and the kernel's
  other entries must match ``expected``'s."""
  if upper is not None:
    a = np.asarray(actual, np.float32)
    e = np.asarray(expected, np.float32)
    extra = np.isnan(a) & ~np.isnan(e)
    if not derivative:
      extra &= np.isnan(np.asarray(upper, np.float32)) | np.isinf(e)
    elif infinite:
      # An infinite input: where the oracle's derivative is NaN (0 * inf where
      # a logit is -inf, inf / inf) the kernel may give the finite limit.
      a = np.where(np.isnan(e), e, a)
    actual = np.where(extra, e, a)
  if infinite:
    # inf - inf or 0 * inf gives NaN where another evaluation order gives an
    # inf: with an infinite input, NaN and inf are both "not finite" here.
    a = np.asarray(actual, np.float32)
    e = np.asarray(expected, np.float32)
    actual = np.where(~np.isfinite(a) & ~np.isfinite(e), e, a)
  assert_close(actual, expected, dtype=dtype, reduce_size=reduce_size)


def sweep(fn, ref, diff, ints=(), *, upper=None, last=False, reduce_size=1):
  """Poisons each input in ``diff`` at ``_positions`` and compares fn's results
  with ref's (computed on float32 inputs); ``upper``: see _check."""
  dtype = diff[0].dtype
  actual = jax.jit(_results(fn, diff, ints))
  expected = jax.jit(_results(ref, upcast(diff), ints))
  bound = jax.jit(_results(upper, upcast(diff), ints)) if upper else None
  failures = []
  for index, x in enumerate(diff):
    for position, values in _positions(x, last):
      for value in values:
        args = _poison(diff, index, position, value)
        got, want = actual(*args), expected(*upcast(args))
        wants = jax.tree.leaves(want)
        uppers = jax.tree.leaves(bound(*upcast(args))) if bound else [None] * len(wants)
        for (path, a), e, u in zip(jax.tree_util.tree_flatten_with_path(got)[0], wants, uppers):
          try:
            _check(a, e, u, jax.tree_util.keystr(path)[:6] != "['out'", np.isinf(value), dtype,
                   reduce_size)
          except AssertionError as error:
            counts = [(int(np.isnan(np.asarray(x, np.float32)).sum()),
                       int(np.isinf(np.asarray(x, np.float32)).sum())) for x in (a, e)]
            failures.append(f"input {index}[{position}] = {value}, "
                            f"{jax.tree_util.keystr(path)}: (NaN, inf) {counts[0]} expected "
                            f"{counts[1]}; {str(error).splitlines()[0]}")
  assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])


# -- every op but attention -------------------------------------------------------------

ROWS, COLS = 3, 37
HARNESS_COLS = 300  # more than one warp's columns in the CUDA row kernels


def _cases(cols):
  x, r, w, b = random_inputs(0, [(ROWS, cols), (ROWS, cols), (cols,), (cols,)])
  labels = jnp.array([1, cols - 1, 0], jnp.int32)
  return {
      "layer_norm": (lambda x, w, b: jaxops.layer_norm(x, w, b, implementation="ffi"),
                     reference.layer_norm, [x, w, b], ()),
      "rms_norm": (lambda x, w: jaxops.rms_norm(x, w, implementation="ffi"),
                   reference.rms_norm, [x, w], ()),
      "add_rms_norm": (lambda x, r, w: jaxops.add_rms_norm(x, r, w, implementation="ffi"),
                       reference.add_rms_norm, [x, r, w], ()),
      "softmax": (functools.partial(jaxops.softmax, implementation="ffi"),
                  reference.softmax, [x], ()),
      "softmax_bias": (lambda x, b: jaxops.softmax(x, bias=b, implementation="ffi"),
                       lambda x, b: reference.softmax(x, bias=b), [x, b], ()),
      "log_softmax": (functools.partial(jaxops.log_softmax, implementation="ffi"),
                      reference.log_softmax, [x], ()),
      "causal_softmax": (
          lambda x: jaxops.causal_softmax(x, query_offset=cols - ROWS, implementation="ffi"),
          lambda x: reference.causal_softmax(x, query_offset=cols - ROWS), [x], ()),
      "cross_entropy": (
          lambda x, l: jaxops.cross_entropy(x, l, reduction="none", label_smoothing=0.1,
                                            z_loss=1e-3, implementation="ffi"),
          lambda x, l: reference.cross_entropy(x, l, reduction="none", label_smoothing=0.1,
                                               z_loss=1e-3), [x], (labels,)),
      "gelu": (functools.partial(jaxops.gelu, implementation="ffi"), reference.gelu, [x], ()),
      "gelu_exact": (lambda x: jaxops.gelu(x, False, implementation="ffi"),
                     lambda x: reference.gelu(x, False), [x], ()),
      "silu": (functools.partial(jaxops.silu, implementation="ffi"), reference.silu, [x], ()),
      "swiglu": (functools.partial(jaxops.swiglu, implementation="ffi"),
                 reference.swiglu, [x, r], ()),
      "geglu": (functools.partial(jaxops.geglu, implementation="ffi"),
                reference.geglu, [x, r], ()),
  }


def _linear_cross_entropy_case():
  x, w, b = random_inputs(1, [(5, 16), (16, 37), (37,)])
  labels = jnp.array([0, 36, 5, -100, 7], jnp.int32)
  kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
  return (lambda x, w, b, l: jaxops.linear_cross_entropy(x, w, l, bias=b, implementation="ffi",
                                                         **kw),
          lambda x, w, b, l: reference.linear_cross_entropy(x, w, l, bias=b, **kw),
          [x, w, b], (labels,))


def _rope_case(style):
  x, = random_inputs(2, [(2, 5, 3, 16)])
  positions = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  return (lambda x, p: jaxops.rope(x, p, style=style, rotary_dim=12, implementation="ffi"),
          lambda x, p: reference.rope(x, p, style=style, rotary_dim=12), [x], (positions,))


def _embedding_case():
  table, = random_inputs(3, [(11, 24)])
  ids = jnp.array([[0, 5, 10], [5, 5, 2]], jnp.int32)
  return (lambda t, i: jaxops.embedding(t, i, implementation="ffi"), reference.embedding,
          [table], (ids,))


def _sparse_linear_case():
  """2:4 sparse linear: values [11, 20] of a compressed weight, metadata an
  integer input. The reference multiplies the pruned zeros (0 * NaN = NaN)."""
  x, w, b = random_inputs(9, [(ROWS, 40), (11, 40), (11,)])
  packed = jaxops.sparse.compress(jaxops.sparse.prune_2_4(w)[0])
  layer = lambda x, v, b, m: jaxops.sparse.linear(x, jaxops.sparse.SparseWeight(v, m, 40), b,
                                                  implementation="ffi")
  return (layer, lambda x, v, b, m: reference.sparse_linear(x, v, m, b), [x, packed.values, b],
          (packed.metadata,))


OPS = ["layer_norm", "rms_norm", "add_rms_norm", "softmax", "softmax_bias", "log_softmax",
       "causal_softmax", "cross_entropy", "gelu", "gelu_exact", "silu", "swiglu", "geglu",
       "linear_cross_entropy", "rope_neox", "rope_gptj", "embedding", "sparse_linear"]


@backends.parametrize("op", {backends.CPU: OPS, backends.HARNESS: OPS})
def test_op(backend, op):
  cols = HARNESS_COLS if backend == backends.HARNESS else COLS
  if op == "linear_cross_entropy":
    fn, ref, diff, ints = _linear_cross_entropy_case()
  elif op.startswith("rope"):
    fn, ref, diff, ints = _rope_case(op.split("_")[1])
  elif op == "embedding":
    fn, ref, diff, ints = _embedding_case()
  elif op == "sparse_linear":
    fn, ref, diff, ints = _sparse_linear_case()
  else:
    fn, ref, diff, ints = _cases(cols)[op]
  sweep(fn, ref, diff, ints, reduce_size=cols)


def _patch_embed_case():
  """images [2, 6, 9, 3] in 3 x 3 patches (6 per image, 7 tokens with the
  class token), every input poisoned: images, kernel, bias, pos_embed, cls_token."""
  images, kernel, bias, pos, cls = random_inputs(10, [(2, 6, 9, 3), (3, 3, 3, 5), (5,), (7, 5),
                                                      (5,)])
  call = lambda patch_embed: (lambda images, kernel, bias, pos, cls: patch_embed(
      images, kernel, bias, patch_size=3, pos_embed=pos, cls_token=cls))
  return (call(functools.partial(jaxops.patch_embed, implementation="ffi")),
          call(reference.patch_embed), [images, kernel, bias, pos, cls], ())


@backends.parametrize("op", {backends.CPU: ["patch_embed"], backends.HARNESS: ["patch_embed"]})
def test_patch_embed(backend, op):
  fn, ref, diff, ints = _patch_embed_case()
  sweep(fn, ref, diff, ints, reduce_size=27)


# -- attention --------------------------------------------------------------------------


def attention_excluding_masked(query, key, value, bias=None, mask=None, *, scale=None,
                               return_residual=False, **masking):
  """reference.attention (batched, 4-d bias and mask), except that an excluded
  (query, key) pair reads neither the query's nor the key's rows: each pair's
  q, k and v are zeroed where excluded before they meet, so no 0 * NaN."""
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  scale = 1.0 / math.sqrt(H) if scale is None else scale
  allowed = jnp.broadcast_to(reference.attention_allowed(B, N, T, S, mask=mask, **masking),
                             (B, N, T, S))
  pair = allowed[..., None]
  per_head = lambda x: jnp.repeat(x.astype(jnp.float32), N // K, axis=2).transpose(0, 2, 1, 3)
  q = jnp.where(pair, query.astype(jnp.float32).transpose(0, 2, 1, 3)[:, :, :, None], 0.0)
  k = jnp.where(pair, per_head(key)[:, :, None], 0.0)
  v = jnp.where(pair, per_head(value)[:, :, None], 0.0)
  logits = jnp.sum(q * k, axis=-1) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  logits = jnp.where(allowed, logits, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.where(allowed, jnp.exp(logits - row_max), 0.0)
  total = jnp.sum(unnormalized, axis=-1, keepdims=True)
  safe_total = jnp.where(total > 0, total, 1.0)
  probs = unnormalized / safe_total
  out = jnp.sum(probs[..., None] * v, axis=3).transpose(0, 2, 1, 3).astype(query.dtype)
  # NaN where a NaN reached the row (the reference gives -inf there).
  lse = jnp.where(total == 0, -jnp.inf, row_max + jnp.log(total))[..., 0]
  lse = lse.transpose(0, 2, 1).astype(query.dtype)
  return (out, lse) if return_residual else out


# name: ((B, T, S, N, K, H), keyword arguments). T * N / K >= 16 rows per KV
# head selects the CPU's tiled forward, fewer its decode kernel; bfloat16 the
# CUDA tensor-core (wmma) kernels.
def _attention_cases(H):
  B, T, S, N, K = 2, 9, 11, 4, 2
  lengths = dict(query_seq_lengths=np.array([T, T - 2], np.int32),
                 key_value_seq_lengths=np.array([S, S - 3], np.int32))
  mask = jax.random.bernoulli(jax.random.key(8), 0.75, (B, N, T, S))
  mask = mask.at[:, :, jnp.arange(T), jnp.arange(T)].set(True)
  return {
      # GQA, causal with an offset, a window, a mask, a bias, both lengths, the
      # log-sum-exp: the tiled forward, the backward and the JVP kernels.
      "all_masks": ((B, T, S, N, K, H), dict(is_causal=True, local_window_size=(5, 1), mask=mask,
                                             query_offset=1, with_bias=True, return_residual=True,
                                             **lengths)),
      # T = 1: the CPU's decode kernel.
      "decode": ((B, 1, S, N, K, H), dict(is_causal=True, query_offset=S - 1,
                                           key_value_seq_lengths=np.array([S, S - 3], np.int32))),
  }


ATTENTION = [("all_masks", jnp.float32), ("decode", jnp.float32), ("all_masks", jnp.bfloat16)]


@backends.parametrize("case,dtype", {backends.CPU: ATTENTION, backends.HARNESS: ATTENTION})
def test_attention(backend, case, dtype):
  (B, T, S, N, K, H), kwargs = _attention_cases(16)[case]
  kwargs = dict(kwargs)
  with_bias = kwargs.pop("with_bias", False)
  mask = kwargs.pop("mask", None)
  diff = random_inputs(4, [(B, T, N, H), (B, S, K, H), (B, S, K, H)], dtype)
  if with_bias:
    diff += random_inputs(5, [(1, N, T, S)], dtype)

  def call(fn):
    return lambda q, k, v, *b: fn(q, k, v, *(b or (None,)), mask, **kwargs)

  sweep(call(functools.partial(jaxops.attention, implementation="ffi")),
        call(attention_excluding_masked), diff, upper=call(reference.attention), last=True,
        reduce_size=S)


@pytest.mark.backends(backends.CPU, backends.HARNESS)
def test_attention_ignores_excluded_keys(backend):
  """NaN and inf in K and V rows that no query row attends (past the KV length,
  past the last row's causal limit, before the first row's window) leave every
  result finite and equal to the results with those rows zeroed."""
  B, T, S, N, K, H = 2, 4, 12, 2, 1, 16
  q, k, v = random_inputs(6, [(B, T, N, H), (B, S, K, H), (B, S, K, H)])
  kwargs = dict(is_causal=True, local_window_size=(6, 0), query_offset=7,
                key_value_seq_lengths=np.array([S, S - 2], np.int32))
  # Query t sits at t + 7 and sees keys t + 1 .. t + 7: key 0 never, key 11
  # never, keys 10 and 11 of batch 1 are past its length.
  excluded = jnp.zeros((B, S), bool).at[:, 0].set(True).at[:, 11].set(True).at[1, 10].set(True)
  f = jax.jit(lambda q, k, v: jax.value_and_grad(
      lambda q, k, v: jnp.sum(jnp.sin(jaxops.attention(q, k, v, implementation="ffi",
                                                       **kwargs))), argnums=(0, 1, 2))(q, k, v))
  rows = excluded[:, :, None, None]
  clean = f(q, jnp.where(rows, 0.0, k), jnp.where(rows, 0.0, v))
  for value in SPECIALS:
    loss, (dq, dk, dv) = f(q, jnp.where(rows, value, k), jnp.where(rows, value, v))
    assert_close(loss, clean[0], reduce_size=S, name=f"loss, {value}")
    assert_close(dq, clean[1][0], reduce_size=S, name=f"dq, {value}")
    # The excluded rows' gradients are 0, the others' those of the clean inputs.
    for name, got, want in zip(("dk", "dv"), (dk, dv), clean[1][1:]):
      assert_close(got, want, reduce_size=T * N, name=f"{name}, {value}")
      assert not bool(jnp.any(jnp.where(rows, got, 0.0))), (name, value)


# -- a NaN beside -inf in one row ---------------------------------------------------------


def _nan_and_neg_inf_rows(cols):
  """Row 1: a NaN and two -inf; row 2: a NaN and -inf everywhere else (no
  finite column); rows 0 and 3 finite."""
  x, = random_inputs(11, [(4, cols)])
  x = x.at[1, 2].set(np.nan).at[1, 5].set(-np.inf).at[1, cols - 1].set(-np.inf)
  return x.at[2].set(-np.inf).at[2, 1].set(np.nan)


def _neg_inf_row_cases(cols):
  labels = jnp.array([1, 5, 0, cols - 1], jnp.int32)
  ce = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
  return {
      "log_softmax": (functools.partial(jaxops.log_softmax, implementation="ffi"),
                      reference.log_softmax),
      "softmax": (functools.partial(jaxops.softmax, implementation="ffi"), reference.softmax),
      "causal_softmax": (
          lambda x: jaxops.causal_softmax(x.reshape(2, 2, cols), query_offset=cols - 2,
                                          implementation="ffi"),
          lambda x: reference.causal_softmax(x.reshape(2, 2, cols), query_offset=cols - 2)),
      "cross_entropy": (lambda x: jaxops.cross_entropy(x, labels, implementation="ffi", **ce),
                        lambda x: reference.cross_entropy(x, labels, **ce)),
  }


@backends.parametrize("op", {backends.CPU: ["log_softmax", "softmax", "causal_softmax",
                                            "cross_entropy"],
                             backends.HARNESS: ["log_softmax", "softmax", "causal_softmax",
                                                "cross_entropy"]})
def test_nan_beside_neg_inf_in_a_row(backend, op):
  """The -inf columns of a NaN row: log-probability -inf and gradient 0, as in
  the reference; the NaN everywhere else; the other rows unaffected. Strict:
  NaN and inf exactly where the reference has them. (The softmax family's
  derivatives know those columns from x: its y is NaN there too.)"""
  cols = HARNESS_COLS if backend == backends.HARNESS else COLS
  fn, ref = _neg_inf_row_cases(cols)[op]
  x = _nan_and_neg_inf_rows(cols)
  got, want = jax.jit(_results(fn, [x], ())), jax.jit(_results(ref, [x], ()))
  for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(got(x))[0],
                          jax.tree.leaves(want(x))):
    assert_close(a, e, reduce_size=cols, name=f"{op} {jax.tree_util.keystr(path)}")
