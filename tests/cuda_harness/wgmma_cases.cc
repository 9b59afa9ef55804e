// Test-only: the harness's emulation of the sm_90a warpgroup products of
// cuda/wgmma.cuh (include/wgmma_emulation.h) against their definitions, one
// warpgroup per case, through the device functions the kernels call.
//
//   product CASE: TYPE (bf16, f16, tf32) x SS or RS x N x swizzle (none, 32, 64,
//     128) x B major (k, mn). The host lays A (64 x K) and B (K x N) out in a
//     shared-memory image by this file's own reading of the layouts (rows of the
//     swizzle's width, 8-row core-matrix groups, the swizzle as CuTe's
//     Swizzle<b, 4, 3> of the byte address), the kernel copies it to dynamic
//     shared memory (aligned to 1024 bytes), takes descriptors, steps along K by
//     advance_descriptor, and checks every element of D against the product in
//     double; with C, the accumulator starts from C (scale-d 1), else from the
//     poison the harness leaves in the registers (scale-d 0 must ignore it).
//   hand_swizzled_ss, hand_swizzled_rs: the kernel writes A (K-major) and V
//     (MN-major) into 128B-swizzled tiles itself through swizzled_offset, as an
//     attention kernel without TMA would, then D = A V (SS; RS with A from
//     registers by register_a_coord);
//   right_sequence: two warpgroups, chained products, a wait, a read, a fence,
//     another product (must run);
//   hazards: read_before_wait, never_committed, wait_group_counts,
//     missing_warp, no_fence, access_after_fence, partial_warpgroup,
//     descriptor_out_of_bounds, divergent_descriptors: each must fail the
//     launch (the test checks the report);
//   missing_barrier: A written by every thread with no barrier before the
//     product: right in the harness, a race under ThreadSanitizer.
//
// usage: wgmma_cases CASE [ARGS]   exit 0: right result; 3: wrong result; 4: the
//                                  launch failed (report on stderr)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "cuda/wgmma.cuh"

extern "C" unsigned long long jaxops_harness_wgmmas(int kind);

namespace {

using jaxops::cuda::launch_kernel;
using jaxops::cuda::launch_kernel_dynamic_shared;
namespace wg = jaxops::cuda::wgmma;

int g_wrong = 0;

void wrong(const std::string& what) {
  if (g_wrong++ < 8) std::fprintf(stderr, "wrong result: %s\n", what.c_str());
}

bool launched(cudaError_t status) {
  if (status == cudaSuccess) return true;
  std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(status));
  return false;
}

// A layout of one operand in the shared-memory image, as this test reads the ISA.
struct Layout {
  bool mn_major;
  wg::Swizzle swizzle;
  int element_bytes;
  int mn;       // rows of A (64) or columns of B (N)
  int k;        // the whole K of the case
  uint32_t lbo, sbo, step;  // descriptor offsets; bytes from one k-step to the next
  uint32_t bytes;

  int width() const { return 16 << wg::swizzle_bits(swizzle); }  // a swizzled row
  uint32_t linear(int m, int kk) const {
    const int t = 16 / element_bytes;
    if (swizzle == wg::Swizzle::kNone) {  // interleaved 8 x 16-byte core matrices
      if (!mn_major) return (m % 8) * 16 + (m / 8) * sbo + (kk / t) * lbo + (kk % t) * element_bytes;
      return (m / t) * sbo + (m % t) * element_bytes + (kk % 8) * 16 + (kk / 8) * lbo;
    }
    const int per_row = width() / element_bytes;
    if (!mn_major) return m * width() + kk * element_bytes;  // one mn per row, k along it
    return (m / per_row) * lbo + kk * width() + (m % per_row) * element_bytes;
  }
  // Swizzle<b, 4, 3> of the byte address (the tile base is 1024-aligned).
  uint32_t physical(int m, int kk) const {
    const uint32_t a = linear(m, kk), b = wg::swizzle_bits(swizzle);
    return a ^ (((a >> 7) & ((1u << b) - 1u)) << 4);
  }
};

