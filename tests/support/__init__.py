"""Shared test code (not test modules): the backends the op tests run on
(backends.py), the CUDA lowering helpers (lowering.py), the helpers of the
sanitizer tests (sanitizers.py) and of the Flax wrapper tests (flax_twins.py),
the sharding tests' meshes (meshes.py) and the session's XLA flags (xla_flags.py).

Test modules import from here, never from one another
(tests/test_suite_layout.py checks it).
"""
