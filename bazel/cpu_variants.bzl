"""One CPU kernel variant: kernels and handlers compiled for one instruction set.

The Bazel twin of cmake/cpu_isas.cmake (which says why each variant is a
self-contained shared library: the ODR trap). cpu_variant("avx2", [...])
defines
  cpu_kernels_avx2          the kernels (cpu/*.cc) with the variant's flags;
  libjaxops_cpu_avx2.so     kernels + handlers + the entry the dispatcher calls
                            (xla_ffi/cpu_dispatch/library_entry.cc), exporting
                            that entry only (library.map).
"""

# -fvisibility: every symbol of a variant stays inside its library, so that
# its copies of shared inline functions and templates are never resolved to
# another variant's.
_COPTS = ["-O3", "-std=c++17", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]

_MAP = "xla_ffi/cpu_dispatch/library.map"

def cpu_variant(isa, isa_copts, tags = []):
    native.cc_library(
        name = "cpu_kernels_" + isa,
        srcs = native.glob(["cpu/*.cc"]),
        hdrs = native.glob(["cpu/*.h"]),
        copts = _COPTS + ["-fno-math-errno"] + isa_copts,
        linkopts = ["-fopenmp"],
        deps = [
            ":params",
            "@eigen",
        ],
        tags = tags,
    )
    native.cc_binary(
        name = "libjaxops_cpu_{}.so".format(isa),
        srcs = native.glob(
            ["xla_ffi/*.cc", "xla_ffi/*.h"],
            exclude = ["xla_ffi/python_module.cc"],
        ) + [
            "xla_ffi/cpu_dispatch/library_abi.h",
            "xla_ffi/cpu_dispatch/library_entry.cc",
        ],
        copts = _COPTS + isa_copts,
        local_defines = ["JAXOPS_PLATFORM_CPU", 'JAXOPS_CPU_ISA_NAME=\\"{}\\"'.format(isa)],
        linkshared = True,
        linkopts = ["-fopenmp", "-Wl,--version-script=$(location {})".format(_MAP)],
        additional_linker_inputs = [_MAP],
        deps = [
            ":cpu_kernels_" + isa,
            ":params",
            "@xla_ffi//:ffi",
        ],
        tags = tags,
    )
