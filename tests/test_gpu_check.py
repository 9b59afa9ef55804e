"""tools/gpu_check.sh and its helpers, exercised without a GPU: the stages'
commands (--dry-run), the collection of its test selection, tools/gpu_smoke.py
on the CPU, and the summary writer on the files a run leaves."""

import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))

import gpu_check_summary  # noqa: E402
import gpu_smoke  # noqa: E402


def _dry_run(*args) -> dict[str, str]:
  """{stage: its line} from gpu_check.sh --dry-run."""
  with tempfile.TemporaryDirectory() as folder:
    out = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), "--dry-run", "--python",
                          sys.executable, "--out", f"{folder}/out", "--scratch",
                          f"{folder}/scratch", *args],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
  return {line.split(" ", 1)[0]: line for line in out.splitlines() if line}


def test_build_is_for_the_given_gpu_and_the_generic_cpu_variant_without_network():
  build = _dry_run("--arch", "90", "--wheels", "carried")["build"]
  for flag in ("--no-build-isolation", "--no-index", "--no-deps", "--target",
               "JAXOPS_CUDA_ARCHITECTURES=90", "JAXOPS_CPU_ISAS=generic",
               "CMAKE_PREFIX_PATH=", "cmeel.prefix", "wheels of carried"):
    assert flag in build, (flag, build)


def _test_command(*args) -> list[str]:
  line = _dry_run("--arch", "80", *args)["tests"]
  return shlex.split(line.split(":", 1)[1])


def test_the_test_selection_is_the_gpu_facing_files():
  command = _test_command()
  assert command[:2] == ["env", "JAXOPS_TEST_GPU=1"] and "-n" in command
  assert command[command.index("-k") + 1] == "not cpu and not cuda_harness"
  files = {pathlib.Path(a).name for a in command if a.startswith("tests/")}
  ops = {"norms", "softmax", "cross_entropy", "activations", "rope", "embedding", "adamw",
         "attention", "attention_decode", "paged_attention", "sampling", "routing",
         "patch_embed", "sparse", "nan_propagation", "models", "flax_attention", "sharding"}
  assert {f"test_{op}.py" for op in ops} <= files
  assert not any(f.startswith(("test_cuda_harness", "test_cpp_kernels", "test_cpu_isa"))
                 for f in files)
  assert all((ROOT / "tests" / f).is_file() for f in files)
  quick = _test_command("--quick")
  assert [a for a in quick if a.startswith("tests/")] == ["tests/test_norms.py"]


def test_the_quick_selection_collects_the_gpu_backend(tmp_path):
  """The tests stage's own command, with --collect-only (which tests/conftest.py
  allows without a GPU) and without xdist."""
  command = _test_command("--quick")
  for option, takes_value in (("-n", True), ("--timeout=120", False)):
    if option in command:
      del command[command.index(option):command.index(option) + 1 + takes_value]
  # One -q (pyproject's addopts) lists the test ids.
  command = [a for a in command if not a.startswith("--junitxml") and a != "-q"]
  out = subprocess.run([*command, "--collect-only"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  ids = [line for line in out.stdout.splitlines() if "::" in line]
  # The gpu backend's cases, and the tests without a backend (on JAX's default
  # backend, the GPU there); not the CPU's or the harness's cases.
  assert sum("[gpu-" in i for i in ids) >= 5, ids[:5]
  assert not any("cuda_harness" in i or "[cpu-" in i for i in ids)


def test_bench_and_optional_stages():
  lines = _dry_run("--arch", "90", "--profile", "default", "--sanitize")
  for family in ("roofline", "attention", "decode", "paged_attention", "norms", "adamw"):
    assert family in lines["bench"]
  assert "attention_fwd_mma_kernel" in lines["profile"] and "memcheck" in lines["sanitize"]
  quick = _dry_run("--arch", "90", "--quick")
  assert "norms --quick" in quick["bench"] and "profile" not in quick


def test_unknown_argument_is_refused():
  out = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), "--frobnicate"],
                       capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 2 and "unknown argument '--frobnicate'" in out.stderr


# -- tools/gpu_smoke.py ---------------------------------------------------------------


def test_smoke_families_are_the_kernel_files():
  assert sorted(gpu_smoke.FAMILIES) == gpu_smoke.kernel_files()


def test_every_kernel_maps_to_its_file():
  for stem in gpu_smoke.kernel_files():
    source = (gpu_smoke.CUDA_SOURCES / f"{stem}.cu").read_text()
    kernels = re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", source)
    assert kernels, stem
    for kernel in kernels:
      assert gpu_smoke.family_of_kernel(kernel) == stem, kernel
  assert gpu_smoke.family_of_kernel("no_such_kernel") is None


