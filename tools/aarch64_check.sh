#!/usr/bin/env bash
# The aarch64 check of the CPU kernels: installs Debian's aarch64 cross compiler
# and qemu's user-mode emulator (root and apt needed; skipped when both are on
# the PATH already), then runs only the C++ kernel tests' aarch64 builds
# (tests/test_cpp_kernels.py: tests/cpp/*_test.cc with their cpu/ kernels
# cross-compiled for armv8-a, the generic variant on NEON, and run under
# qemu-aarch64). CI runs the suite without these tools, which skips that
# build; this is the check to run after touching the generic path of cpu/.
# From a checkout with its venv:
#
#   tools/aarch64_check.sh [pytest args...]    e.g. -k kv_decode
#
# About 2.5 minutes on 2 shared cores with nothing cached (the builds, under
# $JAXOPS_CPP_TEST_CACHE), 1-1.5 minutes to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -q
  # The cross g++ brings the aarch64 libgomp (OpenMP) and a static glibc.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q g++-aarch64-linux-gnu qemu-user
fi

python=${PYTHON:-.venv/bin/python}
exec "$python" -P -m pytest tests/test_cpp_kernels.py -k aarch64 -p no:cacheprovider -rs "$@"
