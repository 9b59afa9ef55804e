// The nanobind module _jaxops_cpu: loads the CPU kernel variant the dispatcher
// chooses (dispatcher.h) and hands its handlers to Python. Compiled with the
// baseline flags, like the dispatcher, so that importing it runs on any CPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "xla_ffi/cpu_dispatch/dispatcher.h"
#include "xla_ffi/python_contract.h"

namespace nb = nanobind;
namespace dispatch = jaxops::cpu_dispatch;

namespace {

const dispatch::Kernels& loaded_kernels() {
  const dispatch::LoadResult result = dispatch::load_cpu_kernels();
  switch (result.status) {
    case dispatch::Status::kOk:
      return *result.kernels;
    case dispatch::Status::kUnknownIsa:
      throw nb::value_error(result.message.c_str());
    case dispatch::Status::kUnsupported:
      throw std::runtime_error(result.message);
    case dispatch::Status::kLoadFailed:
      break;
  }
  throw nb::import_error(result.message.c_str());
}

}  // namespace

NB_MODULE(_jaxops_cpu, m) {
  m.def(
      "registrations",
      []() {
        nb::dict out;
        for (const auto& target : loaded_kernels().targets) {
          out[target.name] = nb::capsule(target.handler);
        }
        return out;
      },
      "Map of custom-call target name -> PyCapsule of the XLA FFI handler, from the CPU "
      "kernel variant chosen on the first call (JAXOPS_CPU_ISA, else the CPU's best). "
      "ValueError for an unknown JAXOPS_CPU_ISA, RuntimeError for one this CPU cannot run.");
  m.def(
      "cpu_isa", []() { return loaded_kernels().isa; },
      "The CPU kernel variant in use: 'avx512', 'avx2' or 'generic'.");
  m.def("best_cpu_isa", &dispatch::best_isa,
        "The widest CPU kernel variant this CPU runs ('' if none).");
  m.def("cpu_isas", &dispatch::isas, "The CPU kernel variants of this platform, widest first.");
  jaxops::python_contract::define(m);
}