def test_smoke_runs_on_the_cpu_kernels():
  out = subprocess.run([sys.executable, "-P", str(TOOLS / "gpu_smoke.py"), "--family", "norms",
                        "attention_jvp", "sampling"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "all 3 families agree" in out.stdout and out.stdout.count("  ok ") >= 10


# -- tools/gpu_check_summary.py ----------------------------------------------------------

_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_norms" name="test_a[gpu-float32]" time="0.1"/>
<testcase classname="tests.test_norms" name="test_b[gpu-float32]" time="0.1">
  <failure message="AssertionError: 1.05e-05 &gt; 1e-05">trace</failure></testcase>
<testcase classname="tests.test_norms" name="test_c[cuda_harness]" time="0">
  <skipped message="CPU emulation"/></testcase>
<testcase classname="tests.test_sharding" name="test_d" time="0.2">
  <error message="fixture failed">trace</error></testcase>
</testsuite></testsuites>"""

_NCU = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","void jaxops::cuda::(anonymous namespace)::layer_norm_fwd_kernel<float, 4>(const float *)","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","41.50"
"0","1","python3","h","void jaxops::cuda::(anonymous namespace)::layer_norm_fwd_kernel<float, 4>(const float *)","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","88.1"
"0","1","python3","h","void jaxops::cuda::(anonymous namespace)::layer_norm_fwd_kernel<float, 4>(const float *)","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","71.2"
'''


def test_summary_reports_what_the_stages_left(tmp_path):
  out, scratch = tmp_path / "out", tmp_path / "scratch"
  out.mkdir()
  scratch.mkdir()
  (scratch / "env.txt").write_text("name, driver_version\nNVIDIA H200, 580.159\njax 0.11.2\n")
  (scratch / "stages.tsv").write_text("build\tok\t45\t150\ntests\tfailed (exit 1)\t200\t240\n"
                                      "bench\tskipped (budget)\t0\t0\n")
  (out / "tests.xml").write_text(_JUNIT)
  (out / "profiles.csv").write_text(_NCU + _NCU)  # two runs' files, concatenated
  (out / "sanitizer.txt").write_text("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
  prefix = tmp_path / "prefix"
  (prefix / "jaxops").mkdir(parents=True)
  (prefix / "jaxops" / "cuda_resource_usage.txt").write_text("norms.cu: layer_norm_fwd_kernel 3 40\n")
  text = gpu_check_summary.summary(out, scratch, prefix)
  assert "NVIDIA H200, 580.159" in text and "jax 0.11.2" in text
  assert "| tests | failed (exit 1) | 200 | 240 |" in text
  assert "| bench | skipped (budget) | 0 | 0 |" in text
  assert "1 passed, 1 failed, 1 error, 1 skipped" in text
  assert "tests.test_norms::test_b[gpu-float32]: AssertionError: 1.05e-05 > 1e-05" in text
  assert "tests.test_sharding::test_d: fixture failed" in text
  assert "No benchmark results" in text
  row = next(line for line in text.splitlines() if line.startswith("| layer_norm_fwd_kernel"))
  assert "41.50 us" in row and "88.1 %" in row and "71.2 %" in row and "(8192, 1, 1)" in row
  assert text.count("| layer_norm_fwd_kernel") == 1
  assert "ERROR SUMMARY: 0 errors" in text
  assert "layer_norm_fwd_kernel 3 40" in text


def test_summary_carries_the_bench_report_of_the_run(tmp_path):
  """A real (tiny) bench run's JSON lines become the summary's benchmark tables."""
  out = tmp_path / "out"
  out.mkdir()
  subprocess.run([sys.executable, "-P", "-m", "jaxops.bench", "norms", "--ops", "rms_norm",
                  "--shapes", "8x128", "--dtypes", "float32", "--passes", "fwd", "--runs", "1",
                  "--json", str(out / "bench.jsonl")], check=True, capture_output=True,
                 timeout=300)
  text = gpu_check_summary.summary(out, tmp_path, None)
  benchmarks = text[text.index("## Benchmarks"):]
  assert "### CPU" in benchmarks and "| norms | rms_norm | float32 | fwd | 8x128 |" in benchmarks
  assert "This page is generated" not in benchmarks  # the page's preamble is left out


def test_summary_without_any_stage(tmp_path):
  text = gpu_check_summary.summary(tmp_path, tmp_path, None)
  assert "(no stage ran)" in text and "No test report" in text and "No resource table" in text
