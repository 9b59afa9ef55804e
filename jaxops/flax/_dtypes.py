"""dtype rule shared by the linen and nnx wrappers, as Flax applies it: compute in
``dtype`` when given, else in the promotion of the input and parameter dtypes
(the input's own dtype when the module has no parameters)."""

import jax.numpy as jnp

# What the fused kernels compute in; other dtypes (float64, complex) run Flax's own code.
KERNEL_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def compute_dtype(x, dtype, param_dtype, has_params: bool):
  if dtype is not None:
    return jnp.dtype(dtype)
  return jnp.result_type(x.dtype, param_dtype) if has_params else x.dtype


def is_kernel_dtype(dtype) -> bool:
  return jnp.dtype(dtype) in KERNEL_DTYPES
