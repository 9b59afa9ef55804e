"""The suite gives XLA only the flags the running jaxlib knows (support/xla_flags.py):
an unknown flag in XLA_FLAGS aborts the process (jaxlib 0.11 has no
--xla_cpu_use_fusion_emitters, which tests/conftest.py asks 0.10 for)."""

import os

from support import xla_flags


def test_unknown_flags_are_dropped_and_known_ones_kept():
  known = {"xla_backend_optimization_level": "0", "xla_llvm_disable_expensive_passes": "true"}
  unknown = {"xla_jaxops_no_such_flag": "true", "xla_jaxops_nor_this_one": "3"}
  assert xla_flags.Probe({**unknown, **known}).known() == known


def test_flags_the_environment_sets_are_left_as_they_are(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2 --xla_dump_to=/tmp/x")
  flags = {"xla_backend_optimization_level": "0", "xla_llvm_disable_expensive_passes": "true"}
  added = xla_flags.missing(flags)
  assert added == {"xla_llvm_disable_expensive_passes": "true"}
  xla_flags.add_to_environment(added)
  assert os.environ["XLA_FLAGS"] == ("--xla_backend_optimization_level=2 --xla_dump_to=/tmp/x "
                                     "--xla_llvm_disable_expensive_passes=true")
