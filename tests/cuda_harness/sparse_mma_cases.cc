// Test-only: the harness's emulation of the sparse tensor-core instruction
// (include/sparse_mma_emulation.h) at the level of one tile, and the metadata
// conversion of cuda/sparse_mma.cuh.
//
// A one-warp kernel fills its registers from a 2:4-sparse A (16 x 32, kept as
// 16 x 16 values and a nibble per chunk), a dense B (32 x 8) and C (16 x 8)
// following the PTX ISA's per-lane formulas for mma.sp m16n8k32 .f16/.bf16,
// runs the instruction and stores D; the host checks D against the dense
// product A B + C in double. The lanes that the sparsity selector leaves out
// pass invalid metadata, so reading the wrong lanes fails the launch.
//
// usage: sparse_mma_cases CASE   CASE: f16, bf16 (through the kernels' device
//        function, selector 0), selector1 (the emulation with selector 1),
//        descending_metadata (must fail the launch), canonical (every nibble's
//        conversion keeps the decompressed chunk)
//        exit 0: right result; 3: wrong result; 4: the launch failed (report on stderr)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "cuda/sparse_mma.cuh"

namespace {

using jaxops::cuda::launch_kernel;
namespace sparse_mma = jaxops::cuda::sparse_mma;

constexpr int kM = 16, kN = 8, kK = 32, kKept = kK / 2;

int wrong(const std::string& what) {
  std::fprintf(stderr, "wrong result: %s\n", what.c_str());
  return 3;
}

// values [16][16] (row-major), nibbles [16][8], b [32][8], c and d [16][8].
template <typename T, int kSelector, bool kThroughKernelFunction>
__global__ void sparse_mma_tile(const T* values, const uint8_t* nibbles, const T* b_matrix,
                                const float* c_matrix, float* d_matrix) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  uint32_t a[4], b[4];
  float acc[4];
  for (int r = 0; r < 4; ++r) {  // elements 2r and 2r + 1 of each operand
    const int a_row = g + 8 * (r & 1), a_col = 2 * t + 8 * (r >> 1);
    a[r] = sparse_mma::pack(values[a_row * kKept + a_col], values[a_row * kKept + a_col + 1]);
    const int b_row = 2 * t + 8 * r;
    b[r] = sparse_mma::pack(b_matrix[b_row * kN + g], b_matrix[(b_row + 1) * kN + g]);
  }
  for (int i = 0; i < 4; ++i) acc[i] = c_matrix[(g + 8 * (i >> 1)) * kN + 2 * t + (i & 1)];
  uint32_t e = 0;  // all-invalid metadata on the lanes the selector leaves out
  if ((t >> 1) == kSelector) {
    for (int half = 0; half < 2; ++half) {
      for (int c = 0; c < 4; ++c) {
        e |= static_cast<uint32_t>(nibbles[(g + 8 * half) * 8 + 4 * (t & 1) + c])
             << (16 * half + 4 * c);
      }
    }
  }
  if (kThroughKernelFunction) {
    sparse_mma::mma_sp_m16n8k32<T>(acc, a, b, e);
  } else {
    jaxops_harness::sparse_mma_m16n8k32<T, kSelector>(acc, a, b, acc, e);
  }
  for (int i = 0; i < 4; ++i) d_matrix[(g + 8 * (i >> 1)) * kN + 2 * t + (i & 1)] = acc[i];
}

