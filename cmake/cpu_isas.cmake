# The CPU kernels, once per instruction set (ISA), and the module that picks one
# at run time (xla_ffi/cpu_dispatch/dispatcher.h).
#
# Why one self-contained shared library per ISA, not per-ISA objects in one
# library: the kernels share inline functions and templates (cpu/*.h, Eigen, the
# standard library), and every object compiled with -march=x86-64-v4 carries
# its own AVX-512 copy of each. Linked together with the generic objects, these
# are the same weak symbols, of which the linker keeps one: the generic kernels
# would then call AVX-512 code and die with SIGILL on an older CPU (the ODR
# trap). So each variant is its own library, libjaxops_cpu_<isa>.so: the kernels
# compiled with that ISA's flags and the FFI handlers, hidden visibility, and a
# version script that exports one entry function (xla_ffi/cpu_dispatch/library_abi.h).
# The nanobind module _jaxops_cpu, compiled with the baseline flags, detects the
# CPU and dlopen()s exactly one of them (RTLD_LOCAL).
#
# Variants, widest first, and their flags. x86-64 builds three; elsewhere one,
# with the compiler's default flags. -mtune=znver3 for avx512: with GCC's
# generic tuning the norms' forward+backward ran 13-55% slower (minima of 4
# alternating rounds, Zen 4, docs/benchmarks-log.md) than the same source built with
# -march=native; tuning alone recovers it (0.90-1.01x). Tuning selects and
# schedules instructions, it never adds any, so the variant still runs on every
# x86-64-v4 CPU; Intel AVX-512 CPUs have not been measured.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(JAXOPS_CPU_ALL_ISAS avx512 avx2 generic)
  set(JAXOPS_CPU_ISA_FLAGS_avx512 -march=x86-64-v4 -mtune=znver3)
  set(JAXOPS_CPU_ISA_FLAGS_avx2 -march=x86-64-v3)
  set(JAXOPS_CPU_ISA_FLAGS_generic -march=x86-64-v2)
  set(JAXOPS_CPU_BASELINE_FLAGS -march=x86-64-v2)
else()
  set(JAXOPS_CPU_ALL_ISAS generic)
  set(JAXOPS_CPU_ISA_FLAGS_generic "")
  set(JAXOPS_CPU_BASELINE_FLAGS "")
endif()
# A development build may build fewer variants (e.g. -DJAXOPS_CPU_ISAS=avx512);
# the dispatcher then picks the best of those present that the CPU runs.
set(JAXOPS_CPU_ISAS "${JAXOPS_CPU_ALL_ISAS}" CACHE STRING
    "CPU kernel variants to build, from: ${JAXOPS_CPU_ALL_ISAS}")
foreach(isa ${JAXOPS_CPU_ISAS})
  if(NOT isa IN_LIST JAXOPS_CPU_ALL_ISAS)
    message(FATAL_ERROR "JAXOPS_CPU_ISAS: '${isa}' is not one of ${JAXOPS_CPU_ALL_ISAS}")
  endif()
endforeach()
message(STATUS "jaxops: CPU kernel variants ${JAXOPS_CPU_ISAS}")

