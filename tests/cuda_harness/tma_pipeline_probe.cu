// Test-only: tma_pipeline.cuh's kernel for nvcc (-arch=sm_90a -cubin), so that
// tests/test_cuda_harness_tma.py can check its SASS: TMA loads (UTMALDG),
// mbarrier synchronisation (SYNCS), register reallocation, no local memory.
#include "tests/cuda_harness/tma_pipeline.cuh"