template <typename T, int kSelector, bool kThroughKernelFunction>
int run_tile(bool descending) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int pairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
  std::vector<T> values(kM * kKept), b(kK * kN);
  std::vector<uint8_t> nibbles(kM * 8);
  std::vector<float> c(kM * kN), d(kM * kN);
  std::vector<double> dense(kM * kK, 0.0);
  for (int row = 0; row < kM; ++row) {
    for (int chunk = 0; chunk < 8; ++chunk) {
      const int* pair = pairs[rng() % 6];
      nibbles[row * 8 + chunk] = static_cast<uint8_t>(pair[0] | pair[1] << 2);
      for (int slot = 0; slot < 2; ++slot) {
        T& v = values[row * kKept + 2 * chunk + slot];
        v = T(normal(rng));
        dense[row * kK + 4 * chunk + pair[slot]] = static_cast<float>(v);
      }
    }
  }
  if (descending) nibbles[5 * 8 + 6] = 0b0001;  // indices 1 then 0
  for (auto& v : b) v = T(normal(rng));
  for (auto& v : c) v = normal(rng);
  const cudaError_t status = launch_kernel(sparse_mma_tile<T, kSelector, kThroughKernelFunction>,
                                           dim3(1), dim3(32), nullptr, values.data(),
                                           nibbles.data(), b.data(), c.data(), d.data());
  if (status != cudaSuccess) {
    std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(status));
    return 4;
  }
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      double sum = c[i * kN + j], scale = std::fabs(sum);
      for (int k = 0; k < kK; ++k) {
        const double term = dense[i * kK + k] * static_cast<float>(b[k * kN + j]);
        sum += term;
        scale += std::fabs(term);
      }
      if (!(std::fabs(d[i * kN + j] - sum) <= 1e-5 * (1.0 + scale))) {
        return wrong("D[" + std::to_string(i) + "][" + std::to_string(j) + "] = " +
                     std::to_string(d[i * kN + j]) + ", expected " + std::to_string(sum));
      }
    }
  }
  return 0;
}

// Every jaxops nibble (any order, equal positions) with two values: the
// canonical nibble is one the hardware takes, and the chunk it decompresses to
// is the scatter-add of the original (the equal pair's sum rounded to T once).
template <typename T>
int run_canonical() {
  const T first_value = T(1.5f), second_value = T(-0.3125f);
  for (uint32_t nibble = 0; nibble < 16; ++nibble) {
    const uint32_t canonical = sparse_mma::canonical_nibble(nibble);
    const uint32_t lo = canonical & 3u, hi = canonical >> 2;
    if (canonical > 15 || lo >= hi) return wrong("nibble " + std::to_string(nibble) + " -> invalid");
    // Nibbles 0 and 1 valid already, 3 the zero of padding (canonically 0b0100).
    if (sparse_mma::canonical_nibbles(nibble << 8 | 0xe4u) != (0x4000u | canonical << 8 | 0xe4u)) {
      return wrong("canonical_nibbles of nibble " + std::to_string(nibble));
    }
    const uint32_t reg = sparse_mma::canonical_values(nibble, first_value, second_value);
    float got[4] = {}, expected[4] = {};
    got[lo] += static_cast<float>(T::from_bits(static_cast<unsigned short>(reg & 0xffffu)));
    got[hi] += static_cast<float>(T::from_bits(static_cast<unsigned short>(reg >> 16)));
    const uint32_t p0 = nibble & 3u, p1 = nibble >> 2;
    if (p0 == p1) {
      expected[p0] = static_cast<float>(T(float(first_value) + float(second_value)));
    } else {
      expected[p0] = float(first_value);
      expected[p1] = float(second_value);
    }
    if (std::memcmp(got, expected, sizeof got) != 0) {
      return wrong("values of nibble " + std::to_string(nibble));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string name = argv[1];
  if (name == "f16") return run_tile<__half, 0, true>(false);
  if (name == "bf16") return run_tile<__nv_bfloat16, 0, true>(false);
  if (name == "selector1") return run_tile<__nv_bfloat16, 1, false>(false);
  if (name == "descending_metadata") return run_tile<__half, 0, true>(true);
  if (name == "canonical") {
    const int e = run_canonical<__nv_bfloat16>();
    return e != 0 ? e : run_canonical<__half>();
  }
  std::fprintf(stderr, "unknown case %s\n", name.c_str());
  return 2;
}
