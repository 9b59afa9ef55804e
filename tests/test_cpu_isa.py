"""The CPU kernel variants (avx512, avx2, generic) and their run-time choice.

The rest of the suite runs on the variant the machine's CPU picks. Here the
op tests of SUBSET run again, in a subprocess, on every variant below it
(forced with JAXOPS_CPU_ISA), so that the avx2 and generic kernels are tested
on a machine whose best is avx512; the variable's errors are checked, and the
variant libraries are disassembled to check that each uses only instructions
of its own level. tests/test_cpu_isa_qemu.py runs jaxops on emulated CPUs
without AVX-512.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import jaxops
from jaxops import _jaxops_cpu
from support import background, parallel
from support.background import prestart

VARIABLE = "JAXOPS_CPU_ISA"
ISAS = tuple(_jaxops_cpu.cpu_isas())
BEST = _jaxops_cpu.best_cpu_isa()
LOWER = ISAS[ISAS.index(BEST) + 1:]
REPO = pathlib.Path(__file__).resolve().parent.parent

# Values and derivatives (reverse and forward mode) of every op family, in
# float32, bfloat16 and float16, on rows that are not a multiple of any vector
# width (257, 4099); attention's masks, decode (few-row) path and head dims
# below, between and above the vector widths. The code that differs between
# variants is the kernels' vector code and its tails. The activations' forward
# mode runs the kernels their reverse mode runs, so only the latter is here.
# About 40 s per variant on an idle 2-core machine.
_DTYPES = ("float32", "bfloat16", "float16")
_MODES = ("vjp", "jvp")
SUBSET = [
    *(f"tests/test_norms.py::test_derivatives_match_reference[{op}-cpu-{mode}-(11, 257)-{dtype}]"
      for mode in _MODES for dtype in _DTYPES for op in ("layer_norm", "rms_norm", "add_rms_norm")),
    *(f"tests/test_softmax.py::test_derivatives_match_reference[{op}-cpu-{mode}-(3, 2, 4099)-{dtype}]"
      for mode in _MODES for dtype in _DTYPES for op in ("softmax", "log_softmax")),
    "tests/test_softmax.py::test_causal_derivatives_match_reference[cpu-vjp-bfloat16]",
    "tests/test_softmax.py::test_causal_derivatives_match_reference[cpu-jvp-float32]",
    *(f"tests/test_cross_entropy.py::test_vjp_matches_reference[cpu-(11, 257)-mean-{dtype}]"
      for dtype in _DTYPES),
    *(f"tests/test_cross_entropy.py::test_jvp_matches_reference[cpu-{dtype}-{{}}]" for dtype in _DTYPES),
    *(f"tests/test_activations.py::test_vjp_matches_reference[{op}-cpu-(2, 4099)-{dtype}]"
      for dtype in _DTYPES
      for op in ("gelu_tanh", "gelu_erf", "silu", "swiglu", "geglu_tanh", "geglu_erf")),
    *(f"tests/test_activations.py::test_float32_accuracy_in_ulps[cpu-{case}]"
      for case in ("gelu_tanh-fn0", "gelu_erf-fn1", "silu-silu")),
    *(f"tests/test_attention.py::test_dtypes_forward_and_derivatives[cpu-{mode}-{case}-{dtype}]"
      for mode in _MODES for case in ("causal", "all") for dtype in _DTYPES),
    "tests/test_attention.py::test_grad_matches_reference[all]",
    "tests/test_attention.py::test_shapes[cpu-(3, 1, 19, 4, 4, 32, True)-float32]",
    "tests/test_attention.py::test_shapes[cpu-(2, 5, 9, 3, 3, 7, False)-float32]",
    "tests/test_attention.py::test_shapes[cpu-(1, 67, 131, 2, 1, 80, True)-float32]",
    *(f"tests/test_rope.py::test_vjp_matches_reference[cpu-(3, 5, 1, 7)-{style}-rd2-{dtype}]"
      for dtype in _DTYPES for style in ("neox", "gptj")),
    *(f"tests/test_embedding.py::test_vjp_matches_reference[cpu-(257, 130)-(64, 3)-{dtype}]"
      for dtype in _DTYPES),
    "tests/test_adamw.py::test_low_precision_parameters[cpu-bfloat16]",
    "tests/test_adamw.py::test_low_precision_parameters[cpu-float16]",
    "tests/test_adamw.py::test_implementations_agree_and_kernel_is_used",
    "tests/test_cpu_isa.py::test_cpu_isa_follows_the_variable",
    # The decode core's vector code: split keys, and an odd head dim in bf16.
    "tests/test_attention_decode.py::test_decode_against_reference[(1, 1, 1031, 4, 1, 128)-float32]",
    "tests/test_attention_decode.py::test_decode_against_reference[(3, 1, 97, 6, 2, 17)-bfloat16]",
    # The newer families, one case each through their vector code (bf16 where
    # the kernel has a bf16 path, float32 otherwise): the lower variants take
    # their scalar fallbacks.
    "tests/test_paged_attention.py::test_values_against_reference[cpu-(1, 5, 16, 2, 64, 16, 2)-bfloat16-None]",
    "tests/test_paged_attention.py::test_values_against_reference[cpu-(2, None, 8, 2, 7, 5, 4)-int8-bfloat16]",
    "tests/test_sampling.py::test_kernel_matches_reference_and_keeps_to_the_kept_set[cpu-(257, 97)-float32]",
    "tests/test_patch_embed.py::test_derivatives_match_reference[cpu-vjp-(2, 32, 16, 3, 16, 17)-bfloat16]",
    "tests/test_sparse.py::test_linear_matches_reference[cpu-(8, 4100)-5-float32]",
    # The AVX2 kernels of the sparse GEMVs (1 row: the permute GEMV; float16
    # rows on the rows-along-lanes GEMV) and of the decode core (head dim 24).
    "tests/test_sparse.py::test_gemv_blocks_chunks_and_any_metadata[1-float32]",
    "tests/test_sparse.py::test_gemv_blocks_chunks_and_any_metadata[8-float16]",
    "tests/test_paged_attention.py::test_values_against_reference[cpu-(2, 2, 8, 2, 24, 16, 3)-int8-float32]",
    "tests/test_sparse.py::test_derivatives_match_reference[cpu-vjp-(20, 64)-19-float32]",
    "tests/test_patch_embed.py::test_forward_matches_reference[cpu-(5, 28, 21, 2, 7, 32)-float32]",
]


def _env(isa):
  env = dict(os.environ)
  env[VARIABLE] = isa
  # The subset's run: one process, not a worker of this session's.
  env[parallel.WORKERS_VARIABLE] = "1"
  env.pop("PYTEST_XDIST_WORKER", None)
  return env


def _import_jaxops(isa):
  return subprocess.run([sys.executable, "-P", "-c", "import jaxops; print(jaxops.cpu_isa())"],
                        env=_env(isa), capture_output=True, text=True, timeout=300)


def test_cpu_isa_follows_the_variable():
  # Also run by the subprocesses below, with the variable set.
  assert jaxops.cpu_isa() == (os.environ.get(VARIABLE) or BEST)
  assert jaxops.cpu_isa() in ISAS


def _run_subset(isa) -> subprocess.CompletedProcess:
  """SUBSET's run with JAXOPS_CPU_ISA=isa: one mostly single-threaded pytest process."""
  command = [sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider", *SUBSET]
  return subprocess.run(command, cwd=REPO, env=_env(isa), capture_output=True, text=True,
                        timeout=900)


LOWER_VARIANT_RUNS = {isa: background.Job(_run_subset, isa) for isa in LOWER}


@pytest.mark.parametrize("isa", [pytest.param(isa, marks=prestart(LOWER_VARIANT_RUNS[isa]))
                                 for isa in LOWER])
def test_op_tests_pass_on_a_lower_variant(isa):
  result = LOWER_VARIANT_RUNS[isa].result()
  stdout, stderr = result.stdout, result.stderr
  assert result.returncode == 0, f"{VARIABLE}={isa}:\n{stdout[-6000:]}\n{stderr[-3000:]}"
  passed = re.search(r"(\d+) passed", stdout)
  assert passed and int(passed.group(1)) >= len(SUBSET), stdout[-3000:]
  assert "skipped" not in stdout and "deselected" not in stdout


def test_unknown_variant_is_a_clear_error():
  result = _import_jaxops("avx1024")
  assert result.returncode != 0
  assert (f"ValueError: {VARIABLE}='avx1024' is not a jaxops CPU kernel variant; "
          f"set it to one of {', '.join(ISAS)} or unset it (this CPU's best: {BEST})"
          ) in result.stderr


@pytest.mark.skipif(BEST == ISAS[0], reason="this CPU runs every variant")
def test_variant_above_the_cpu_is_a_clear_error():
  result = _import_jaxops(ISAS[0])
  assert result.returncode != 0
  assert (f"RuntimeError: {VARIABLE}={ISAS[0]} asks for CPU kernels this CPU cannot run; "
          f"its best is {BEST}") in result.stderr


# Instructions a variant's level does not have: for generic (x86-64-v2) any
# VEX/EVEX instruction (mnemonics v...) or AVX register and the scalar
# x86-64-v3 ones (BMI1/2, LZCNT, MOVBE; not TZCNT, which objdump also prints for
# the REP BSF that GCC emits at any level and older CPUs run as BSF); for avx2
# (x86-64-v3) any AVX-512 register (zmm, mask registers, xmm/ymm16-31).
_ABOVE_V2 = re.compile(r"\t(v[a-z0-9]+|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|"
                       r"sarx|shlx|shrx|lzcnt|movbe)\b|%[yz]mm")
_ABOVE_V3 = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")


@pytest.mark.skipif(ISAS != ("avx512", "avx2", "generic") or not shutil.which("objdump"),
                    reason="x86-64 variants, disassembled by binutils' objdump")
@pytest.mark.parametrize("library,forbidden", [
    ("libjaxops_cpu_generic.so", _ABOVE_V2),
    ("libjaxops_cpu_avx2.so", _ABOVE_V3),
    (pathlib.Path(_jaxops_cpu.__file__).name, _ABOVE_V2),
], ids=["generic", "avx2", "dispatcher"])
def test_variant_libraries_use_only_their_level(library, forbidden):
  path = pathlib.Path(_jaxops_cpu.__file__).parent / library
  listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)],
                           capture_output=True, text=True, check=True).stdout
  offending = [line for line in listing.splitlines() if forbidden.search(line)]
  assert listing.count("\n") > 1000
  assert not offending, f"{library}: {len(offending)} instructions above its level:\n" + "\n".join(
      offending[:20])
