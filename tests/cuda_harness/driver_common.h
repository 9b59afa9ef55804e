// Test-only helpers shared by the sanitizer drivers (norms_driver.cc,
// softmax_cross_entropy_driver.cc, attention_driver.cc, catalogue_driver.cc):
// the failure count, launch-status checks, dtype names and exact-size buffers.
// Each driver includes this once, into its own translation unit.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace {

int g_failures = 0;

void check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "FAIL %s: %s: %s\n", what.c_str(), cudaGetErrorName(status),
                 cudaGetErrorString(status));
    ++g_failures;
  }
}

template <typename T>
const char* type_name() {
  if (std::is_same<T, float>::value) return "float32";
  if (std::is_same<T, __half>::value) return "float16";
  return "bfloat16";
}

// One buffer per allocation, exactly sized (AddressSanitizer redzones around it).
template <typename T>
struct Buffer {
  explicit Buffer(size_t n) : data(new T[n == 0 ? 1 : n]), size(n) {}
  ~Buffer() { delete[] data; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data;
  size_t size;
};

}  // namespace
