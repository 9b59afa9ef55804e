// Test-only: the handlers of the harness library, for Python (ctypes): the
// targets the unchanged CUDA handler files registered (xla_ffi/registry.h).
#include "xla_ffi/registry.h"

extern "C" {

int jaxops_harness_target_count() {
  return static_cast<int>(jaxops::ffi_registry::targets().size());
}

const char* jaxops_harness_target_name(int i) { return jaxops::ffi_registry::targets()[i].name; }

void* jaxops_harness_target_handler(int i) {
  return jaxops::ffi_registry::targets()[i].handler;
}

}  // extern "C"