Layout make_layout(bool mn_major, wg::Swizzle s, int element_bytes, int mn, int k, int k_step) {
  Layout l{mn_major, s, element_bytes, mn, k, 0, 0, 0, 0};
  const int t = 16 / element_bytes;
  if (s == wg::Swizzle::kNone) {
    if (!mn_major) {
      l.lbo = 128;                 // K-adjacent core matrices
      l.sbo = 128 * (k / t);       // next 8 rows
      l.step = 128 * (k_step / t);
    } else {
      l.lbo = 128;                 // next 8 k-rows
      l.sbo = 128 * (k / 8);       // next t columns
      l.step = 128 * (k_step / 8);
    }
    l.bytes = mn * k * element_bytes;
    return l;
  }
  const int w = l.width();
  if (!mn_major) {
    l.lbo = 16;         // unused for swizzled K-major
    l.sbo = 8 * w;      // next 8 rows
    l.step = k_step * element_bytes;
  } else {
    const int per_row = w / element_bytes;
    l.lbo = k * w;      // next block of per_row columns
    l.sbo = 8 * w;      // next 8 k-rows
    l.step = k_step * w;
    l.bytes = (mn + per_row - 1) / per_row * l.lbo;  // a narrow B fills part of each row
    return l;
  }
  l.bytes = mn * w;
  return l;
}

template <typename T>
uint32_t bits_of(float v) {
  if constexpr (std::is_same<T, float>::value) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    return b;
  } else {
    const T h(v);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
}

// One case's operands for the kernel.
struct Case {
  Layout a, b;
  uint32_t b_offset;  // where B starts in the image (1024-aligned)
  int k_steps;
};

template <int N, typename T, bool kRs, wg::Major kMajorB>
__global__ void __launch_bounds__(128) product_kernel(Case c, const unsigned char* image,
                                                      uint32_t image_bytes, const uint32_t* a_regs,
                                                      const float* c_in, bool with_c, float* d_out) {
  unsigned char* raw = jaxops::cuda::dynamic_shared_memory<unsigned char>();
  unsigned char* tile = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  for (uint32_t i = threadIdx.x; i < image_bytes; i += 128) tile[i] = image[i];
  __syncthreads();
  const int t = threadIdx.x;
  wg::Accumulator<N> acc;
  if (with_c) {
    for (int i = 0; i < N / 2; ++i) {
      const wg::RowCol rc = wg::accumulator_coord(t, i);
      acc[i] = c_in[rc.row * N + rc.col];
    }
  }
  wg::fence();
  const uint32_t base = wg::shared_address(tile);
  const uint64_t desc_a = wg::make_descriptor(base, c.a.swizzle, c.a.lbo, c.a.sbo);
  const uint64_t desc_b = wg::make_descriptor(base + c.b_offset, c.b.swizzle, c.b.lbo, c.b.sbo);
  for (int s = 0; s < c.k_steps; ++s) {
    const uint64_t db = wg::advance_descriptor(desc_b, s * c.b.step);
    if constexpr (kRs) {
      uint32_t a[4];
      for (int r = 0; r < 4; ++r) a[r] = a_regs[(s * 128 + t) * 4 + r];
      if constexpr (std::is_same<T, float>::value) {
        wg::mma_rs_tf32(acc, a, db, with_c || s > 0);
      } else {
        wg::mma_rs<T, kMajorB>(acc, a, db, with_c || s > 0);
      }
    } else {
      const uint64_t da = wg::advance_descriptor(desc_a, s * c.a.step);
      if constexpr (std::is_same<T, float>::value) {
        wg::mma_ss_tf32(acc, da, db, with_c || s > 0);
      } else {
        wg::mma_ss<T, wg::Major::kK, kMajorB>(acc, da, db, with_c || s > 0);
      }
    }
  }
  wg::commit_group();
  wg::wait_group<0>(acc);
  for (int i = 0; i < N / 2; ++i) {
    const wg::RowCol rc = wg::accumulator_coord(t, i);
    d_out[rc.row * N + rc.col] = acc[i];
  }
}

