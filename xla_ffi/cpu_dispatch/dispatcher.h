// Run-time choice of the CPU kernels' instruction set (ISA).
//
// The CPU kernels and their FFI handlers are compiled once per ISA into
// self-contained shared libraries, libjaxops_cpu_<isa>.so (why not one library
// with per-ISA objects: CMakeLists.txt). The dispatcher is compiled for the
// baseline: it asks the CPU what it runs, reads JAXOPS_CPU_ISA, loads the
// chosen library with dlopen and returns its handler table. The Python module
// (python_module.cc) and C++ programs linking Bazel's //:cpu_ffi_handlers use
// it alike.
//
// Variants, widest first (x86-64; other architectures build "generic" only,
// with the compiler's default flags):
//   avx512   x86-64-v4 (AVX-512 F/BW/CD/DQ/VL); the bfloat16 attention forward
//            also checks for AVX512_BF16 at run time
//   avx2     x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE)
//   generic  x86-64-v2 (SSE4.2, POPCNT)
#pragma once

#include <string>
#include <vector>

#include "xla_ffi/registry.h"

namespace jaxops::cpu_dispatch {

// The environment variable that forces a variant.
inline constexpr char kIsaVariable[] = "JAXOPS_CPU_ISA";

// The variants of this platform, widest first.
const std::vector<std::string>& isas();

// The widest variant this CPU runs; "" if it runs none (an x86-64 CPU below
// x86-64-v2).
std::string best_isa();

struct Kernels {
  std::string isa;                             // the variant loaded
  std::vector<ffi_registry::Target> targets;   // its handlers
};

enum class Status {
  kOk,
  kUnknownIsa,   // JAXOPS_CPU_ISA is not a variant of this platform
  kUnsupported,  // the CPU cannot run the variant asked for, or any variant
  kLoadFailed,   // the library is missing or dlopen refused it
};

struct LoadResult {
  Status status;
  std::string message;      // why, when status != kOk
  const Kernels* kernels;   // when status == kOk; lives as long as the process
};

// Loads the variant JAXOPS_CPU_ISA names, or else the widest one this CPU runs
// among those present in `library_dir` (default_library_dir() when empty). The
// first successful call decides for the process: later calls return the same
// kernels whatever the variable says then, since JAX keeps the handlers it was
// given. Thread-safe; never aborts.
LoadResult load_cpu_kernels(const std::string& library_dir = "");

// The directory of the binary this dispatcher is linked into: the Python
// module's directory in a pip install. A Bazel program passes the directory of
// its //:cpu_kernels files instead (e.g. from its runfiles).
std::string default_library_dir();

}  // namespace jaxops::cpu_dispatch
