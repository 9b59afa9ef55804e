"""Mixture-of-experts routing: topk_router (primitives and public function) and
moe_aux_loss (a jnp function).

topk_router's forward primitive returns the weights and the chosen experts;
the experts are integers (a float0 tangent) and the weights are piecewise
smooth in the logits with the selection held fixed, so:

* the tangent primitive takes the logits, the chosen experts and the logits'
  tangent, and recomputes the scores of the row (no residual is saved: the
  scores cost one pass over a row that is read anyway);
* its transpose is the fused backward kernel: d logits from d weights through
  the renormalisation and the softmax or sigmoid, one pass over each row.

expert_bias only moves the selection, a piecewise constant function of it:
its derivative is zero wherever it exists, and no tangent is taken for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import reference
from jaxops._src import primitive, validation
from jaxops._src.autodiff import Differentiable
from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, batch_to_front, is_absent
from jaxops._src.sharding import leading_axes

# The kernels' `score` attribute (params/routing.h: RouterScore).
_SCORE_CODES = {name: code for code, name in enumerate(reference.ROUTER_SCORES)}


def _score_name(code: int) -> str:
  return reference.ROUTER_SCORES[code]


# -- primitives ------------------------------------------------------------------------


def _router_fwd_abstract_eval(logits, expert_bias, *, k, **params):
  per_choice = (*logits.shape[:-1], k)
  return (jax.core.ShapedArray(per_choice, jnp.float32),
          jax.core.ShapedArray(per_choice, jnp.int32))


def _router_fwd_reference(logits, expert_bias, *, k, score, renormalize, num_groups,
                          group_topk):
  return reference.topk_router(logits, k, score=_score_name(score), renormalize=renormalize,
                               expert_bias=None if is_absent(expert_bias) else expert_bias,
                               num_groups=num_groups, group_topk=group_topk)


def _weights_of(experts, score, renormalize):
  return lambda logits: reference.topk_router_weights(
      logits, experts, score=_score_name(score), renormalize=renormalize)


def _router_jvp_reference(logits, experts, dlogits, *, score, renormalize, **unused):
  return (jax.jvp(_weights_of(experts, score, renormalize), (logits,), (dlogits,))[1],)


def _router_bwd_reference(dweights, logits, experts, *, score, renormalize):
  _, vjp = jax.vjp(_weights_of(experts, score, renormalize), logits)
  return (vjp(dweights)[0],)


def _router_fwd_batch_rule(prim, args, dims, **params):
  """The vmapped axis becomes a leading token axis; a batched expert_bias (a
  bias per batch element) falls back to vmap of the reference."""
  (logits, expert_bias), (logits_dim, bias_dim) = args, dims
  if bias_dim is not NOT_MAPPED:
    return None
  return prim(jnp.moveaxis(logits, logits_dim, 0), expert_bias, **params), (0, 0)


def _row_batch_rule(prim, args, dims, **params):
  args, _ = batch_to_front(args, dims, range(len(args)))
  return prim(*args, **params), (0,)


def _same_as_logits(dweights, logits, experts, **params):
  return (jax.core.ShapedArray(logits.shape, logits.dtype),)


def _per_choice_tangent(logits, experts, dlogits, **params):
  return (jax.core.ShapedArray(experts.shape, jnp.float32),)


# Tokens shard; the experts axis (and the k choices) stay whole.
topk_router_fwd_p = FfiPrimitive(
    name="jaxops_topk_router_fwd", target="jaxops_topk_router_fwd",
    abstract_eval=_router_fwd_abstract_eval, reference=_router_fwd_reference,
    batch_rule=_router_fwd_batch_rule, sharding=leading_axes("xp -> xx"))
topk_router_jvp_p = FfiPrimitive(
    name="jaxops_topk_router_jvp", target="jaxops_topk_router_jvp",
    abstract_eval=_per_choice_tangent, reference=_router_jvp_reference,
    reference_params=("k", "num_groups", "group_topk"), batch_rule=_row_batch_rule,
    sharding=leading_axes("xxx -> x"))
topk_router_bwd_p = FfiPrimitive(
    name="jaxops_topk_router_bwd", target="jaxops_topk_router_bwd",
    abstract_eval=_same_as_logits, reference=_router_bwd_reference,
    batch_rule=_row_batch_rule, sharding=leading_axes("xxx -> x"))


def _router_transpose(cotangents, saved, wanted, *, score, renormalize, **unused):
  (dweights,), (logits, experts) = cotangents, saved
  return (topk_router_bwd_p(dweights, logits, experts, score=score,
                            renormalize=renormalize)[0],)


Differentiable(forward=topk_router_fwd_p, tangent=topk_router_jvp_p,
               transpose=_router_transpose, tangent_inputs=(0,), saved_inputs=(0,),
               saved_outputs=(1,), checkpoint_name="jaxops.topk_router")


# -- public functions ------------------------------------------------------------------


def _groups(op, num_groups, group_topk, num_experts, k):
  """(num_groups, group_topk), (1, 1) without a group limit."""
  if num_groups is None and group_topk is None:
    return 1, 1
  if num_groups is None:
    raise validation.value_error(op, "num_groups", "be given with group_topk", "None")
  if group_topk is None:
    raise validation.value_error(op, "group_topk", "be given with num_groups", "None")
  num_groups = validation.static_int(op, "num_groups", num_groups, low=1, high=num_experts)
  if num_experts % num_groups:
    raise validation.value_error(op, "num_groups", f"divide num_experts={num_experts}",
                                 str(num_groups))
  group_topk = validation.static_int(op, "group_topk", group_topk, low=1, high=num_groups)
  group_size = num_experts // num_groups
  if group_topk * group_size < k:
    raise validation.value_error(
        op, "group_topk", f"keep at least k={k} experts (group_topk * {group_size} experts "
        "per group >= k)", str(group_topk))
  return num_groups, group_topk


def topk_router(logits, k: int, *, score: str = "softmax", renormalize: bool = True,
                expert_bias=None, num_groups: int | None = None, group_topk: int | None = None,
                implementation=None):
  """The top-k mixture-of-experts router: (weights, experts) of each token.

  Scores are ``softmax(logits)`` over the experts or ``sigmoid(logits)``,
  computed in float32. The k experts of a token are those of the highest
  selection key ``score + expert_bias``, in descending order of it, ties to
  the lower expert index (as ``lax.top_k``); NaN keys rank last. Their
  weights are their *unbiased* scores, divided by the sum of the k when
  ``renormalize`` (softmax with ``renormalize=False`` gives the raw
  probabilities; sigmoid scores usually want it).

  Group-limited routing (DeepSeek-V3): the experts form ``num_groups`` equal
  groups of consecutive experts; a group's key is the sum of its two best
  selection keys (the one key of a one-expert group), and only the experts of
  the ``group_topk`` best groups compete. DeepSeek-V2's max-of-group variant
  is not provided: it differs only where a group's second-best key decides.

  Args:
    logits: [..., num_experts] float32, bfloat16 or float16 (the kernels), or
      float64 (the jnp reference).
    k: static int in [1, num_experts].
    score: "softmax" or "sigmoid".
    renormalize: divide the weights by their sum.
    expert_bias: optional [num_experts] float array (cast to float32), added to
      the scores for the selection only (DeepSeek-V3's load-balancing bias).
      It receives no gradient: the weights do not depend on it but through the
      selection, which is piecewise constant.
    num_groups, group_topk: static ints, both or neither: num_groups divides
      num_experts and group_topk * num_experts / num_groups >= k.
    implementation: None (the fused kernel where available, else the jnp
      reference), "ffi" (the kernel, or an error) or "xla" (the reference).

  Returns:
    ``(weights, experts)``. ``weights``: ``[..., k]`` float32 (float64 for
    float64 logits): routers compute in float32 and MoE layers combine expert
    outputs with float32 weights; cast them where the layer wants the
    activations' dtype. Differentiable in ``logits`` (the weights' gradient
    flows to the chosen experts' logits, and through softmax's normaliser to
    all of them). ``experts``: ``[..., k]`` int32, in descending order of the
    selection key (integers: float0 tangents).

  Raises:
    TypeError: ``logits`` is not a floating-point array, or ``k``,
      ``renormalize``, ``num_groups`` or ``group_topk`` has the wrong type.
    ValueError: ``k`` is not in ``[1, num_experts]``, ``score`` is unknown,
      ``expert_bias`` is not ``[num_experts]``, or the groups do not divide the
      experts or cannot hold ``k`` of them.

  Examples:
    >>> logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    >>> weights, experts = jaxops.topk_router(logits, 2)
    >>> experts
    Array([[1, 2]], dtype=int32)
    >>> weights
    Array([[0.731..., 0.268...]], dtype=float32)
  """
  op = "jaxops.topk_router"
  logits = validation.float_array(op, "logits", logits)
  validation.rank(op, "logits", logits, low=1, labels="[..., num_experts]")
  validation.non_empty_axis(op, "logits", logits)
  num_experts = logits.shape[-1]
  k = validation.static_int(op, "k", k, low=1, high=num_experts)
  score = validation.choice(op, "score", score, reference.ROUTER_SCORES)
  renormalize = validation.static_bool(op, "renormalize", renormalize)
  if expert_bias is not None:
    expert_bias = validation.float_array(op, "expert_bias", expert_bias)
    validation.shape(op, "expert_bias", expert_bias, (num_experts,), of="logits.shape[-1:]")
    expert_bias = expert_bias.astype(reference.compute_dtype(logits.dtype))
  num_groups, group_topk = _groups(op, num_groups, group_topk, num_experts, k)
  if logits.size == 0 or not primitive.use_kernel(op, implementation, {"logits": logits.dtype}):
    return reference.topk_router(logits, k, score=score, renormalize=renormalize,
                                 expert_bias=expert_bias, num_groups=num_groups,
                                 group_topk=group_topk)
  bias = absent(jnp.float32) if expert_bias is None else expert_bias
  weights, experts = topk_router_fwd_p(logits, bias, k=k, score=_SCORE_CODES[score],
                                       renormalize=renormalize, num_groups=num_groups,
                                       group_topk=group_topk)
  return weights, experts


def moe_aux_loss(probs, expert_counts, k: int, coeff: float, *, implementation=None):
  """The Switch Transformer / GShard load-balancing loss.

  ``coeff * num_experts * sum_e f_e * P_e`` with ``f_e = expert_counts[e] /
  (tokens * k)`` (the fraction of the routed slots that went to expert e) and
  ``P_e`` the mean over the tokens of ``probs[..., e]``. It is
  ``coeff`` for a perfectly balanced router and grows with the imbalance.

  Args:
    probs: [..., num_experts] router probabilities (e.g. ``softmax(logits)``),
      any float dtype; every leading axis counts tokens.
    expert_counts: [num_experts] integer or float: the tokens routed to each
      expert (``jnp.bincount(experts.ravel(), length=num_experts)``). A
      constant: it receives no gradient.
    k: static int >= 1, the experts per token.
    coeff: static float, the loss coefficient (e.g. 1e-2).
    implementation: None or "xla". There is no fused kernel: XLA computes this
      in one fused pass over probs (docs/benchmarks-log.md measures it against a plain
      read of probs), so a custom call could only add its overhead; "ffi"
      is an error.

  Returns a float32 scalar (float64 for float64 probs), differentiable in probs.
  With no tokens (a leading axis of size 0) it is 0, as cross_entropy's mean
  over no tokens is (f_e and P_e are 0 / 0 there), with a zero gradient.

  Raises:
    TypeError: ``probs`` is not a floating-point array, or ``k``/``coeff``
      have the wrong type.
    ValueError: ``expert_counts`` is not ``[num_experts]``, ``k`` < 1, or
      ``implementation="ffi"``.

  Examples:
    >>> probs = jnp.full((4, 2), 0.5)                  # a perfectly balanced router
    >>> jaxops.moe_aux_loss(probs, jnp.array([2, 2]), k=1, coeff=0.01)
    Array(0.01, dtype=float32)
  """
  op = "jaxops.moe_aux_loss"
  implementation = validation.choice(op, "implementation", implementation,
                                     primitive.IMPLEMENTATIONS)
  if implementation == "ffi":
    raise validation.value_error(
        op, "implementation", "be None or 'xla' (moe_aux_loss has no kernel: XLA fuses it "
        "into one pass over probs)", "'ffi'")
  probs = validation.float_array(op, "probs", probs)
  validation.rank(op, "probs", probs, low=1, labels="[..., num_experts]")
  validation.non_empty_axis(op, "probs", probs)
  expert_counts = validation.array(op, "expert_counts", expert_counts)
  if not (jnp.issubdtype(expert_counts.dtype, jnp.integer)
          or jnp.issubdtype(expert_counts.dtype, jnp.floating)):
    raise validation.type_error(op, "expert_counts", "have an integer or floating dtype",
                                str(expert_counts.dtype))
  validation.shape(op, "expert_counts", expert_counts, probs.shape[-1:], of="probs.shape[-1:]")
  k = validation.positive_int(op, "k", k)
  coeff = validation.static_float(op, "coeff", coeff)
  if probs.size == 0:
    # Every fraction would be 0 / 0: the mean over no tokens is 0 instead.
    return jnp.zeros((), reference.compute_dtype(probs.dtype))
  return reference.moe_aux_loss(probs, expert_counts, k, coeff)