template <int N, typename T, bool kRs, wg::Major kMajorB>
int run_product(wg::Swizzle swizzle, bool with_c) {
  constexpr bool kTf32 = std::is_same<T, float>::value;
  constexpr int kBytes = kTf32 ? 4 : 2, kStep = kTf32 ? 8 : 16;
  constexpr bool kMnB = kMajorB == wg::Major::kMN;
  // K: the swizzled row's width in elements (one row per mn, K-major), at least one step.
  const int width = 16 << wg::swizzle_bits(swizzle);
  const int k = swizzle == wg::Swizzle::kNone ? 2 * kStep : std::max(kStep, width / kBytes);
  Case c{make_layout(false, swizzle, kBytes, 64, k, kStep),
         make_layout(kMnB, swizzle, kBytes, N, k, kStep), 0, k / kStep};
  c.b_offset = (c.a.bytes + 1023) & ~1023u;
  const uint32_t image_bytes = c.b_offset + c.b.bytes;
  std::vector<unsigned char> image(image_bytes, 0xff);
  std::mt19937 rng(N * 7 + static_cast<int>(swizzle) * 3 + kMnB + (kRs ? 11 : 0));
  std::uniform_int_distribution<int> small(-8, 8);
  // Values exact in every operand type (multiples of 1/8 below 2), so the only
  // difference from the double product is the float summation.
  std::vector<float> a(64 * k), b(k * N), cm(64 * N);
  for (float& v : a) v = small(rng) / 8.f;
  for (float& v : b) v = small(rng) / 8.f;
  for (float& v : cm) v = small(rng) / 4.f;
  const auto put = [&](uint32_t at, float v) {
    const uint32_t bits = bits_of<T>(v);
    std::memcpy(&image[at], &bits, kBytes);
  };
  for (int m = 0; m < 64; ++m) {
    for (int kk = 0; kk < k; ++kk) put(c.a.physical(m, kk), a[m * k + kk]);
  }
  for (int n = 0; n < N; ++n) {
    for (int kk = 0; kk < k; ++kk) put(c.b_offset + c.b.physical(n, kk), b[kk * N + n]);
  }
  // The RS A fragments of every k-step, by the register fragment layout.
  std::vector<uint32_t> regs(c.k_steps * 128 * 4, 0);
  for (int s = 0; s < c.k_steps; ++s) {
    for (int t = 0; t < 128; ++t) {
      for (int i = 0; i < (kTf32 ? 4 : 8); ++i) {
        const wg::RowCol rc = kTf32 ? wg::register_a_tf32_coord(t, i) : wg::register_a_coord(t, i);
        const uint32_t bits = bits_of<T>(a[rc.row * k + s * kStep + rc.col]);
        uint32_t& reg = regs[(s * 128 + t) * 4 + (kTf32 ? i : i / 2)];
        reg |= kTf32 ? bits : bits << (16 * (i % 2));
      }
    }
  }
  std::vector<float> d(64 * N, std::nanf(""));
  const int kind = kTf32 ? 2 : std::is_same<T, __nv_bfloat16>::value ? 1 : 0;
  const unsigned long long products = jaxops_harness_wgmmas(kind);
  if (!launched(launch_kernel_dynamic_shared(product_kernel<N, T, kRs, kMajorB>, dim3(1),
                                             dim3(128), image_bytes + 1024, nullptr, c,
                                             image.data(), image_bytes, regs.data(), cm.data(),
                                             with_c, d.data()))) {
    return 4;
  }
  if (jaxops_harness_wgmmas(kind) - products != static_cast<unsigned long long>(c.k_steps)) {
    wrong("counted " + std::to_string(jaxops_harness_wgmmas(kind) - products) + " products, not " +
          std::to_string(c.k_steps));
  }
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < N; ++n) {
      double expected = with_c ? cm[m * N + n] : 0.0;
      for (int kk = 0; kk < k; ++kk) expected += double(a[m * k + kk]) * b[kk * N + n];
      const float got = d[m * N + n];
      if (!(std::fabs(got - expected) <= 1e-5 * (1 + std::fabs(expected)))) {
        wrong("D[" + std::to_string(m) + "][" + std::to_string(n) + "] = " +
              std::to_string(got) + ", expected " + std::to_string(expected));
      }
    }
  }
  return g_wrong ? 3 : 0;
}

