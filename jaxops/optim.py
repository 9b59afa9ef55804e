"""Optimizers built on jaxops kernels: ``jaxops.optim.adamw``."""

from jaxops._src.adamw import AdamW, AdamWState, adamw

__all__ = ["AdamW", "AdamWState", "adamw"]
