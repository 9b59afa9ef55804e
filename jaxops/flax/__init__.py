"""Flax wrappers of the jaxops layers: ``jaxops.flax.linen`` and ``jaxops.flax.nnx``.

Parameter names, shapes and defaults follow Flax's own modules, so a checkpoint
of a Flax model maps onto the jaxops one unchanged.
"""
