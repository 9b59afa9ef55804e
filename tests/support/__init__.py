"""Shared test code (not test modules): the backends the op tests run on
(backends.py), the CUDA lowering helpers (lowering.py) and the helpers of the
sanitizer tests (sanitizers.py).

Test modules import from here, never from one another
(tests/test_suite_layout.py checks it).
"""
