"""SparseDense (linen and nnx): a Dense layer whose kernel is 2:4 sparse along
its inputs, on ``jaxops.sparse.linear``.

The call and constructor arguments are Flax Dense's / Linear's: ``features``
(linen) or ``in_features, out_features`` (nnx), ``use_bias``, ``dtype``,
``param_dtype``, ``precision`` (as in Flax, the product's:
``jaxops.sparse.linear``'s ``precision``, whose kernels compute in full float32
at every setting; docs/precision.md), ``kernel_init`` (called with Flax's dense kernel shape
``(in, features)``; the result is pruned to 2:4 with ``prune_2_4`` and packed)
and ``bias_init``; plus ``implementation``. ``in`` must be a multiple of 4.

Parameters: ``kernel_values [features, in / 2]`` and ``bias``; the packed
positions ``kernel_metadata [features, ceil(in / 8)]`` uint8 (the layout of
:mod:`jaxops.sparse`) are integer state, not trained, so they live outside the
parameters, as Flax keeps BatchNorm's statistics: in linen in the
``"sparsity"`` collection (``apply({"params": ..., "sparsity": ...}, x)``), in
nnx in a :class:`SparseMetadata` variable (not an ``nnx.Param``). So
``jax.grad`` over ``params``, ``nnx.grad``, optax and ``nnx.Optimizer`` see
float parameters only, and training keeps the 2:4 pattern.

``SparseDense.from_dense_params(params)`` (linen: the ``{"params": ...,
"sparsity": ...}`` variables) and ``SparseDense.from_linear(linear)`` (nnx)
build the layer from a trained dense layer's parameters: the kernel pruned to
its 2 largest magnitudes of every 4 inputs, then packed; the bias kept.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxops import sparse
from jaxops.flax._dtypes import compute_dtype

Initializer = Callable[..., Any]
# The linen collection of the packed positions (integer state, never trained).
SPARSITY = "sparsity"
_DEFAULT_KERNEL_INIT = nn.initializers.lecun_normal()


def _packed_from_dense_kernel(kernel) -> sparse.SparseWeight:
  """A Flax dense kernel [in, out] -> the packed [out, in] 2:4 weight."""
  pruned, _ = sparse.prune_2_4(jnp.asarray(kernel).T)
  return sparse.compress(pruned)


def _apply(x, values, metadata, bias, dtype, param_dtype, precision, implementation):
  dtype = compute_dtype(x, dtype, param_dtype, True)
  weight = sparse.SparseWeight(values.astype(dtype), metadata, x.shape[-1])
  return sparse.linear(x.astype(dtype), weight, None if bias is None else bias.astype(dtype),
                       precision=precision, implementation=implementation)


class LinenSparseDense(nn.Module):
  """``flax.linen.Dense`` with a 2:4 sparse kernel (see the module docstring)."""

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Initializer = _DEFAULT_KERNEL_INIT
  bias_init: Initializer = nn.initializers.zeros_init()
  implementation: str | None = None

  @nn.compact
  def __call__(self, inputs):
    in_features = inputs.shape[-1]
    # Values and metadata come from one dense kernel: the first initializer
    # packs it, the second takes the metadata of the same packing.
    packed = {}

    def init_values(key):
      kernel = self.kernel_init(key, (in_features, self.features), self.param_dtype)
      packed["weight"] = _packed_from_dense_kernel(kernel)
      return packed["weight"].values

    values = self.param("kernel_values", init_values)
    metadata = self.variable(SPARSITY, "kernel_metadata", lambda: packed["weight"].metadata).value
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    return _apply(inputs, values, metadata, bias, self.dtype, self.param_dtype, self.precision,
                  self.implementation)

  @staticmethod
  def from_dense_params(params) -> dict:
    """The variables of a SparseDense from the params of a ``flax.linen.Dense``
    (``{"kernel": [in, out], "bias": [out]}``): ``{"params": {"kernel_values",
    "bias"}, "sparsity": {"kernel_metadata"}}``, the kernel pruned to 2:4 and packed."""
    weight = _packed_from_dense_kernel(params["kernel"])
    new_params = {"kernel_values": weight.values}
    if "bias" in params:
      new_params["bias"] = params["bias"]
    return {"params": new_params, SPARSITY: {"kernel_metadata": weight.metadata}}


class SparseMetadata(nnx.Variable):
  """The packed 2:4 positions (uint8) of a SparseDense: state, not a trained parameter."""


class NnxSparseDense(nnx.Module):
  """``flax.nnx.Linear`` with a 2:4 sparse kernel (see the module docstring)."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Initializer = _DEFAULT_KERNEL_INIT,
               bias_init: Initializer = nn.initializers.zeros_init(), rngs: nnx.Rngs,
               implementation: str | None = None):
    kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
    weight = _packed_from_dense_kernel(kernel)
    self.in_features, self.out_features = in_features, out_features
    self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype
    self.precision, self.implementation = precision, implementation
    self.kernel_values = nnx.Param(weight.values)
    self.kernel_metadata = SparseMetadata(weight.metadata)
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else None)

  def __call__(self, inputs):
    bias = None if self.bias is None else self.bias[...]
    return _apply(inputs, self.kernel_values[...], self.kernel_metadata[...], bias, self.dtype,
                  self.param_dtype, self.precision, self.implementation)

  @classmethod
  def from_linear(cls, linear: nnx.Linear, *, implementation: str | None = None):
    """A SparseDense with ``linear``'s settings and its kernel pruned to 2:4 and packed."""
    layer = cls(linear.in_features, linear.out_features, use_bias=linear.bias is not None,
                dtype=linear.dtype, param_dtype=linear.param_dtype,
                kernel_init=lambda key, shape, dtype: linear.kernel[...],
                bias_init=lambda key, shape, dtype: (linear.bias[...] if linear.bias is not None
                                                     else jnp.zeros(shape, dtype)),
                rngs=nnx.Rngs(0), implementation=implementation)
    return layer
