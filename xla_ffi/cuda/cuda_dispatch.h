// Dispatch from a buffer's dtype to the CUDA element type a kernel is
// instantiated for, shared by the CUDA handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <utility>

#include "xla_ffi/ffi_common.h"

namespace jaxops::ffi_cuda {

// Calls fn(T{}) with T float, __nv_bfloat16 or __half for F32, BF16 or F16;
// any other dtype is an error.
template <typename Fn>
xla::ffi::Error dispatch(const std::string& op, xla::ffi::DataType dtype, Fn&& fn) {
  return ffi_common::dispatch_float<float, __nv_bfloat16, __half>(op, dtype,
                                                                  std::forward<Fn>(fn));
}

// `dispatch` as a function object, for helpers that take the platform's.
struct Dispatch {
  template <typename Fn>
  xla::ffi::Error operator()(const std::string& op, xla::ffi::DataType dtype, Fn&& fn) const {
    return dispatch(op, dtype, std::forward<Fn>(fn));
  }
};

}  // namespace jaxops::ffi_cuda