// -- a kernel writing its tiles by hand --------------------------------------------------

// As an attention kernel lays out Q and V without TMA: A (64 x 64, row-major, K
// contiguous) into 128-byte rows, chunk-swizzled by swizzled_offset; B = V (64 x
// N, row-major: N contiguous, so MN-major) into blocks of 64 columns of 128-byte
// rows (LBO 8192 between the blocks, SBO 1024 between 8-row groups of K). Then
// D = A B in four k16 steps: 32 bytes along A's rows, 2048 bytes (16 rows) down B.
template <int N, bool kRs>
__global__ void __launch_bounds__(128) hand_swizzled_kernel(const __nv_bfloat16* a,
                                                            const __nv_bfloat16* v, float* d_out) {
  unsigned char* raw = jaxops::cuda::dynamic_shared_memory<unsigned char>();
  unsigned char* tile = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  unsigned char* tile_v = tile + 64 * 128;
  const int t = threadIdx.x;
  for (int e = t; e < 64 * 64; e += 128) {
    const int m = e / 64, k = e % 64;
    *reinterpret_cast<__nv_bfloat16*>(tile + wg::swizzled_offset(wg::Swizzle::k128B, m * 128 + k * 2)) =
        a[e];
  }
  for (int e = t; e < 64 * N; e += 128) {
    const int k = e / N, n = e % N;
    *reinterpret_cast<__nv_bfloat16*>(
        tile_v + (n / 64) * 8192 + wg::swizzled_offset(wg::Swizzle::k128B, k * 128 + (n % 64) * 2)) =
        v[e];
  }
  __syncthreads();
  const uint32_t base = wg::shared_address(tile);
  const uint64_t desc_a = wg::make_descriptor(base, wg::Swizzle::k128B, 16, 1024);
  const uint64_t desc_v = wg::make_descriptor(base + 64 * 128, wg::Swizzle::k128B, 8192, 1024);
  wg::Accumulator<N> acc;
  wg::fence();
  for (int s = 0; s < 4; ++s) {
    const uint64_t db = wg::advance_descriptor(desc_v, 2048 * s);
    if constexpr (kRs) {
      uint32_t r[4];
      for (int i = 0; i < 8; i += 2) {
        const wg::RowCol lo = wg::register_a_coord(t, i), hi = wg::register_a_coord(t, i + 1);
        const __nv_bfloat162 pair{a[lo.row * 64 + 16 * s + lo.col], a[hi.row * 64 + 16 * s + hi.col]};
        std::memcpy(&r[i / 2], &pair, 4);
      }
      wg::mma_rs<__nv_bfloat16, wg::Major::kMN>(acc, r, db, s > 0);
    } else {
      wg::mma_ss<__nv_bfloat16, wg::Major::kK, wg::Major::kMN>(
          acc, wg::advance_descriptor(desc_a, 32 * s), db, s > 0);
    }
  }
  wg::commit_group();
  wg::wait_group<0>(acc);
  for (int i = 0; i < N / 2; ++i) {
    const wg::RowCol rc = wg::accumulator_coord(t, i);
    d_out[rc.row * N + rc.col] = acc[i];
  }
}

template <int N, bool kRs>
int run_hand_swizzled() {
  std::mt19937 rng(N + kRs);
  std::uniform_int_distribution<int> small(-8, 8);
  std::vector<__nv_bfloat16> a(64 * 64), v(64 * N);
  for (auto& x : a) x = __nv_bfloat16(small(rng) / 8.f);
  for (auto& x : v) x = __nv_bfloat16(small(rng) / 8.f);
  std::vector<float> d(64 * N, std::nanf(""));
  const size_t bytes = 1024 + 64 * 128 + (N / 64) * 8192;
  if (!launched(launch_kernel_dynamic_shared(hand_swizzled_kernel<N, kRs>, dim3(1), dim3(128),
                                             bytes, nullptr, a.data(), v.data(), d.data()))) {
    return 4;
  }
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < N; ++n) {
      double expected = 0;
      for (int k = 0; k < 64; ++k) expected += double(float(a[m * 64 + k])) * float(v[k * N + n]);
      if (!(std::fabs(d[m * N + n] - expected) <= 1e-5 * (1 + std::fabs(expected)))) {
        wrong("D[" + std::to_string(m) + "][" + std::to_string(n) + "] = " +
              std::to_string(d[m * N + n]) + ", expected " + std::to_string(expected));
      }
    }
  }
  return g_wrong ? 3 : 0;
}

