"""`python -m jaxops.bench report` (jaxops/bench/report.py): the one-page report
from the families' JSON lines, on a small synthetic input. The plot is made
where matplotlib is installed, and skipped with a reason where it is not."""

import importlib.util
import json
import sys

import pytest

from jaxops.bench import report

CPU = {"platform": "cpu", "device": "cpu", "host": "Test CPU, 2 cores",
       "machine": "Test CPU, 2 cores, jax 0.10.2, backend cpu, GLIBC_TUNABLES=(unset)",
       "jax": "0.10.2", "jaxlib": "0.10.2", "jaxops_revision": "abc1234", "preset": "cpu"}
GPU = dict(CPU, platform="gpu", device="NVIDIA H100 80GB HBM3", host="Test host, 16 cores",
           machine="Test host, 16 cores, jax 0.11.2, backend gpu, device NVIDIA H100",
           preset="gpu")


def record(environment, family, case, shape, dtype, pass_name, ms, peers, share=0.5,
           date="2026-11-27T10:00:00+00:00"):
  implementations = {"jaxops": {"ms": ms, "method": "test", "gb_s": 1.0, "roofline_share": share}}
  implementations.update({peer: {"ms": peer_ms, "method": "test"}
                          for peer, peer_ms in peers.items()})
  return dict(environment, family=family, case=case, shape=shape, dtype=dtype,
              date=date, command=f"python -m jaxops.bench {family} --json x", work=None,
              roofline=None, implementations=implementations,
              speedup={peer: peer_ms / ms for peer, peer_ms in peers.items()},
              **{"pass": pass_name})


def write_input(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


@pytest.fixture
def cpu_input(tmp_path):
  return write_input(tmp_path / "cpu.jsonl", [
      record(CPU, "norms", "rms_norm", "8192x4096", "float32", "fwd", 1.0, {"xla": 2.0}, 0.4),
      record(CPU, "norms", "rms_norm", "32768x1024", "float32", "fwd", 1.0, {"xla": 8.0}, 0.6,
             date="2026-11-27T11:00:00+00:00"),
      record(CPU, "attention", "attention causal", "1x2048x8x64", "bfloat16", "fwd+bwd", 2.0,
             {"jax.nn": 1.0, "xla": 6.0}),
  ])


def test_a_row_per_op_dtype_and_pass_over_its_shapes(cpu_input, tmp_path):
  page = tmp_path / "BENCHMARKS.md"
  assert report.main(["--input", cpu_input, "--markdown", str(page)]) == 0
  text = page.read_text()
  assert text.startswith("# Benchmarks")
  assert f"python -m jaxops.bench report --input {cpu_input} --markdown {page}" in text
  assert "## CPU: Test CPU, 2 cores" in text
  assert "2026-11-27T10:00:00+00:00 to 2026-11-27T11:00:00+00:00" in text
  assert "- `python -m jaxops.bench norms --json x` (preset cpu)\n" in text
  # 2x and 8x over two shapes: their geometric mean 4x, and the range.
  assert ("| norms | rms_norm | float32 | fwd | 8192x4096, 32768x1024 | 49% (40%–60%) | "
          "4.00x (2.00x–8.00x) | xla 4.00x (2.00x–8.00x) |") in text
  # The fastest peer is jax.nn, which is twice as fast as jaxops here.
  assert "| 0.50x | jax.nn 0.50x; xla 3.00x |" in text
  assert "No GPU results yet" in text and "tools/gpu_check.sh" in text
  assert "No plot was asked for" in text
  assert "Roofline ceilings, as each run measured them: none recorded" in text


def test_each_platform_gets_its_section(cpu_input, tmp_path):
  ceiling = dict(GPU, family="roofline", case="copy bandwidth", shape=None, dtype=None,
                 date="2026-11-27T10:00:00+00:00", command="python -m jaxops.bench roofline",
                 roofline={"GB/s": 3000.0, "what": "copy"}, implementations={}, speedup={},
                 **{"pass": None})
  gpu_norms = record(GPU, "norms", "rms_norm", "8192x4096", "bfloat16", "fwd", 0.05,
                     {"xla": 0.04})
  gpu_norms["roofline"] = {"GB/s": 3100.0, "what": "copy"}
  gpu_input = write_input(tmp_path / "gpu.jsonl", [ceiling, gpu_norms])
  page = tmp_path / "page.md"
  notes = tmp_path / "notes.md"
  notes.write_text("Runs reduced to one shape.\n")
  report.main(["--input", cpu_input, gpu_input, "--notes", str(notes), "--markdown", str(page)])
  text = page.read_text()
  assert "## CPU: Test CPU, 2 cores" in text and "## GPU: NVIDIA H100 80GB HBM3" in text
  assert "| norms | rms_norm | bfloat16 | fwd | 8192x4096 | 50% | 0.80x | xla 0.80x |" in text
  assert "No GPU results yet" not in text
  assert "as each run measured them: copy bandwidth 3000–3100 GB/s" in text
  assert "| roofline |" not in text  # ceilings are not rows
  assert "\n\nRuns reduced to one shape.\n\n" in text


def test_without_matplotlib_the_plot_is_skipped(cpu_input, tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  page, plot = tmp_path / "page.md", tmp_path / "plot.png"
  assert report.main(["--input", cpu_input, "--markdown", str(page), "--plot", str(plot)]) == 0
  assert not plot.exists()
  assert "The plot was skipped: matplotlib is not installed" in page.read_text()
  assert "plot skipped" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the optional bench extra)")
def test_with_matplotlib_the_page_shows_the_plot(cpu_input, tmp_path):
  (tmp_path / "results").mkdir()
  page, plot = tmp_path / "page.md", tmp_path / "results" / "plot.png"
  report.main(["--input", cpu_input, "--markdown", str(page), "--plot", str(plot)])
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "](results/plot.png)" in page.read_text()
