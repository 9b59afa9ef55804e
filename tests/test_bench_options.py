"""The options every benchmark family takes (jaxops/bench/options.py): --preset,
--quick, --json and --runs, with explicit options winning over the preset.
Parsing only: nothing is timed."""

import importlib

import pytest

from jaxops.bench import __main__ as bench_main
from jaxops.bench import options

FAMILIES = [name for name in bench_main.commands() if name not in bench_main.TOOLS]


def family(name):
  return importlib.import_module(f"jaxops.bench.{name}")


def test_the_command_knows_every_family():
  assert {"attention", "decode", "paged_attention", "norms", "softmax", "cross_entropy",
          "activations", "adamw", "model"} <= set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("preset", options.PRESETS)
def test_a_preset_sets_its_sizes(name, preset):
  module = family(name)
  args = module.parse(["--preset", preset])
  assert args.preset == preset and not args.quick and args.json is None
  for option, value in module.PRESETS[preset].items():
    assert getattr(args, option) == value, option
  assert args.runs > 0


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("preset", options.PRESETS)
def test_quick_is_a_subset_of_the_preset(name, preset):
  module = family(name)
  args = module.parse(["--preset", preset, "--quick", "--json", "results.jsonl", "--runs", "2"])
  assert args.quick and args.json == "results.jsonl" and args.runs == 2
  for option, value in module.QUICK[preset].items():
    assert getattr(args, option) == value, option
    full = module.PRESETS[preset].get(option)
    if isinstance(value, list) and isinstance(full, list):
      assert set(value) <= set(full), option


def test_explicit_options_override_the_preset():
  args = family("norms").parse(["--preset", "gpu", "--quick", "--shapes", "4x8", "--dtypes",
                                "float16"])
  assert args.shapes == ["4x8"] and args.dtypes == ["float16"]
  assert args.ops == family("norms").QUICK["gpu"]["ops"]
  assert family("decode").parse(["--preset", "gpu", "--paged"]).paged
  assert family("attention").parse(["--preset", "cpu", "--masks", "full"]).masks == ["full"]


def test_the_default_preset_follows_the_backend(monkeypatch):
  monkeypatch.setattr(options.jax, "default_backend", lambda: "gpu")
  assert options.default_preset() == "gpu"
  assert family("softmax").parse([]).shapes == family("softmax").PRESETS["gpu"]["shapes"]
  monkeypatch.setattr(options.jax, "default_backend", lambda: "cpu")
  assert family("softmax").parse([]).preset == "cpu"


def test_help_lists_the_presets(capsys):
  with pytest.raises(SystemExit):
    family("attention").parse(["--help"])
  out = capsys.readouterr().out
  assert "--preset gpu: --shapes 4x4096x16x64 4x4096x16x128" in out
  assert "--quick with --preset cpu:" in out
  with pytest.raises(SystemExit):
    family("decode").parse(["--help"])
  assert "--kv-len 8192 --no-paged" in capsys.readouterr().out  # as a command line says it


def test_a_bad_preset_is_refused():
  with pytest.raises(SystemExit):
    family("norms").parse(["--preset", "tpu"])


def test_usage_lists_the_families_and_the_tools(capsys):
  assert bench_main.main([]) == 2
  usage = capsys.readouterr().err
  assert "python -m jaxops.bench roofline" in usage
  assert "python -m jaxops.bench report --input" in usage
  assert all(name in usage for name in FAMILIES)
  assert not any(helper in usage.split("}")[0] for helper in ("timing", "options", "results"))
