"""Transformer models built from the jaxops Flax modules.

- :mod:`jaxops.models.decoder`: a decoder-only language model (pre-norm RMSNorm,
  RoPE, grouped-query attention, SwiGLU MLP, tied embedding) in linen and nnx
  flavours that share their math and their parameters.
- :mod:`jaxops.models.generate`: KV-cache decoding under ``jit`` + ``fori_loop``.
- :mod:`jaxops.models.encoder_decoder`: the "Attention is all you need"
  encoder-decoder (post-norm LayerNorm, sinusoidal positions, padding and
  look-ahead masks, cross-attention), linen.
- :mod:`jaxops.models.training`, :mod:`jaxops.models.data`,
  :mod:`jaxops.models.checkpoint`: the training loop pieces the demo and the
  benchmark use (data-parallel over a mesh, resumable).

Every model takes ``implementation`` (None, "ffi" or "xla") in its config and
passes it to every jaxops op, so the same model runs on the pure-jnp reference.
"""

from jaxops.models.config import DecoderConfig, EncoderDecoderConfig

__all__ = ["DecoderConfig", "EncoderDecoderConfig"]
