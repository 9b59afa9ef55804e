"""PyTorch as an optional peer of the CPU benchmarks (jaxops/bench/torch_peer.py,
timing.Eager, the attention family's torch column). torch is no dependency:
the tests that need it skip where it does not import (CI never installs it);
the rest hold without it. Nothing here is timed for a speed."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops.bench import attention, timing, torch_peer

needs_torch = pytest.mark.skipif(not torch_peer.available(), reason="torch does not import")


def test_an_eager_peer_is_timed_with_the_jax_functions():
  prepared = []

  def prepare(x):
    prepared.append(1)
    return (np.asarray(x),)

  fns = {"jax": lambda x: x * 2.0, "numpy": timing.Eager(lambda a: a * 2.0, prepare)}
  timings = timing.time_implementations(fns, jnp.arange(8.0), runs=2, interleave=True)
  assert set(timings) == {"jax", "numpy"} and prepared == [1]  # converted once, untimed
  assert timings["numpy"].ms > 0 and timings["numpy"].method.startswith("host:")
  assert timings["numpy"].temp_bytes is None  # no XLA program, no memory analysis
  assert timings["jax"].temp_bytes is not None


def test_an_eager_peer_refuses_donated_arguments():
  with pytest.raises(ValueError, match="donated"):
    timing.time_interleaved({"numpy": timing.Eager(lambda a: a, lambda x: (x,))},
                            jnp.arange(4.0), runs=1, donate_argnums=(0,))


def test_torch_is_held_to_jaxops_variant():
  assert torch_peer.same_isa_environment("avx512") == {}  # the widest: torch takes the CPU's
  avx2 = torch_peer.same_isa_environment("avx2")
  assert avx2["ATEN_CPU_CAPABILITY"] == "avx2" and avx2["ONEDNN_MAX_CPU_ISA"] == "AVX2"
  assert torch_peer.same_isa_environment("generic")["ATEN_CPU_CAPABILITY"] == "default"
  assert torch_peer.threads() >= 1


def _run_bench(tmp_path, capsys, *argv):
  path = tmp_path / "results.jsonl"
  assert attention.main(["--shapes", "1x16x1x8", "--dtypes", "bfloat16", "--masks", "causal",
                         "--runs", "1", "--json", str(path), *argv]) == 0
  records = [json.loads(line) for line in path.read_text().splitlines()]
  return capsys.readouterr().out, records


def test_without_torch_the_bench_is_unchanged(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(torch_peer, "available", lambda: False)
  out, records = _run_bench(tmp_path, capsys, "--passes", "fwd")
  assert "x torch" not in out and "torch ms" not in out and "# torch peer" not in out
  assert [set(r["implementations"]) for r in records] == [{"jaxops", "jax.nn", "xla"}]
  assert "torch" not in records[0]
  with pytest.raises(SystemExit, match="torch"):
    attention.main(["--impls", "jaxops", "torch", "--shapes", "1x16x1x8", "--runs", "1"])


@needs_torch
def test_to_torch_keeps_dtype_shape_and_values():
  torch = torch_peer.torch()
  assert torch.get_num_threads() == torch_peer.threads()
  x = jax.random.normal(jax.random.key(1), (3, 5), jnp.float32)
  for dtype, torch_dtype in [(jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)]:
    t = torch_peer.to_torch(x.astype(dtype))
    assert t.dtype == torch_dtype and tuple(t.shape) == (3, 5)
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(x.astype(dtype), np.float32))


@needs_torch
@pytest.mark.parametrize("causal", [False, True])
def test_the_torch_peer_computes_the_benchmarked_problem(causal):
  """torch's views [B, N, S, H] of the [B, S, N, H] arrays: the same attention
  (and gradients) as jax.nn's, so the ratio compares like with like."""
  shape = (2, 24, 3, 16)
  q, k, v, d = (jax.random.normal(key, shape, jnp.float32)
                for key in jax.random.split(jax.random.key(2), 4))
  [(_, forward)] = attention._torch_passes("fwd", causal)
  out = forward.fn(*forward.prepare(q, k, v, d)).transpose(1, 2).numpy()
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
  [(_, backward)] = attention._torch_passes("fwd+bwd", causal)
  grads = backward.fn(*backward.prepare(q, k, v, d))
  _, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal),
                   q, k, v)
  for got, want in zip(grads, vjp(d)):
    np.testing.assert_allclose(got.transpose(1, 2).numpy(), want, rtol=1e-4, atol=1e-4)


@needs_torch
def test_the_attention_bench_has_a_torch_column(tmp_path, capsys):
  out, records = _run_bench(tmp_path, capsys, "--passes", "fwd", "jvp")
  assert "x torch" in out and "# torch peer:" in out
  by_pass = {r["pass"]: r for r in records}
  forward = by_pass["fwd"]
  assert forward["implementations"]["torch"]["ms"] > 0
  assert forward["speedup"]["torch"] == pytest.approx(
      forward["implementations"]["torch"]["ms"] / forward["implementations"]["jaxops"]["ms"])
  assert forward["torch"]["sdpa_backend"] == "default"
  assert forward["torch"]["threads"] == torch_peer.threads()
  # Forward mode: torch's flash kernel may refuse it; the math backend then runs it.
  jvp = by_pass["jvp"]
  assert "ms" in jvp["implementations"]["torch"] or "skipped" in jvp["implementations"]["torch"]
  if "ms" in jvp["implementations"]["torch"]:
    assert jvp["torch"]["sdpa_backend"] in ("default", "math")
