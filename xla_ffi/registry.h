// Static registration of XLA FFI handlers.
//
// Each handler file registers its handlers at load time with
// JAXOPS_REGISTER_FFI_TARGET; the module's `registrations()` hands them all to
// Python, which calls jax.ffi.register_ffi_target for each. Adding an op family
// therefore touches no shared list. One module is built per platform (CPU, CUDA),
// each from its own handler files, so one registry serves both.
#pragma once

#include <vector>

namespace jaxops::ffi_registry {

struct Target {
  const char* name;  // the custom-call target name the Python side lowers to
  void* handler;     // an XLA_FFI_Handler*, as jax.ffi.pycapsule expects
};

inline std::vector<Target>& targets() {
  static std::vector<Target> all;
  return all;
}

struct Registrar {
  Registrar(const char* name, void* handler) { targets().push_back({name, handler}); }
};

}  // namespace jaxops::ffi_registry

#define JAXOPS_FFI_CONCAT_INNER(a, b) a##b
#define JAXOPS_FFI_CONCAT(a, b) JAXOPS_FFI_CONCAT_INNER(a, b)
#define JAXOPS_REGISTER_FFI_TARGET(name, handler)                                  \
  static ::jaxops::ffi_registry::Registrar JAXOPS_FFI_CONCAT(jaxops_registrar_,    \
                                                             __COUNTER__)(         \
      name, reinterpret_cast<void*>(handler))