file(GLOB JAXOPS_CPU_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/cpu/*.cc")
# Handlers register themselves (xla_ffi/registry.h), so adding an op family is
# adding its files: nothing here lists them.
file(GLOB JAXOPS_CPU_HANDLERS CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/*.cc")
list(REMOVE_ITEM JAXOPS_CPU_HANDLERS "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/python_module.cc")

# The FFI handlers decode, validate and call a kernel: nothing in them gains
# from a wider ISA, so they are compiled once, for the baseline, and linked into
# every variant. Sharing a variant library with its kernels is safe either way
# the linker resolves their common inline functions (a variant only runs on
# CPUs of its level, and baseline code runs everywhere); the kernels' objects
# come first on the link line, so that it keeps the kernels' own, wider copies.
add_library(jaxops_cpu_handlers OBJECT ${JAXOPS_CPU_HANDLERS})
target_include_directories(jaxops_cpu_handlers SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
target_include_directories(jaxops_cpu_handlers PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
target_compile_definitions(jaxops_cpu_handlers PRIVATE JAXOPS_PLATFORM_CPU)
target_compile_options(jaxops_cpu_handlers PRIVATE -O2 ${JAXOPS_CPU_BASELINE_FLAGS})
target_link_libraries(jaxops_cpu_handlers PRIVATE Eigen3::Eigen OpenMP::OpenMP_CXX)
set_target_properties(jaxops_cpu_handlers PROPERTIES
  CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)

foreach(isa ${JAXOPS_CPU_ISAS})
  # CPU kernels: no XLA, no Python. A target of its own so that the C++ tests
  # (tests/cpp) can link one variant.
  add_library(jaxops_cpu_kernels_${isa} OBJECT ${JAXOPS_CPU_SOURCES})
  target_include_directories(jaxops_cpu_kernels_${isa} PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}")
  target_link_libraries(jaxops_cpu_kernels_${isa} PUBLIC Eigen3::Eigen OpenMP::OpenMP_CXX)
  # -fno-math-errno: the kernels never read errno, and without it GCC guards each
  # std::sqrt with a branch (to set errno on negative input) that stops the loop
  # from vectorising.
  target_compile_options(jaxops_cpu_kernels_${isa} PRIVATE
    -O3 -Wall -Wextra -fno-math-errno ${JAXOPS_CPU_ISA_FLAGS_${isa}})

  # The variant's library: its kernels, the handlers and the entry the
  # dispatcher calls.
  add_library(jaxops_cpu_${isa} SHARED
    $<TARGET_OBJECTS:jaxops_cpu_kernels_${isa}> $<TARGET_OBJECTS:jaxops_cpu_handlers>
    "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cpu_dispatch/library_entry.cc")
  target_include_directories(jaxops_cpu_${isa} PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  target_compile_definitions(jaxops_cpu_${isa} PRIVATE JAXOPS_CPU_ISA_NAME="${isa}")
  target_compile_options(jaxops_cpu_${isa} PRIVATE ${JAXOPS_CPU_BASELINE_FLAGS})
  target_link_libraries(jaxops_cpu_${isa} PRIVATE OpenMP::OpenMP_CXX)
  set_target_properties(jaxops_cpu_kernels_${isa} jaxops_cpu_${isa} PROPERTIES
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    set(map "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cpu_dispatch/library.map")
    target_link_options(jaxops_cpu_${isa} PRIVATE "-Wl,--version-script=${map}" -Wl,--no-undefined)
    set_target_properties(jaxops_cpu_${isa} PROPERTIES LINK_DEPENDS "${map}")
  endif()
endforeach()

# The module Python imports: the dispatcher, baseline flags, no kernels.
nanobind_add_module(_jaxops_cpu NB_STATIC
  "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cpu_dispatch/python_module.cc"
  "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cpu_dispatch/dispatcher.cc")
target_include_directories(_jaxops_cpu PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
# The contract it exports (xla_ffi/python_contract.h) is declared next to the
# handlers' bindings, which name XLA FFI types.
target_include_directories(_jaxops_cpu SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
target_compile_options(_jaxops_cpu PRIVATE ${JAXOPS_CPU_BASELINE_FLAGS})
target_link_libraries(_jaxops_cpu PRIVATE ${CMAKE_DL_LIBS})
foreach(isa ${JAXOPS_CPU_ISAS})
  add_dependencies(_jaxops_cpu jaxops_cpu_${isa})
endforeach()

# The variants sit next to the module, where the dispatcher looks for them.
list(TRANSFORM JAXOPS_CPU_ISAS PREPEND jaxops_cpu_ OUTPUT_VARIABLE JAXOPS_CPU_LIBRARIES)
if(SKBUILD)
  install(TARGETS _jaxops_cpu ${JAXOPS_CPU_LIBRARIES} LIBRARY DESTINATION jaxops)
else()
  # A plain CMake build (development) puts them next to the Python sources, so
  # `PYTHONPATH=<checkout>` imports them without installing.
  set_target_properties(_jaxops_cpu ${JAXOPS_CPU_LIBRARIES} PROPERTIES
    LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/jaxops")
endif()