// -- hazards ------------------------------------------------------------------------------

// A 64 x 16 (A) and 16 x 64 (B) bf16 tile pair in dynamic shared memory, no swizzle.
struct Tiles {
  uint64_t a, b;
};
__device__ Tiles zero_tiles() {
  unsigned char* raw = jaxops::cuda::dynamic_shared_memory<unsigned char>();
  unsigned char* tile = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) tile[i] = 0;
  __syncthreads();
  const uint32_t base = wg::shared_address(tile);
  return {wg::make_descriptor(base, wg::Swizzle::kNone, 128, 256),
          wg::make_descriptor(base + 2048, wg::Swizzle::kNone, 128, 256)};
}

__global__ void hazard_kernel(int which, float* out) {
  const Tiles tiles = zero_tiles();
  wg::Accumulator<64> acc, other;
  const int t = threadIdx.x;
  switch (which) {
    case 0:  // read before the wait
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::commit_group();
      out[t] = acc[0];
      wg::wait_group<0>(acc);
      break;
    case 1:  // waited, but never committed
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::wait_group<0>(acc);
      out[t] = acc[0];
      wg::commit_group();
      break;
    case 2:  // wait_group 1 covers the first group only
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::commit_group();
      wg::mma_ss<__nv_bfloat16>(other, tiles.a, tiles.b, false);
      wg::commit_group();
      wg::wait_group<1>(acc);
      out[t] = acc[0];    // fine: group 0 is complete
      out[t] += other[0];  // group 1 is not
      wg::wait_group<0>(other);
      break;
    case 3:  // warp 3 skips the product
      if (t >= 96) return;
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::commit_group();
      wg::wait_group<0>(acc);
      out[t] = acc[0];
      break;
    case 4:  // no fence before the first product
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::commit_group();
      wg::wait_group<0>(acc);
      break;
    case 5:  // accumulator written after the fence
      wg::fence();
      acc[3] = 1.f;
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, true);
      wg::commit_group();
      wg::wait_group<0>(acc);
      break;
    case 6:  // a right sequence: fence, chained products, wait, read, fence, product
      for (int i = 0; i < 32; ++i) acc[i] = 1.f;
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, true);
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, true);
      wg::commit_group();
      wg::wait_group<0>(acc);
      out[t] = acc[0];
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::commit_group();
      wg::wait_group<0>(acc);
      out[t] += acc[1];
      break;
    case 7:  // B's descriptor runs past the 5120 bytes of dynamic shared memory
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, wg::advance_descriptor(tiles.b, 4096), false);
      wg::commit_group();
      wg::wait_group<0>(acc);
      break;
    case 9: {  // every thread writes its part of A, no barrier before the product
      unsigned char* raw = jaxops::cuda::dynamic_shared_memory<unsigned char>();
      unsigned char* tile = reinterpret_cast<unsigned char*>(
          (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
      for (int i = t; i < 2048; i += 128) tile[i] = 0;
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, tiles.b, false);
      wg::commit_group();
      wg::wait_group<0>(acc);
      out[t] = acc[0] + 1.f;
      break;
    }
    case 8:  // thread 5 gives another B
      wg::fence();
      wg::mma_ss<__nv_bfloat16>(acc, tiles.a, t == 5 ? tiles.a : tiles.b, false);
      wg::commit_group();
      wg::wait_group<0>(acc);
      break;
  }
}

