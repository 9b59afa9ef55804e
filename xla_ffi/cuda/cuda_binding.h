// The binding prefix of every CUDA handler: the stream XLA launches on, before
// the buffers. The CPU harness of the tests (tests/cuda_harness) compiles the
// CUDA handlers unchanged as CPU handlers, with a context of its own that
// provides the stream (it defines JAXOPS_CUDA_STREAM_CONTEXT first).
#pragma once

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

#ifndef JAXOPS_CUDA_STREAM_CONTEXT
#define JAXOPS_CUDA_STREAM_CONTEXT ::xla::ffi::PlatformStream<cudaStream_t>
#endif

namespace jaxops::ffi_cuda {

inline auto cuda_binding() {
  return ::xla::ffi::Ffi::Bind().Ctx<JAXOPS_CUDA_STREAM_CONTEXT>();
}

}  // namespace jaxops::ffi_cuda
