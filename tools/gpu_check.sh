#!/usr/bin/env bash
# The whole GPU check of jaxops in one command, for a machine with an NVIDIA GPU
# that is lent for a few minutes and has no network (docs/cuda.md, "Running on a
# GPU"). From a checkout:
#
#   tools/gpu_check.sh [--quick] [--wheels DIR] [--out DIR] [--profile KERNELS]
#                      [--sanitize] [--budget SECONDS] [--limit-scale N] [--jobs N]
#                      [--arch SM] [--scratch DIR] [--python PYTHON] [--dry-run]
#
# Stages, each under its own time limit, all within --budget (default 470 s,
# 170 s with --quick) so that the whole run ends in under 8 (3) minutes on an
# H100/H200 machine with 16 cores (--limit-scale multiplies every stage's limit,
# for a machine with fewer cores):
#   env       GPU, driver, CUDA, Python and jax versions
#   build     jaxops for this GPU's architecture and the generic CPU variant only,
#             without build isolation or network, into a scratch prefix; the
#             wheels in --wheels (e.g. cmeel-eigen, which such machines lack) are
#             installed there first
#   tests     the GPU test selection with JAXOPS_TEST_GPU=1 on pytest-xdist
#             (--quick: tests/test_norms.py); each test under 120 s where
#             pytest-timeout is installed
#   bench     python -m jaxops.bench <family> --preset gpu for the GPU families,
#             with the device's copy bandwidth and bf16 matmul rate (--quick: norms)
#   profile   (--profile K1,K2 or --profile default) ncu, one launch of each named
#             kernel, through tools/gpu_smoke.py at sizes that fill the GPU
#   sanitize  (--sanitize) compute-sanitizer memcheck of every CUDA family at small
#             sizes, through tools/gpu_smoke.py
#   summary   one page: versions, stages, test counts and failures, the benchmark
#             table, the kernels' resources, the profiles
#
# Writes into --out (at most 8 files, what a lent machine sends back): summary.md,
# log.txt (every stage's output), tests.xml, bench.jsonl, bench.png, profiles.csv,
# sanitizer.txt. --dry-run prints each stage's command instead of running it.
set -uo pipefail

QUICK=0 DRY_RUN=0 SANITIZE=0 LIMIT_SCALE=1
WHEELS="" PROFILE="" ARCH="" JOBS="" BUDGET=""
OUT_DIR="gpu-check-results"
SCRATCH="${TMPDIR:-/tmp}/jaxops-gpu-check"
PYTHON="python3"
DEFAULT_PROFILE="attention_fwd_mma_kernel,attention_bwd_dkdv_mma_kernel,attention_decode_kernel,paged_attention_kernel,layer_norm_fwd_kernel,softmax_fwd_kernel,cross_entropy_kernel,adamw_kernel"

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --sanitize) SANITIZE=1 ;;
    --wheels) WHEELS="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    --profile) PROFILE="$2"; shift ;;
    --arch) ARCH="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --limit-scale) LIMIT_SCALE="$2"; shift ;;
    --scratch) SCRATCH="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.." || exit 2
CHECKOUT="$PWD"
[ "$PROFILE" = "default" ] && PROFILE="$DEFAULT_PROFILE"
[ -n "$BUDGET" ] || BUDGET=$([ "$QUICK" = 1 ] && echo 170 || echo 470)
[ -n "$JOBS" ] || JOBS=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
if [ -z "$ARCH" ]; then
  # compute_cap "9.0" -> CMake's "90"; the first GPU's, as jax uses device 0.
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  if [ -z "$ARCH" ]; then
    [ "$DRY_RUN" = 1 ] || { echo "gpu_check: no GPU found by nvidia-smi (give --arch to build anyway)" >&2; exit 2; }
    ARCH=90
  fi
fi

mkdir -p "$OUT_DIR" "$SCRATCH" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STAGES="$SCRATCH/stages.tsv"
LOG="$OUT_DIR/log.txt"
if [ "$DRY_RUN" = 0 ]; then
  : > "$STAGES"; : > "$LOG"
  rm -f "$OUT_DIR"/{summary.md,tests.xml,bench.jsonl,bench.png,profiles.csv,sanitizer.txt} "$SCRATCH"/ncu-*.csv
fi
SITE="$SCRATCH/site"          # carried wheels
PREFIX="$SCRATCH/jaxops"      # the jaxops build
export PYTHONPATH="$PREFIX:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
START=$SECONDS
SUMMARY_RESERVE=15  # seconds kept for the summary

progress() { printf '[gpu_check %3ds] %s\n' $((SECONDS - START)) "$*" | tee -a "$LOG"; }

