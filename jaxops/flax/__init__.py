"""Flax wrappers of the jaxops layers: ``jaxops.flax.linen`` and ``jaxops.flax.nnx``.

Each module named like a Flax one (LayerNorm, RMSNorm, Embed, the multi-head
attention modules) subclasses it: every constructor and call argument of
Flax's, with Flax's defaults, parameter trees and values, plus
``implementation``. Where the kernel cannot honour an argument the module runs
Flax's own computation on the same parameters (docs/flax.md).
``dot_product_attention`` in each is an ``attention_fn`` for Flax's modules.
"""
