// Test-only: compiles the CUDA FFI handlers (xla_ffi/cuda/*.cc) unchanged as CPU
// handlers. Their binding takes the stream from JAXOPS_CUDA_STREAM_CONTEXT; here
// that context decodes to a null cudaStream_t (the harness runs a launch before
// returning), where XLA's CPU runtime has no platform stream to give.
#pragma once

#include <optional>

#include "cuda_on_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jaxops_harness {
struct HostStream {};
}  // namespace jaxops_harness

namespace xla::ffi {
template <>
struct CtxDecoding<jaxops_harness::HostStream> {
  using Type = cudaStream_t;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return cudaStream_t{nullptr};
  }
};
}  // namespace xla::ffi

#define JAXOPS_CUDA_STREAM_CONTEXT ::jaxops_harness::HostStream
