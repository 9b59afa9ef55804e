"""jaxops: fused JAX operators lowered through XLA FFI to C++ and CUDA kernels."""

from jaxops._src.activations import geglu, gelu, silu, swiglu
from jaxops._src.attention import attention
from jaxops._src.cross_entropy import cross_entropy, linear_cross_entropy
from jaxops._src.embedding import embedding
from jaxops._src.export import export_checks
from jaxops._src.ffi_targets import cpu_isa
from jaxops._src.norms import add_rms_norm, layer_norm, rms_norm
from jaxops._src.paged_attention import paged_attention, paged_kv_update
from jaxops._src.patch_embed import patch_embed
from jaxops._src.ring_attention import ring_attention, zigzag_permute, zigzag_unpermute
from jaxops._src.rope import rope
from jaxops._src.routing import moe_aux_loss, topk_router
from jaxops._src.sampling import sample
from jaxops._src.softmax import causal_softmax, log_softmax, softmax
from jaxops import optim
from jaxops import sparse

__all__ = [
    "add_rms_norm", "attention", "causal_softmax", "cpu_isa", "cross_entropy", "embedding",
    "export_checks", "geglu", "gelu", "layer_norm", "linear_cross_entropy", "log_softmax",
    "moe_aux_loss", "optim", "paged_attention", "paged_kv_update", "patch_embed", "rms_norm",
    "ring_attention", "rope", "sample", "silu", "softmax", "sparse", "swiglu", "topk_router",
    "zigzag_permute", "zigzag_unpermute",
]
__version__ = "0.1.0"
