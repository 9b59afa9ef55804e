// The nanobind module that hands this platform's FFI handlers and the targets'
// contract (xla_ffi/python_contract.h) to Python.
// Built once per platform with JAXOPS_MODULE_NAME set (_jaxops_cpu, _jaxops_cuda).
#include <nanobind/nanobind.h>

#include "xla_ffi/python_contract.h"
#include "xla_ffi/registry.h"

namespace nb = nanobind;

NB_MODULE(JAXOPS_MODULE_NAME, m) {
  m.def(
      "registrations",
      []() {
        nb::dict out;
        for (const auto& target : jaxops::ffi_registry::targets()) {
          out[target.name] = nb::capsule(target.handler);
        }
        return out;
      },
      "Map of custom-call target name -> PyCapsule of the XLA FFI handler.");
  jaxops::python_contract::define(m);
}
