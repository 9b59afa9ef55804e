"""The float32 precision policy of the ops with products inside (docs/precision.md).

XLA computes a float32 dot on an NVIDIA GPU (sm_80+) on the TF32 tensor cores
unless it is asked for more: at the default precision and at ``"high"``
(``lax.Precision.DEFAULT``/``HIGH``: XLA's GPU dot allows TF32 up to HIGH), in
full float32 at ``"highest"`` (``"float32"``). A dot asks through its
``precision`` argument or, without one, through the config
``jax_default_matmul_precision`` (``jax.default_matmul_precision(...)``).

jaxops' ops with products inside (attention and its JVP and backward, paged
attention, patch_embed, sparse.linear, linear_cross_entropy) follow the same
policy: each takes ``precision=None`` as a dot does and resolves it at trace
time, with :func:`allow_tf32`, into one static parameter of its primitives,
``allow_tf32``, which every custom call carries as an attribute (declared once
in C++, xla_ffi/matmul_precision.h). True lets a kernel run float32 products on
TF32 tensor cores; a kernel never has to (the CPU kernels, and the CUDA kernels
that stay on the CUDA cores, compute in full float32 either way). jit's cache
key includes the config, so a function traced under another setting retraces.
"""

from __future__ import annotations

import jax
from jax import lax

from jaxops._src import validation

# The lax.Precision levels XLA's GPU dots run in TF32 (DEFAULT, HIGH: "default",
# "high", "tensorfloat32", "bfloat16", "bfloat16_3x", "fastest").
_TF32_LEVELS = frozenset({lax.Precision.DEFAULT, lax.Precision.HIGH})

# Algorithm presets no more precise than one TF32 pass (narrower inputs, or
# TF32 itself); the rest (several passes, F32_F32_F32, F64_F64_F64) and any
# preset a later JAX adds ask for more, so they get full float32.
_TF32_PRESETS = frozenset({
    "DEFAULT", "ANY_F8_ANY_F8_F32", "ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_ANY",
    "ANY_F8_ANY_F8_ANY_FAST_ACCUM", "F16_F16_F16", "F16_F16_F32", "BF16_BF16_BF16",
    "BF16_BF16_F32", "TF32_TF32_F32",
})

_EXPECTED = ("be None, a precision name ('default', 'high', 'highest', 'float32', ...), a "
             "lax.Precision, a pair of them, or a lax.DotAlgorithmPreset or lax.DotAlgorithm")


def allow_tf32(op: str, precision=None) -> bool:
  """Whether ``op``'s float32 products may run on TF32 tensor cores.

  ``precision`` takes what ``lax.dot``'s does: None (the context's
  ``jax_default_matmul_precision``, read now, at trace time; unset is XLA's
  default), a name (``"default"``, ``"high"``, ``"highest"``, ``"float32"``,
  ``"tensorfloat32"``, ``"bfloat16"``, ``"bfloat16_3x"`` or an algorithm
  preset's), a ``lax.Precision``, a pair of those (one per operand: the more
  precise decides, as XLA's GPU dot takes the higher), a
  ``lax.DotAlgorithmPreset`` or a ``lax.DotAlgorithm`` (full float32: its
  precision types are not interpreted). True where XLA's GPU dot would use
  TF32 for it.
  """
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
    if precision is None:
      return True
  if isinstance(precision, lax.DotAlgorithm):  # a NamedTuple: before the pairs
    return False
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2:
      raise validation.value_error(op, "precision", _EXPECTED, f"a sequence of {len(precision)}")
    return _TF32_LEVELS.issuperset([_level(op, p) for p in precision])
  if isinstance(precision, lax.DotAlgorithmPreset):
    return precision.name in _TF32_PRESETS
  if isinstance(precision, str) and precision in lax.DotAlgorithmPreset.__members__:
    return precision in _TF32_PRESETS
  return _level(op, precision) in _TF32_LEVELS


def _level(op: str, precision) -> lax.Precision:
  """A lax.Precision, or a name of one ("highest", "float32", ...)."""
  if isinstance(precision, lax.Precision):
    return precision
  if not isinstance(precision, str):
    raise validation.type_error(op, "precision", _EXPECTED, validation.describe(precision))
  try:
    return lax.Precision(precision)
  except ValueError:
    raise validation.value_error(op, "precision", _EXPECTED,
                                 validation.describe(precision)) from None


def dot_precision(allow_tf32: bool) -> lax.Precision:
  """The ``precision`` of an XLA dot that follows the resolved policy: DEFAULT
  (TF32 on a GPU) where TF32 is allowed, else HIGHEST (full float32)."""
  return lax.Precision.DEFAULT if allow_tf32 else lax.Precision.HIGHEST
