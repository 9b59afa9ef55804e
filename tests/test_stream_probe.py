"""The C++ streaming-read probe `python -m jaxops.bench decode` measures the
machine against (tools/stream_read_probe.cc): one figure per pass, each a
positive rate, and its arguments checked (a small buffer: this tests the
module, not the machine)."""

import math

import pytest

from jaxops import _jaxops_stream_probe as probe


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_one_positive_rate_per_pass(threads):
  rates = probe.stream_read_gbs(1 << 20, 3, threads)
  assert len(rates) == 3
  assert all(math.isfinite(r) and r > 0 for r in rates)


@pytest.mark.parametrize("kwargs, name", [
    ({"bytes": 1 << 10, "runs": 1}, "bytes"),
    ({"bytes": 1 << 20, "runs": 0}, "runs"),
    ({"bytes": 1 << 20, "runs": 1, "threads": -1}, "threads"),
])
def test_bad_arguments_name_themselves(kwargs, name):
  with pytest.raises(ValueError, match=name):
    probe.stream_read_gbs(**kwargs)
