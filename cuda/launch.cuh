// Kernel launch for the cuda/ kernels. It is the only place that uses the <<<>>>
// syntax, so that a host emulation of the kernels (compiled by a C++ compiler, not
// nvcc) can provide its own launch and compile the kernel files unchanged.
#pragma once

#include <cuda_runtime_api.h>

namespace jaxops::cuda {

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block,
                          cudaStream_t stream, Args... args) {
  kernel<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace jaxops::cuda
