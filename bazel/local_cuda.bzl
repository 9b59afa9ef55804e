"""@cuda: the CUDA toolkit installed on this machine, for BUILD's CUDA targets.

The toolkit's root (the directory holding bin/nvcc, include/, lib64/) comes from
`--repo_env=JAXOPS_BAZEL_CUDA_HOME=<dir>` (tools/bazel_local_repos.py writes it
when nvcc is on PATH). Only the CUDA targets fetch this repository.
"""

_BUILD = """
package(default_visibility = ["//visibility:public"])

# nvcc, as a wrapper around the toolkit's own (which finds its headers and
# libraries relative to itself, outside the sandbox's view of the inputs).
sh_binary(
    name = "nvcc",
    srcs = ["nvcc.sh"],
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

cc_library(
    name = "cudart_static",
    srcs = ["{libdir}/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)
"""

def _local_cuda_repository_impl(ctx):
    home = ctx.os.environ.get("JAXOPS_BAZEL_CUDA_HOME", "")
    if not home:
        fail("JAXOPS_BAZEL_CUDA_HOME is not set. Run `python tools/bazel_local_repos.py " +
             "--cuda <toolkit dir>` (the directory holding bin/nvcc), or pass " +
             "--repo_env=JAXOPS_BAZEL_CUDA_HOME=<dir>.")
    root = ctx.path(home)
    if not root.get_child("bin").get_child("nvcc").exists:
        fail("JAXOPS_BAZEL_CUDA_HOME={}: no bin/nvcc there".format(home))
    libdir = "lib64" if root.get_child("lib64").get_child("libcudart_static.a").exists else "lib"
    ctx.symlink(root.get_child("include"), "include")
    ctx.symlink(root.get_child(libdir), libdir)
    ctx.file("nvcc.sh", '#!/bin/sh\nexec "{}/bin/nvcc" "$@"\n'.format(home), executable = True)
    ctx.file("BUILD.bazel", _BUILD.format(libdir = libdir))
    ctx.file("WORKSPACE", 'workspace(name = "cuda")\n')

local_cuda_repository = repository_rule(
    implementation = _local_cuda_repository_impl,
    environ = ["JAXOPS_BAZEL_CUDA_HOME"],
    local = True,
)
