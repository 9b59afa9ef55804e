"""The benchmarks' timing (jaxops/bench/timing.py): the method is chosen from
the arguments' platform in one place, the device method runs on any arrays,
and backward passes take a random cotangent through jax.vjp. Tested for what
each function computes and which method it picks, never for a speed."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops.bench import timing


@pytest.mark.parametrize("platform, on_device", [("gpu", True), ("cuda", True), ("cpu", False),
                                                 ("tpu", False)])
def test_the_device_method_is_for_gpus_only(platform, on_device):
  assert timing.uses_device_timing(platform) is on_device


def test_the_platform_is_the_arguments_devices():
  assert timing.platform_of((jnp.ones(2), 3)) == "cpu"
  assert timing.platform_of(()) == jax.default_backend()


def test_cpu_arrays_are_timed_on_the_host():
  t = timing.time_call(lambda x: x * 2.0, jnp.arange(8.0), runs=2)
  assert t.method.startswith("host:") and t.sys_share is not None
  assert math.isfinite(t.ms) and t.ms > 0


def test_gpu_arrays_would_be_timed_on_the_device(monkeypatch):
  monkeypatch.setattr(timing, "platform_of", lambda args: "gpu")
  t = timing.time_call(lambda x: x * 2.0, jnp.arange(8.0), runs=2)
  assert t.method.startswith("device:") and t.sys_share is None
  assert math.isfinite(t.ms) and t.ms > 0
  timings = timing.time_implementations({"a": lambda x: x + 1.0, "b": lambda x: x - 1.0},
                                        jnp.arange(8.0), runs=2, interleave=True)
  assert all(t.method.startswith("device:") for t in timings.values())


def test_the_device_method_copies_donated_arguments():
  x = jnp.arange(16.0)
  t = timing.time_on_device(lambda x: x + 1.0, x, runs=2, donate_argnums=(0,))
  assert t.ms > 0 and "back-to-back calls" in t.method
  np.testing.assert_array_equal(x, jnp.arange(16.0))  # the caller's array is never consumed


def test_the_host_methods_take_donated_arguments_too():
  x = jnp.arange(16.0)
  fns = {"a": lambda x: x + 1.0, "b": lambda x: x * 2.0}
  timings = timing.time_implementations(fns, x, runs=2, interleave=True, donate_argnums=(0,))
  assert set(timings) == {"a", "b"} and all(t.method.startswith("host:") for t in
                                            timings.values())
  assert timing.time_jitted(fns["a"], x, runs=1, donate_argnums=(0,)).ms > 0
  np.testing.assert_array_equal(x, jnp.arange(16.0))


def _refuses(x):
  raise ValueError("not supported for this dtype\nmore detail")


def test_a_peer_that_may_refuse_is_reported_skipped():
  timings = timing.time_implementations({"ours": lambda x: x + 1.0, "cudnn": _refuses},
                                        jnp.ones(4), runs=1, may_refuse=("cudnn",))
  assert isinstance(timings["ours"], timing.Timing)
  assert timings["cudnn"] == "ValueError: not supported for this dtype"
  with pytest.raises(ValueError):
    timing.time_implementations({"ours": _refuses}, jnp.ones(4), runs=1)


def test_a_host_timer_replaces_the_host_method_only():
  calls = []

  def host_timer(fn, *args, runs, donate_argnums=()):
    calls.append(runs)
    return timing.Timing(1.0, "host: custom", None, None)

  timings = timing.time_implementations({"a": lambda x: x, "b": lambda x: -x}, jnp.ones(2),
                                        runs=3, host_timers={"a": host_timer})
  assert timings["a"].method == "host: custom" and calls == [3]
  assert timings["b"].method.startswith("host: median")


def test_the_backward_pass_is_a_vjp_with_the_given_cotangent():
  x = jnp.linspace(-1.0, 1.0, 6)
  dy = timing.random_like(x.shape, jnp.float32)
  assert not np.allclose(dy, 1.0)
  (dx,) = timing.forward_or_backward("fwd+bwd", jnp.sin)(x, dy)
  np.testing.assert_allclose(dx, jnp.cos(x) * dy, rtol=1e-6)
  np.testing.assert_allclose(timing.forward_or_backward("fwd", jnp.sin)(x, dy), jnp.sin(x))


def test_the_backward_pass_differentiates_the_chosen_arguments():
  f = lambda a, b: a * b
  a, b = jnp.arange(3.0), jnp.arange(3.0) + 1.0
  grads = timing.forward_or_backward("fwd+bwd", f, wrt=(1,))(a, b, jnp.ones(3))
  assert len(grads) == 1
  np.testing.assert_allclose(grads[0], a)
