// Fast exponentials of the bandwidth-bound kernels, where the exact library
// functions would cost more instructions per element than the memory system
// leaves (docs/cuda.md, "Bandwidth-bound kernels").
#pragma once

namespace jaxops::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// 2^x by one MUFU.EX2 (ex2.approx.ftz: 2 ulp, results below 2^-126 flushed to
// 0; exp2f would add three instructions of subnormal handling to every
// element). The CPU harness computes exp2 exactly.
__device__ __forceinline__ float fast_exp2(float x) {
#ifndef JAXOPS_CUDA_HARNESS
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

}  // namespace jaxops::cuda
