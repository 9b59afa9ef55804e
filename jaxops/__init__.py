"""jaxops: fused JAX operators lowered through XLA FFI to C++ and CUDA kernels."""

from jaxops._src.attention import attention
from jaxops._src.norms import add_rms_norm, layer_norm, rms_norm

__all__ = ["add_rms_norm", "attention", "layer_norm", "rms_norm"]
__version__ = "0.1.0"
