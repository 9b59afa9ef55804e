"""When the LayerNorm/RMSNorm wrappers (linen and nnx) can run the fused kernel.

The kernels normalise the last axis of one array with float32 statistics. Every
other configuration Flax allows (several reduction axes, features on another
axis, a mask, statistics across devices through ``axis_name``, float64 or
complex inputs) runs Flax's own computation on the same parameters, so values
and parameter trees are Flax's.
"""

from __future__ import annotations

from jaxops.flax._dtypes import is_kernel_dtype


def _canonical(ndim, axes):
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted(a % ndim for a in axes))


def runs_kernel(module, x, dtype, mask) -> bool:
  """``module`` has Flax's norm attributes; ``dtype`` is the computation dtype."""
  last = (x.ndim - 1,)
  return (mask is None and module.axis_name is None and x.ndim > 0
          and _canonical(x.ndim, module.reduction_axes) == last
          and _canonical(x.ndim, module.feature_axes) == last
          and is_kernel_dtype(x.dtype) and is_kernel_dtype(dtype)
          # Without it Flax reduces in the input's dtype: only Flax's code gives its values.
          and getattr(module, "force_float32_reductions", True))
