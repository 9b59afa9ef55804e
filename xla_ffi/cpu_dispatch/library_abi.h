// The interface between the CPU dispatcher (dispatcher.cc) and the per-ISA CPU
// libraries (libjaxops_cpu_<isa>.so, each built from library_entry.cc, the
// handlers in xla_ffi/*.cc and the kernels in cpu/ with that ISA's flags).
//
// A library exports exactly one symbol, kLibraryEntryName: a C function
// returning its table. Everything else in it is local (hidden visibility and a
// version script), so that the inline functions and templates it shares with
// the other variants can never be resolved to another variant's copy.
#pragma once

#include <cstddef>

#include "xla_ffi/registry.h"

extern "C" {

struct JaxopsCpuLibrary {
  const char* isa;                                 // the variant it was built as: "avx512", ...
  const jaxops::ffi_registry::Target* targets;     // target name -> XLA_FFI_Handler*
  size_t num_targets;
};

// The version in the name changes with the struct, so that a dispatcher never
// reads a table laid out differently from what it expects.
typedef const JaxopsCpuLibrary* (*JaxopsCpuLibraryEntry)();

}  // extern "C"

namespace jaxops::cpu_dispatch {
inline constexpr char kLibraryEntryName[] = "jaxops_cpu_library_v1";
}  // namespace jaxops::cpu_dispatch