# run_stage NAME LIMIT COMMAND...: runs COMMAND (a program, or one of the stage
# functions below) with its output in the log and on the console, under
# min(LIMIT, what the budget leaves); records the outcome for the summary.
run_stage() {
  local name=$1 limit=$(($2 * LIMIT_SCALE)); shift 2
  local left=$((BUDGET - SUMMARY_RESERVE - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    progress "$name: skipped, the budget of ${BUDGET}s is spent"
    printf '%s\tskipped (budget)\t0\t0\n' "$name" >> "$STAGES"
    return 1
  fi
  # timeout runs programs: a stage function runs in a bash that inherits it.
  declare -F "$1" >/dev/null && set -- bash -c "$1"
  progress "$name: started (limit ${limit}s)"
  local begin=$SECONDS status outcome=ok
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    outcome="timed out"
  elif [ "$status" != 0 ]; then
    outcome="failed (exit $status)"
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$outcome" $((SECONDS - begin)) "$limit" >> "$STAGES"
  progress "$name: $outcome after $((SECONDS - begin))s"
  [ "$status" = 0 ]
}

# -- env -----------------------------------------------------------------------------------
env_report() {
  echo "checkout: $CHECKOUT ($(git -C "$CHECKOUT" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata'))"
  echo "host: $(nproc) cores, $(uname -sr)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv 2>&1
  else
    echo "nvidia-smi: not found (no NVIDIA driver)"
  fi
  (command -v nvcc >/dev/null && nvcc --version | tail -2) || echo "nvcc: not found"
  "$PYTHON" - <<'EOF'
import platform
print(f"python {platform.python_version()}")
try:
  import jax, jaxlib
  print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, default backend "
        f"{jax.default_backend()}, devices {[d.device_kind for d in jax.devices()]}")
except Exception as e:  # the summary reports it; the build and tests will fail on it too
  print(f"jax: unusable ({type(e).__name__}: {e})")
EOF
  echo "build: sm_$ARCH, CPU variant generic, $JOBS jobs; budget ${BUDGET}s; mode $([ "$QUICK" = 1 ] && echo quick || echo full)"
}

# -- build ---------------------------------------------------------------------------------
build() {
  rm -rf "$PREFIX" && mkdir -p "$SITE" || return 1
  if [ -n "$WHEELS" ]; then
    compgen -G "$WHEELS/*.whl" >/dev/null || { echo "no wheels in $WHEELS"; return 1; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || return 1
  fi
  local prefix_path="$SITE/cmeel.prefix"
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PYTHON" -m pip install --no-deps --no-build-isolation \
    --no-index --no-compile --target "$PREFIX" "$CHECKOUT" -Cbuild-dir="$SCRATCH/build" \
    -Ccmake.define.JAXOPS_CUDA_ARCHITECTURES="$ARCH" -Ccmake.define.JAXOPS_CPU_ISAS=generic \
    -Ccmake.define.CMAKE_PREFIX_PATH="$prefix_path" || return 1
  # The build must be what the stages import (an editable install elsewhere
  # takes precedence over PYTHONPATH), and a build without nvcc would pass every
  # test on the references: insist on both.
  "$PYTHON" -P -c "
import pathlib, sys, jaxops
from jaxops._src import ffi_targets
if pathlib.Path('$PREFIX').resolve() not in pathlib.Path(jaxops.__file__).resolve().parents:
  sys.exit(f'{jaxops.__file__} is imported, not the build in $PREFIX: use a python without jaxops installed (--python)')
assert ffi_targets.available('cuda'), 'jaxops built without its CUDA kernels (nvcc not found?)'
print('jaxops', jaxops.__file__, 'with CUDA kernels')"
}

# -- tests ---------------------------------------------------------------------------------
# The op tests, the Flax and model tests and the lowering tests; not the CUDA
# harness (the CPU emulation the GPU replaces), the CPU builds' own checks, nor
# the suite's layout and benchmark-command checks. Within the files, the "cpu"
# backend's cases are the CPU CI's: -k deselects them here.
GPU_TEST_EXCLUDED="test_cuda_harness_ test_cpp_kernels test_cpu_isa test_cpu_sources test_stream_probe test_suite_layout test_source_checkout test_bench_ test_gpu_check test_demo"
gpu_test_files() {
  local file name skip
  for file in tests/test_*.py; do
    name=$(basename "$file" .py); skip=0
    for prefix in $GPU_TEST_EXCLUDED; do
      case "$name" in "$prefix"*) skip=1 ;; esac
    done
    [ "$skip" = 0 ] && echo "$file"
  done
}

# Sets TEST_COMMAND, the tests stage's command line.
set_test_command() {
  local files
  if [ "$QUICK" = 1 ]; then files=(tests/test_norms.py); else mapfile -t files < <(gpu_test_files); fi
  local parallel=(-n "$JOBS")
  "$PYTHON" -c "import xdist" 2>/dev/null || [ "$DRY_RUN" = 1 ] || parallel=()
  local per_test=()
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
  TEST_COMMAND=(env JAXOPS_TEST_GPU=1 "$PYTHON" -P -m pytest -q -rfE -p no:cacheprovider
                "${parallel[@]}" "${per_test[@]}" --junitxml="$OUT_DIR/tests.xml"
                -k "not cpu and not cuda_harness" "${files[@]}")
}

# -- bench ---------------------------------------------------------------------------------
GPU_BENCH_FAMILIES="roofline attention decode paged_attention norms softmax cross_entropy activations adamw"
bench() {
  local family families=$GPU_BENCH_FAMILIES extra=()
  [ "$QUICK" = 1 ] && families="roofline norms" && extra=(--quick)
  local failed=0
  for family in $families; do
    echo "== python -m jaxops.bench $family"
    if [ "$family" = roofline ]; then
      "$PYTHON" -P -m jaxops.bench roofline --json "$OUT_DIR/bench.jsonl" || failed=1
    else
      "$PYTHON" -P -m jaxops.bench "$family" --preset gpu "${extra[@]}" --json "$OUT_DIR/bench.jsonl" || failed=1
    fi
  done
  return $failed
}

# -- profile and sanitize ------------------------------------------------------------------
profile() {
  local kernel family failed=0
  for kernel in ${PROFILE//,/ }; do
    family=$("$PYTHON" -P tools/gpu_smoke.py --family-of-kernel "$kernel") || { echo "$family"; failed=1; continue; }
    echo "== ncu: $kernel (cuda/$family.cu)"
    ncu --clock-control none --kernel-name "regex:$kernel" --launch-count 1 --csv --page details \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      --log-file "$SCRATCH/ncu-$kernel.csv" \
      "$PYTHON" -P tools/gpu_smoke.py --family "$family" --size large || failed=1
    cat "$SCRATCH/ncu-$kernel.csv" >> "$OUT_DIR/profiles.csv" 2>/dev/null
  done
  return $failed
}

sanitize() {
  # One cudaMalloc per buffer (not XLA's pooled allocator), so that memcheck sees
  # each buffer's bounds; only jaxops' kernels are instrumented.
  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
    --kernel-regex kns=jaxops --error-exitcode 3 --log-file "$OUT_DIR/sanitizer.txt" \
    "$PYTHON" -P tools/gpu_smoke.py --family all --size small
}

# -- the run -------------------------------------------------------------------------------
export PYTHON PREFIX SITE SCRATCH CHECKOUT ARCH JOBS WHEELS OUT_DIR QUICK PROFILE GPU_BENCH_FAMILIES
export -f build bench profile sanitize
set_test_command
# The bench's gpu presets take about 3-4.5 minutes on an H100 (attention's XLA
# and cuDNN peers compiling most of it): what the tests leave of the budget.
TESTS_LIMIT=$([ "$QUICK" = 1 ] && echo 90 || echo 180)
BENCH_LIMIT=$([ "$QUICK" = 1 ] && echo 60 || echo 270)

if [ "$DRY_RUN" = 1 ]; then
  echo "build (limit 150s): pip install --no-deps --no-build-isolation --no-index --target $PREFIX $CHECKOUT -Cbuild-dir=$SCRATCH/build -Ccmake.define.JAXOPS_CUDA_ARCHITECTURES=$ARCH -Ccmake.define.JAXOPS_CPU_ISAS=generic -Ccmake.define.CMAKE_PREFIX_PATH=$SITE/cmeel.prefix${WHEELS:+ (after the wheels of $WHEELS into $SITE)}"
  printf 'tests (limit %ss):' "$TESTS_LIMIT"; printf ' %q' "${TEST_COMMAND[@]}"; printf '\n'
  echo "bench (limit ${BENCH_LIMIT}s): $( [ "$QUICK" = 1 ] && echo "roofline, norms --quick" || echo "$GPU_BENCH_FAMILIES") (--preset gpu --json $OUT_DIR/bench.jsonl)"
  [ -n "$PROFILE" ] && echo "profile (limit 120s): ncu, one launch of each of ${PROFILE//,/ }"
  [ "$SANITIZE" = 1 ] && echo "sanitize (limit 120s): compute-sanitizer --tool memcheck tools/gpu_smoke.py --family all --size small"
  exit 0
fi

progress "jaxops GPU check, $([ "$QUICK" = 1 ] && echo quick || echo full) mode, budget ${BUDGET}s, output in $OUT_DIR"
env_report 2>&1 | tee "$SCRATCH/env.txt" | tee -a "$LOG"
if run_stage build 150 build; then
  run_stage tests "$TESTS_LIMIT" "${TEST_COMMAND[@]}"
  run_stage bench "$BENCH_LIMIT" bench
  [ -n "$PROFILE" ] && run_stage profile 120 profile
  [ "$SANITIZE" = 1 ] && run_stage sanitize 120 sanitize
fi
"$PYTHON" -P tools/gpu_check_summary.py --out "$OUT_DIR" --scratch "$SCRATCH" \
  --prefix "$PREFIX" 2>&1 | tee -a "$LOG"
progress "done in $((SECONDS - START))s: $OUT_DIR/summary.md"
