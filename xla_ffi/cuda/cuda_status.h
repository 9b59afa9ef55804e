// Turns the cudaError_t of a kernel launch into the ffi::Error a CUDA handler
// returns.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

namespace jaxops::ffi_cuda {

inline xla::ffi::Error launch_status(const std::string& op, cudaError_t status) {
  if (status == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(op + ": CUDA launch failed: " + cudaGetErrorName(status) +
                                   " (" + cudaGetErrorString(status) + ")");
}

}  // namespace jaxops::ffi_cuda
