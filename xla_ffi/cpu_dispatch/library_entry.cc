// The exported entry of a per-ISA CPU library: the table of the handlers that
// registered themselves in it (xla_ffi/registry.h). JAXOPS_CPU_ISA_NAME is set
// by the build to the variant's name; the dispatcher checks it against the file
// it loaded.
#include "xla_ffi/cpu_dispatch/library_abi.h"

#ifndef JAXOPS_CPU_ISA_NAME
#error "JAXOPS_CPU_ISA_NAME must name the variant this library is built as"
#endif

extern "C" __attribute__((visibility("default"))) const JaxopsCpuLibrary* jaxops_cpu_library_v1() {
  // Built on first call, after every registrar of the library has run (they
  // run when the library is loaded).
  static const JaxopsCpuLibrary library = {
      JAXOPS_CPU_ISA_NAME, jaxops::ffi_registry::targets().data(),
      jaxops::ffi_registry::targets().size()};
  return &library;
}
