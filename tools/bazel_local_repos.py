"""Name the directories of Bazel's @eigen, @xla_ffi and @cuda (see WORKSPACE).

Run it with the Python whose site-packages hold jaxlib and cmeel-eigen:

    .venv/bin/python tools/bazel_local_repos.py [--eigen DIR] [--xla-ffi DIR] [--cuda DIR]

It writes local_repos.bazelrc next to WORKSPACE (imported by .bazelrc) with one
`--repo_env` per repository. The options override what it finds, e.g.
--eigen /usr/include/eigen3 for Debian's libeigen3-dev. The CUDA toolkit is
needed only by BUILD's CUDA targets; it is looked for in $CUDA_HOME, $CUDA_PATH,
beside the nvcc on PATH and in /usr/local/cuda.
"""

import argparse
import os
import pathlib
import shutil
import sys

WORKSPACE_DIR = pathlib.Path(__file__).resolve().parent.parent
OUTPUT = WORKSPACE_DIR / "local_repos.bazelrc"


def installed_eigen_include():
  try:
    import cmeel
  except ImportError:
    return None
  # cmeel wheels install under <site-packages>/cmeel.prefix.
  prefix = pathlib.Path(cmeel.__file__).resolve().parent.parent / "cmeel.prefix"
  include = prefix / "include" / "eigen3"
  return include if (include / "Eigen" / "Core").is_file() else None


def installed_xla_ffi_include():
  try:
    import jax.ffi
  except ImportError:
    return None
  return pathlib.Path(jax.ffi.include_dir())


def is_cuda_toolkit(root):
  return (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime_api.h").is_file()


def installed_cuda_home():
  candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
  nvcc = shutil.which("nvcc")
  if nvcc:
    candidates.append(pathlib.Path(nvcc).resolve().parent.parent)
  candidates.append("/usr/local/cuda")
  for candidate in candidates:
    if candidate and is_cuda_toolkit(pathlib.Path(candidate)):
      return pathlib.Path(candidate)
  return None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--eigen", type=pathlib.Path,
                      help="directory holding Eigen/Core (default: the cmeel-eigen wheel's)")
  parser.add_argument("--xla-ffi", type=pathlib.Path,
                      help="directory holding xla/ffi/api/ffi.h (default: jax.ffi.include_dir())")
  parser.add_argument("--cuda", type=pathlib.Path,
                      help="CUDA toolkit root, holding bin/nvcc and include/ (default: found)")
  args = parser.parse_args()

  eigen = args.eigen or installed_eigen_include()
  xla_ffi = args.xla_ffi or installed_xla_ffi_include()
  cuda = args.cuda or installed_cuda_home()
  problems = []
  if eigen is None or not (eigen / "Eigen" / "Core").is_file():
    problems.append(f"no Eigen/Core under {eigen}: pip install cmeel-eigen, or pass --eigen DIR")
  if xla_ffi is None or not (xla_ffi / "xla" / "ffi" / "api" / "ffi.h").is_file():
    problems.append(f"no xla/ffi/api/ffi.h under {xla_ffi}: pip install jaxlib, or pass --xla-ffi DIR")
  if args.cuda and not is_cuda_toolkit(args.cuda):
    problems.append(f"no bin/nvcc and include/cuda_runtime_api.h under {args.cuda}")
  if problems:
    sys.exit("tools/bazel_local_repos.py: " + "; ".join(problems))

  lines = [
      "# Written by tools/bazel_local_repos.py; imported by .bazelrc.",
      f"build --repo_env=JAXOPS_BAZEL_EIGEN_INCLUDE={os.path.abspath(eigen)}",
      f"build --repo_env=JAXOPS_BAZEL_XLA_FFI_INCLUDE={os.path.abspath(xla_ffi)}",
  ]
  if cuda:
    lines.append(f"build --repo_env=JAXOPS_BAZEL_CUDA_HOME={os.path.abspath(cuda)}")
  OUTPUT.write_text("\n".join(lines) + "\n")
  print(f"wrote {OUTPUT}: @eigen -> {eigen}, @xla_ffi -> {xla_ffi}, "
        f"@cuda -> {cuda or 'none found (only the CUDA targets need it)'}")


if __name__ == "__main__":
  main()
