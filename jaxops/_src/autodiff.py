"""How jaxops primitives are differentiated: forward and reverse mode, any order.

Part of the mechanism (:mod:`jaxops._src.primitive`). An op describes its
differentiation once, with :class:`Differentiable`, and the mechanism registers
JAX's rules the way JAX's own ``lax`` primitives are built::

  forward primitive F      primals -> outputs (+ residuals: mean/rstd, logsumexp...)
  JVP rule of F            outputs = F(primals)
                           output tangents = T(saved values, input tangents)
  tangent primitive T      linear in the input tangents; in forward mode it runs
                           a fused JVP kernel (or the reference's JVP)
  transpose of T           the op's fused backward kernel: what grad/vjp run

Reverse mode is JAX's linearize-then-transpose: linearizing F's JVP rule leaves
F in the primal computation and T in the linear one, and transposing T calls
the backward kernel, so ``jax.grad`` runs exactly the forward and backward
kernels. Forward mode (``jax.jvp``, ``jacfwd``) evaluates T. Every primitive
that the rules emit (T, the backward kernels) is differentiable again through
its reference, so second and higher order hold in every combination of modes.

An op whose forward is linear in its differentiable operands (rope, embedding)
is its own tangent primitive; only its transpose is given.

Residual outputs (a norm's mean and rstd, cross-entropy's logsumexp) are not
outputs of the public op: their tangent is declared zero. Every primitive that
consumes one therefore recomputes it in its reference (which is what gets
differentiated), so derivatives of any order stay exact.

Fused forward mode (``fused``): attention computes its output and tangent in
one pass over K/V. The JVP rule then emits that fused primitive; partial
evaluation (linearize, ``jax.checkpoint``) splits it back into F and T, so
reverse mode is unchanged. Those two splitting rules are the only registries of
JAX's partial evaluation jaxops fills; both are public
(``jax.interpreters.partial_eval``).

Checkpointing: the residuals F hands to T carry a name (``checkpoint_name``,
the op's public name, e.g. ``"jaxops.attention"``), so
``jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names(
"jaxops.attention"))`` keeps them instead of running the forward kernel again
in the backward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import Saveable, checkpoint_name
from jax.extend.core import DropVar, Var, new_jaxpr_eqn
from jax.interpreters import ad, batching
from jax.interpreters import partial_eval as pe

from jaxops._src.primitive import NOT_MAPPED, FfiPrimitive, absent, vary, vma

# transpose(cotangents, saved, wanted, **params) -> one cotangent per tangent
# operand of T. cotangents: of T's results, None where JAX's is a symbolic zero.
# saved: T's non-tangent operands. wanted[i]: the aval of the cotangent the
# i-th tangent operand needs, or None where none is needed (that input is not
# differentiated, or its tangent was zero): return None there.
Transpose = Callable[..., Sequence[Any]]


def _checkpoint_name_primitive():
  """The primitive ``checkpoint_name`` binds, as remat policies see it."""
  return jax.make_jaxpr(lambda x: checkpoint_name(x, "jaxops"))(0.0).eqns[0].primitive


_NAME_PRIMITIVE = _checkpoint_name_primitive()


@dataclasses.dataclass(frozen=True)
class Differentiable:
  """The differentiation of one op's forward primitive; registers JAX's rules.

  Attributes:
    forward: the forward primitive F.
    transpose: see ``Transpose``; calls the op's backward primitive(s).
    tangent_inputs: F's operands that have tangents (float inputs; labels,
      ids, masks and lengths have none).
    checkpoint_name: the name of F's residuals for ``jax.checkpoint`` policies.
    outputs: how many of F's first results are the op's (differentiable)
      outputs; the rest are residuals with a zero tangent. None: all.
    tangent: T, with operands ``(*saved_inputs, *saved_outputs, *tangents)``
      (one tangent per ``tangent_inputs`` entry, ``absent`` where it is zero)
      and one result per output. None: F is linear in ``tangent_inputs`` and is
      its own tangent primitive (the tangent replaces the primal operand).
    saved_inputs, saved_outputs: the operands / results of F that T (and the
      transpose) take.
    jvp_forward: bound instead of F when differentiating: F's results
      followed by extra residuals that only differentiation needs.
    fused: forward mode in one kernel: operands ``(*F's operands, *tangents)``,
      results ``(*F's results, *output tangents)``.
  """

  forward: FfiPrimitive
  transpose: Transpose
  tangent_inputs: Sequence[int]
  checkpoint_name: str
  outputs: int | None = None
  tangent: FfiPrimitive | None = None
  saved_inputs: Sequence[int] = ()
  saved_outputs: Sequence[int] = ()
  jvp_forward: FfiPrimitive | None = None
  fused: FfiPrimitive | None = None

  def __post_init__(self):
    if self.tangent is None:
      if len(self.tangent_inputs) != 1 or self.fused or self.jvp_forward:
        raise ValueError(f"{self.forward.name}: a linear forward has one linear operand")
      ad.primitive_jvps[self.forward.primitive] = self._linear_jvp
      ad.primitive_transposes[self.forward.primitive] = self._transpose_linear_forward
      return
    if self.fused is not None and self.jvp_forward is not None:
      raise ValueError(f"{self.forward.name}: fused forward mode computes F's own results")
    ad.primitive_jvps[self.forward.primitive] = self._jvp
    ad.primitive_transposes[self.tangent.primitive] = self._transpose_tangent
    if self.fused is not None:
      fused = self.fused.primitive
      ad.primitive_transposes[fused] = self._transpose_fused
      batching.primitive_batchers[fused] = self._batch_fused
      pe.custom_partial_eval_rules[fused] = self._split_fused_partial_eval
      pe.partial_eval_jaxpr_custom_rules[fused] = self._split_fused_policy

  # -- the JVP rules --------------------------------------------------------------------

  def _tangent_operands(self, primals, tangents):
    """One tangent per tangent input: JAX's, or the absent placeholder for a zero."""
    return [absent(primals[i].dtype) if type(tangents[i]) is ad.Zero else tangents[i]
            for i in self.tangent_inputs]

  def _forward_results(self, primals, params):
    """F's results when differentiating (with ``jvp_forward``'s extra residuals)."""
    return list((self.jvp_forward or self.forward)(*primals, **params))

  def _saved(self, primals, results):
    named = [checkpoint_name(results[j], self.checkpoint_name) for j in self.saved_outputs]
    return [primals[i] for i in self.saved_inputs] + named

  def _jvp(self, primals, tangents, **params):
    n_forward = _num_results(self.forward, [jax.typeof(p) for p in primals], params)
    if all(type(tangents[i]) is ad.Zero for i in self.tangent_inputs):
      results = self.forward(*primals, **params)
      return results, [_zero(r) for r in results]
    tangent_operands = self._tangent_operands(primals, tangents)
    if self.fused is not None:
      fused_results = self.fused(*primals, *tangent_operands, **params)
      results, output_tangents = list(fused_results[:n_forward]), list(fused_results[n_forward:])
    else:
      results = self._forward_results(primals, params)
      saved = self._saved(primals, results)
      for j, value in zip(self.saved_outputs, saved[len(self.saved_inputs):]):
        results[j] = value
      output_tangents = list(self.tangent(*saved, *tangent_operands, **params))
      results = results[:n_forward]
    return results, output_tangents + [_zero(r) for r in results[len(output_tangents):]]

  def _linear_jvp(self, primals, tangents, **params):
    (i,) = self.tangent_inputs
    results = self.forward(*primals, **params)
    if type(tangents[i]) is ad.Zero:
      return results, [_zero(r) for r in results]
    operands = list(primals)
    operands[i] = tangents[i]
    return results, list(self.forward(*operands, **params))

  # -- the transpose rules: the backward kernels --------------------------------------

  def _transpose(self, cotangents, saved, tangent_operands, params):
    """Cotangents of the tangent operands (None where not wanted)."""
    if any(ad.is_undefined_primal(x) for x in saved):
      raise NotImplementedError(f"{self.forward.name}: the tangent is linear in the tangents "
                                "only; transposing it in a saved value is not defined")
    wanted = [t.aval if ad.is_undefined_primal(t) else None for t in tangent_operands]
    cotangents = [None if type(c) is ad.Zero else c for c in cotangents]
    if all(w is None for w in wanted) or all(c is None for c in cotangents):
      return [None] * len(tangent_operands)
    grads = list(self.transpose(cotangents, list(saved), wanted, **params))
    for index, (grad, aval) in enumerate(zip(grads, wanted)):
      if aval is None:
        continue
      if grad is not None:
        # Inside shard_map a cotangent has its primal's varying axes; one the
        # transpose computed from invariant values alone (a zero, a constant)
        # is cast to vary over them.
        grads[index] = grad = vary(grad, vma(aval))
      if (grad is None or grad.shape != aval.shape or grad.dtype != aval.dtype
          or vma(jax.typeof(grad)) != vma(aval)):
        got = None if grad is None else jax.typeof(grad).str_short()
        raise AssertionError(f"{self.forward.name}: transpose gave {got} for a tangent of "
                             f"{aval.str_short()}")
    return [g if w is not None else None for g, w in zip(grads, wanted)]

  def _transpose_tangent(self, cotangents, *operands, **params):
    n_saved = len(self.saved_inputs) + len(self.saved_outputs)
    saved, tangent_operands = operands[:n_saved], operands[n_saved:]
    return [None] * n_saved + self._transpose(cotangents, saved, tangent_operands, params)

  def _transpose_linear_forward(self, cotangents, *operands, **params):
    (i,) = self.tangent_inputs
    saved = [x for j, x in enumerate(operands) if j != i]
    out = [None] * len(operands)
    out[i] = self._transpose(cotangents, saved, [operands[i]], params)[0]
    return out

  def _transpose_fused(self, cotangents, *operands, **params):
    """The fused primitive left in a linear program (a checkpoint that recomputes
    rather than saves): the forward runs again for the residuals, then the
    backward kernel."""
    n = len(operands) - len(self.tangent_inputs)
    primals, tangent_operands = operands[:n], operands[n:]
    avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in primals]
    n_outputs = len(cotangents) - _num_results(self.forward, avals, params)
    if any(type(c) is not ad.Zero for c in cotangents[:-n_outputs]):
      raise NotImplementedError(f"{self.forward.name}: the fused forward-mode primitive is "
                                "linear in its tangent results only")
    saved = self._saved(primals, self._forward_results(primals, params))
    return [None] * n + self._transpose(cotangents[-n_outputs:], saved, tangent_operands, params)

  # -- the fused primitive under vmap and partial evaluation ---------------------------

  def _batch_fused(self, operands, dims, **params):
    """Unbatched primals with batched tangents (``jacfwd``) leave the primal results
    unbatched, as JAX requires: F once, then T over the tangents."""
    n = len(operands) - len(self.tangent_inputs)
    if any(d is not NOT_MAPPED for d in dims[:n]):
      return self.fused._batch(operands, dims, **params)
    primals = operands[:n]
    results = self._forward_results(primals, params)
    saved = self._saved(primals, results)
    tangents = jax.vmap(lambda *t: tuple(self.tangent(*saved, *t, **params)),
                        in_axes=tuple(dims[n:]))(*operands[n:])
    return [*results, *tangents], [NOT_MAPPED] * len(results) + [0] * len(tangents)

  def _split_fused_partial_eval(self, trace, *tracers, **params):
    """Partial evaluation with known primals (linearize, vjp): F is computed now,
    T is staged with the unknown tangents."""
    n = len(tracers) - len(self.tangent_inputs)
    if not all(t.is_known() for t in tracers[:n]):
      return trace.default_process_primitive(self.fused.primitive, tracers, params)
    primals = [t.pval.get_known() for t in tracers[:n]]
    results = self._forward_results(primals, params)
    saved = self._saved(primals, results)
    tangents = [t.pval.get_known() if t.is_known() else t for t in tracers[n:]]
    if all(t.is_known() for t in tracers[n:]):
      return [*results, *self.tangent(*saved, *tangents, **params)]
    staged = trace.default_process_primitive(self.tangent.primitive, [*saved, *tangents], params)
    return [*results, *staged]

  def _split_fused_policy(self, saveable, unknowns, instantiated, eqn):
    """Policy-driven partial evaluation (``jax.checkpoint``): F on the known side;
    on the staged side T from F's saved residuals when the policy saves them (by
    primitive or by the op's checkpoint name), else the fused primitive again
    (recomputing the residuals, transposed by ``_transpose_fused``)."""
    n = len(eqn.invars) - len(self.tangent_inputs)
    primals, tangents = eqn.invars[:n], eqn.invars[n:]
    n_results = _num_results(self.forward, [v.aval for v in primals], eqn.params)
    results, output_tangents = eqn.outvars[:n_results], eqn.outvars[n_results:]
    residuals = []

    def needs(var, index):
      if isinstance(var, Var) and not unknowns[index] and not instantiated[index]:
        residuals.append(var)

    if any(unknowns[:n]) or not any(unknowns[n:]):
      # Not a JVP being split: the default rule (staged whole, or all known).
      if any(unknowns):
        for index, var in enumerate(eqn.invars):
          needs(var, index)
        return None, eqn, [True] * len(eqn.outvars), [True] * len(eqn.outvars), residuals
      return eqn, None, [False] * len(eqn.outvars), [False] * len(eqn.outvars), []

    known = new_jaxpr_eqn(primals, results, self.forward.primitive, eqn.params, set(),
                          eqn.source_info, eqn.ctx)
    saved_outputs = [results[j] for j in self.saved_outputs]
    by_primitive = saveable(self.forward.primitive, *[v.aval for v in primals], **eqn.params)
    save = _saves(by_primitive) or all(
        _saves(saveable(_NAME_PRIMITIVE, v.aval, name=self.checkpoint_name)) for v in saved_outputs)
    if save:
      saved_inputs = [primals[i] for i in self.saved_inputs]
      for i in self.saved_inputs:
        needs(primals[i], i)
      residuals.extend(saved_outputs)
      staged = new_jaxpr_eqn([*saved_inputs, *saved_outputs, *tangents], output_tangents,
                             self.tangent.primitive, eqn.params, set(), eqn.source_info, eqn.ctx)
    else:
      for index, var in enumerate(primals):
        needs(var, index)
      dropped = [DropVar(v.aval) for v in results]
      staged = new_jaxpr_eqn(eqn.invars, [*dropped, *output_tangents], self.fused.primitive,
                             eqn.params, set(), eqn.source_info, eqn.ctx)
    for index, var in enumerate(tangents, start=n):
      needs(var, index)
    unknown_out = [False] * n_results + [True] * len(output_tangents)
    return known, staged, unknown_out, unknown_out, residuals


def _saves(policy_result) -> bool:
  """Whether a remat policy's answer keeps a value (an offload counts as no:
  the fused primitive is then recomputed, which is right, if slower)."""
  return policy_result is True or policy_result is Saveable


def _zero(value):
  return ad.Zero(jax.typeof(value).to_tangent_aval())


def _num_results(forward: FfiPrimitive, operand_avals, params) -> int:
  avals, _ = forward.primitive.abstract_eval(*operand_avals, **params)
  return len(avals)


def not_differentiable(forward: FfiPrimitive) -> None:
  """Registers the JVP of a primitive whose results are all integers (sampled
  token ids): the forward kernel runs and every result's tangent is a symbolic
  zero (float0), so ``jax.jvp`` and ``jax.grad`` of code around the op work
  without running its reference."""

  def jvp(primals, tangents, **params):
    del tangents
    results = forward.primitive.bind(*primals, **params)
    return results, [_zero(r) for r in results]

  ad.primitive_jvps[forward.primitive] = jvp
