"""`python -m jaxops.bench decode`'s timing of a decode step (jaxops/bench/decode.py):
back-to-back calls over copies of the arguments that together exceed the
last-level cache. Tested for what it computes (how many copies, a per-call
time, the cache size), not for what this machine measures."""

import math

import jax.numpy as jnp
import pytest

from jaxops.bench import decode


def test_last_level_cache_is_a_plausible_size():
  assert 1 << 20 <= decode.last_level_cache_bytes() <= 1 << 34


@pytest.mark.parametrize("cache_bytes, copies", [
    (500, 4),      # 2 x 1000 bytes of cache
    (2000, 1),     # one copy is already twice the cache
    (667, 3),      # rounded up
    (1, decode._MAX_COPIES),
])
def test_copies_add_up_to_twice_the_cache(monkeypatch, cache_bytes, copies):
  monkeypatch.setattr(decode, "last_level_cache_bytes", lambda: 1000)
  assert decode.step_copies(cache_bytes) == copies


def test_a_step_time_per_call(monkeypatch):
  monkeypatch.setattr(decode, "last_level_cache_bytes", lambda: 1000)
  timing = decode.time_steps(lambda x: x * 2.0, (jnp.arange(4.0),), cache_bytes=500, runs=3)
  assert math.isfinite(timing.ms) and timing.ms > 0
  assert timing.method.startswith("host:") and "4 copies" in timing.method


def test_steps_alternate_with_the_probe(monkeypatch):
  """Each round reads the probe, then times the step; the step's time is the
  median over the rounds and every round's probe rate is kept."""
  monkeypatch.setattr(decode, "last_level_cache_bytes", lambda: 1000)
  order = []
  monkeypatch.setattr(decode, "cpp_stream_bandwidth",
                      lambda runs: order.append("probe") or 10.0 * len(order))
  real_time_steps = decode.time_steps

  def time_steps(*args):
    order.append("step")
    return real_time_steps(*args)

  monkeypatch.setattr(decode, "time_steps", time_steps)
  probe_gbs = []
  timer = decode.alternating_timer(cache_bytes=500, rounds=3, probe_gbs=probe_gbs)
  timing = timer(lambda x: x * 2.0, jnp.arange(4.0), runs=2)
  assert order == ["probe", "step"] * 3
  assert probe_gbs == [10.0, 30.0, 50.0]
  assert math.isfinite(timing.ms) and "median of 3 rounds alternated" in timing.method
