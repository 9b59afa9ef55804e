"""``python -m jaxops.bench context_parallel`` (``attention --context-parallel``): a
small run on 4 host devices (tests/conftest.py) records, for each
implementation, a time and the temporary memory per device, and the ring's is
below the all-gather's and XLA's."""

import json

import pytest

from jaxops.bench import attention, context_parallel
from support import meshes


def test_attention_context_parallel_is_the_family(capsys):
  with pytest.raises(SystemExit):
    attention.main(["--context-parallel", "--help"])
  assert "python -m jaxops.bench context_parallel" in capsys.readouterr().out


def test_a_small_run_records_memory_per_device(tmp_path, capsys):
  meshes.require_devices(4)
  path = tmp_path / "results.jsonl"
  assert context_parallel.main(["--shapes", "1x1024x2x16", "--devices", "4", "--runs", "1",
                                "--masks", "causal", "--passes", "fwd+bwd",
                                "--json", str(path)]) == 0
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert [r["pass"] for r in records] == ["fwd+bwd"]
  for record in records:
    assert record["family"] == "context_parallel" and record["devices"] == 4
    impls = record["implementations"]
    assert set(impls) == {"jaxops", "all_gather", "attention", "xla"}
    temp = {name: impl["temp_bytes"] for name, impl in impls.items()}
    assert temp["jaxops"] < temp["all_gather"] < temp["xla"], temp
  assert "1x1024x2x16" in capsys.readouterr().out
