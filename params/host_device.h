// JAXOPS_HOST_DEVICE marks the few small inline helpers of the parameter
// structs that both the CPU kernels and CUDA device code call. nvcc needs the
// qualifiers to compile them for the device (and is told to inline them, as
// the kernels' own per-row helpers are); every other compiler (g++ for cpu/ and
// the handlers, and the CUDA test harness, which defines __device__ away) sees
// plain inline functions.
#pragma once

#if defined(__CUDACC__)
#define JAXOPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAXOPS_HOST_DEVICE inline
#endif
