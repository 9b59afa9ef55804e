"""jaxops: fused JAX operators lowered through XLA FFI to C++ and CUDA kernels."""

from jaxops._src.cross_entropy import cross_entropy, linear_cross_entropy
from jaxops._src.norms import add_rms_norm, layer_norm, rms_norm
from jaxops._src.softmax import causal_softmax, log_softmax, softmax

__all__ = [
    "add_rms_norm",
    "causal_softmax",
    "cross_entropy",
    "layer_norm",
    "linear_cross_entropy",
    "log_softmax",
    "rms_norm",
    "softmax",
]
__version__ = "0.1.0"