int run_hazard(int which, int threads) {
  std::vector<float> out(256, -1.f);
  if (!launched(launch_kernel_dynamic_shared(hazard_kernel, dim3(1), dim3(threads), 5120,
                                             nullptr, which, out.data()))) {
    return 4;
  }
  // Only the right sequence gets here: A, B zero, so D = C = 1, then D = 0.
  for (int t = 0; t < threads; ++t) {
    if (out[t] != 1.f) wrong("thread " + std::to_string(t) + ": " + std::to_string(out[t]));
  }
  return g_wrong ? 3 : 0;
}

wg::Swizzle swizzle_named(const std::string& s) {
  return s == "128" ? wg::Swizzle::k128B : s == "64" ? wg::Swizzle::k64B
         : s == "32" ? wg::Swizzle::k32B : wg::Swizzle::kNone;
}

// product TYPE ss|rs N SWIZZLE k|mn c|noc
template <typename T, bool kRs, wg::Major kMajorB>
int dispatch_n(int n, wg::Swizzle s, bool with_c) {
  switch (n) {
    case 8: return run_product<8, T, kRs, kMajorB>(s, with_c);
    case 16: return run_product<16, T, kRs, kMajorB>(s, with_c);
    case 64: return run_product<64, T, kRs, kMajorB>(s, with_c);
    case 96: return run_product<96, T, kRs, kMajorB>(s, with_c);
    case 128: return run_product<128, T, kRs, kMajorB>(s, with_c);
    case 192: return run_product<192, T, kRs, kMajorB>(s, with_c);
    case 256: return run_product<256, T, kRs, kMajorB>(s, with_c);
  }
  return 2;
}

template <typename T>
int dispatch_product(bool rs, int n, wg::Swizzle s, bool mn, bool with_c) {
  if constexpr (std::is_same<T, float>::value) {
    if (mn) return 2;  // TF32 has no transpose
    return rs ? dispatch_n<T, true, wg::Major::kK>(n, s, with_c)
              : dispatch_n<T, false, wg::Major::kK>(n, s, with_c);
  } else {
    if (rs) {
      return mn ? dispatch_n<T, true, wg::Major::kMN>(n, s, with_c)
                : dispatch_n<T, true, wg::Major::kK>(n, s, with_c);
    }
    return mn ? dispatch_n<T, false, wg::Major::kMN>(n, s, with_c)
              : dispatch_n<T, false, wg::Major::kK>(n, s, with_c);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string name = argv[1];
  if (name == "product" && argc == 8) {
    const std::string type = argv[2];
    const bool rs = std::string(argv[3]) == "rs";
    const int n = std::atoi(argv[4]);
    const wg::Swizzle s = swizzle_named(argv[5]);
    const bool mn = std::string(argv[6]) == "mn", with_c = std::string(argv[7]) == "c";
    if (type == "bf16") return dispatch_product<__nv_bfloat16>(rs, n, s, mn, with_c);
    if (type == "f16") return dispatch_product<__half>(rs, n, s, mn, with_c);
    if (type == "tf32") return dispatch_product<float>(rs, n, s, mn, with_c);
    return 2;
  }
  if (name == "hand_swizzled_ss") return run_hand_swizzled<128, false>();
  if (name == "hand_swizzled_rs") return run_hand_swizzled<64, true>();
  if (name == "read_before_wait") return run_hazard(0, 128);
  if (name == "never_committed") return run_hazard(1, 128);
  if (name == "wait_group_counts") return run_hazard(2, 128);
  if (name == "missing_warp") return run_hazard(3, 128);
  if (name == "no_fence") return run_hazard(4, 128);
  if (name == "access_after_fence") return run_hazard(5, 128);
  if (name == "right_sequence") return run_hazard(6, 256);
  if (name == "partial_warpgroup") return run_hazard(6, 96);
  if (name == "descriptor_out_of_bounds") return run_hazard(7, 128);
  if (name == "divergent_descriptors") return run_hazard(8, 128);
  // A race only ThreadSanitizer sees (the result is right in the harness).
  if (name == "missing_barrier") return run_hazard(9, 128);
  std::fprintf(stderr, "unknown case %s\n", name.c_str());
  return 2;
}
