"""What a benchmark family records (jaxops/bench/results.py): one table row and
one JSON line per result, from tiny real runs of two families, and the
roofline command. The schema is what `python -m jaxops.bench report` reads;
no figure is checked for its value."""

import json

import pytest

from jaxops.bench import ceilings, norms, results, roofline, sampling
from jaxops.bench.timing import Timing

ENVIRONMENT = {"platform", "device", "host", "machine", "jax", "jaxlib", "jaxops_revision",
               "date", "command", "preset"}


@pytest.fixture(autouse=True)
def small_roofline(monkeypatch):
  """Ceilings measured on small buffers: their size is not what is tested."""
  monkeypatch.setitem(ceilings._COPY_BYTES, "host", 1 << 20)
  monkeypatch.setitem(ceilings._MATMUL_SIZE, "host", 64)
  ceilings.copy_bandwidth.cache_clear()
  ceilings.matmul_rate.cache_clear()
  yield
  ceilings.copy_bandwidth.cache_clear()
  ceilings.matmul_rate.cache_clear()


def read(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_norms_run_records_each_result(tmp_path, capsys):
  path = tmp_path / "norms.jsonl"
  argv = ["--ops", "rms_norm", "--shapes", "8x16", "--dtypes", "float32", "--passes", "fwd",
          "fwd+bwd", "--runs", "1", "--json", str(path)]
  assert norms.main(argv) == 0
  records = read(path)
  assert [r["pass"] for r in records] == ["fwd", "fwd+bwd"]
  for r in records:
    assert ENVIRONMENT <= set(r)
    assert (r["family"], r["case"], r["shape"], r["dtype"]) == ("norms", "rms_norm", "8x16",
                                                                "float32")
    assert r["platform"] == "cpu" and r["preset"] == "cpu"
    assert r["command"] == "python -m jaxops.bench norms " + " ".join(argv)
    assert r["work"] == {"bytes": (2 if r["pass"] == "fwd" else 3) * 8 * 16 * 4}
    assert r["roofline"]["GB/s"] > 0 and "copy" in r["roofline"]["what"]
    assert set(r["implementations"]) == {"jaxops", "xla"}
    for entry in r["implementations"].values():
      assert entry["ms"] > 0 and entry["method"].startswith("host:")
      assert entry["gb_s"] > 0 and entry["roofline_share"] > 0 and 0 <= entry["sys_share"] <= 1
    assert r["speedup"]["xla"] == pytest.approx(r["implementations"]["xla"]["ms"] /
                                                r["implementations"]["jaxops"]["ms"])
  out = capsys.readouterr().out
  assert "# roofline:" in out and "x xla" in out
  assert len([line for line in out.splitlines() if line.startswith("rms_norm")]) == 2


def test_a_sampling_run_records_every_peer(tmp_path):
  path = tmp_path / "sampling.jsonl"
  assert sampling.main(["--cases", "greedy", "--shapes", "2x64", "--dtypes", "float32",
                        "--runs", "1", "--json", str(path)]) == 0
  (record,) = read(path)
  assert set(record["implementations"]) == {"jaxops", "xla", "typical"}
  assert set(record["speedup"]) == {"xla", "typical"}


def test_a_skipped_peer_is_recorded_with_its_reason(tmp_path, capsys):
  args = norms.parse(["--json", str(tmp_path / "r.jsonl")])
  reporter = results.Reporter("attention", args, ["--quick"], [("case", 8)],
                              ["jaxops", "cudnn", "xla"], units=("flops",))
  timings = {"jaxops": Timing(2.0, "device: test", None, None), "cudnn": "ValueError: float32",
             "xla": Timing(3.0, "device: test", None, 1 << 20)}
  reporter.add(["c"], results.Result("attention causal", "1x2x3x4", "float32", "fwd", timings,
                                     results.computed(4e9)))
  (record,) = read(tmp_path / "r.jsonl")
  assert record["implementations"]["cudnn"] == {"skipped": "ValueError: float32"}
  assert record["implementations"]["jaxops"]["tflop_s"] == pytest.approx(2.0)
  assert record["implementations"]["xla"]["temp_bytes"] == 1 << 20
  assert record["speedup"] == {"xla": 1.5}
  assert "# cudnn skipped: ValueError: float32" in capsys.readouterr().out


def test_the_roofline_command_prints_and_records_both_ceilings(tmp_path, capsys):
  path = tmp_path / "ceilings.jsonl"
  assert roofline.main(["--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "copy bandwidth" in out and "GB/s" in out
  assert "matmul rate" in out and "TFLOP/s" in out
  copy, matmul = read(path)
  assert (copy["family"], copy["case"], matmul["case"]) == ("roofline", "copy bandwidth",
                                                            "matmul rate")
  assert copy["roofline"]["GB/s"] > 0 and matmul["roofline"]["TFLOP/s"] > 0
  assert ENVIRONMENT <= set(copy) and copy["implementations"] == {}


@pytest.mark.parametrize("x, text", [(1234.5, "1234"), (0.04012, "0.04012"), (3.14159, "3.142"),
                                     (0.0, "0")])
def test_figures_keep_four_digits_without_exponent(x, text):
  assert results.fixed(x) == text
