// Kernel launch for the cuda/ kernels. It is the only place that uses the <<<>>>
// syntax and dynamic shared memory's `extern __shared__`, so that the CPU
// harness of the tests (tests/cuda_harness), which compiles the kernel files
// unchanged with a C++ compiler, can provide the same three functions (it
// defines JAXOPS_CUDA_HARNESS and they are then skipped here).
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#ifndef JAXOPS_CUDA_HARNESS
namespace jaxops::cuda {

// Launches with `shared_bytes` of dynamic shared memory (raising the kernel's
// limit when it is above the default 48 KiB).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_dynamic_shared(void (*kernel)(Params...), dim3 grid, dim3 block,
                                         size_t shared_bytes, cudaStream_t stream,
                                         Args... args) {
  if (shared_bytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (status != cudaSuccess) return status;
  }
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
  return cudaGetLastError();
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                          Args... args) {
  return launch_kernel_dynamic_shared(kernel, grid, block, 0, stream, args...);
}

// The block's dynamic shared memory (the launch's shared_bytes), 16-byte aligned.
template <typename T>
__device__ __forceinline__ T* dynamic_shared_memory() {
  extern __shared__ __align__(16) unsigned char jaxops_dynamic_shared[];
  return reinterpret_cast<T*>(jaxops_dynamic_shared);
}

}  // namespace jaxops::cuda
#endif  // JAXOPS_CUDA_HARNESS
