"""Test-session set-up shared by every test file.

The sharding tests need several devices. On the CPU, XLA makes them from
`--xla_force_host_platform_device_count`, read once when the backend starts,
so it is set here, before any test imports run a computation. Single-device
tests are unaffected: arrays live on the first device unless a test shards them.
"""

import os

SHARDING_TEST_DEVICES = 8

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (
      f"{_flags} --xla_force_host_platform_device_count={SHARDING_TEST_DEVICES}").strip()
