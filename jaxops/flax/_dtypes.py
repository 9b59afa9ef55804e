"""dtype rule shared by the linen and nnx wrappers, as Flax applies it: compute in
``dtype`` when given, else in the promotion of the input and parameter dtypes
(the input's own dtype when the module has no parameters)."""

import jax.numpy as jnp

from jaxops._src import primitive


def compute_dtype(x, dtype, param_dtype, has_params: bool):
  if dtype is not None:
    return jnp.dtype(dtype)
  return jnp.result_type(x.dtype, param_dtype) if has_params else x.dtype


def is_kernel_dtype(dtype) -> bool:
  """A dtype the fused kernels compute in; others (float64, complex) run Flax's own code."""
  return jnp.dtype(dtype) in primitive.SUPPORTED_FLOAT_DTYPES
