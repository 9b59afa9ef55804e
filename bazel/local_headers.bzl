"""A repository over a header directory named by an environment variable.

new_local_repository needs its path written into WORKSPACE; this rule takes it
from `--repo_env=<path_env>=<dir>` instead (tools/bazel_local_repos.py writes
those flags), so the same WORKSPACE works for any venv or system layout.
"""

def _local_headers_repository_impl(ctx):
    path = ctx.os.environ.get(ctx.attr.path_env, "")
    if not path:
        fail(("{} is not set. Run `python tools/bazel_local_repos.py` with the " +
              "Python that has jaxlib and cmeel-eigen installed (it writes " +
              "local_repos.bazelrc), or pass --repo_env={}=<dir>.").format(
            ctx.attr.path_env,
            ctx.attr.path_env,
        ))
    if not ctx.path(path).exists:
        fail("{}={} does not exist".format(ctx.attr.path_env, path))
    ctx.symlink(path, "include")
    ctx.symlink(ctx.attr.build_file, "BUILD.bazel")
    ctx.file("WORKSPACE", 'workspace(name = "{}")\n'.format(ctx.name))

local_headers_repository = repository_rule(
    implementation = _local_headers_repository_impl,
    attrs = {
        "build_file": attr.label(mandatory = True, allow_single_file = True),
        "path_env": attr.string(mandatory = True),
    },
    # Re-run the rule when tools/bazel_local_repos.py names other directories.
    environ = ["JAXOPS_BAZEL_EIGEN_INCLUDE", "JAXOPS_BAZEL_XLA_FFI_INCLUDE"],
    local = True,
)
