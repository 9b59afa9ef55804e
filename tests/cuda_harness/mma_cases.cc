// Test-only: the harness's emulation of the sm_80 instructions of cuda/mma.cuh
// (include/mma_emulation.h) against their PTX ISA definitions, one warp (or
// block) per case, through the device functions the kernels call.
//
//   mma_f16, mma_bf16, mma_tf32: registers filled from A, B, C by the ISA's
//     per-lane formulas (section 9.7.14.5, written out here again), D checked
//     element by element against the product A B + C in double;
//   ldmatrix: x1, x2 and x4, with and without .trans, from a 32 x 8 matrix
//     of distinct 16-bit values: every register half of every lane checked
//     against the element the ISA names (row g, columns 2t and 2t + 1 of each
//     8 x 8 matrix; with .trans, rows 2t and 2t + 1 of column g);
//   ldmatrix_mma: A by ldmatrix.x4, B by ldmatrix.x2 from B^T (rows of K, as
//     the attention kernels load keys) and by ldmatrix.x2.trans from B (rows
//     of V), then mma.sync: the product of the matrices in shared memory;
//   cp_async: 16-byte copies with and without zero fill: the destination
//     holds poison (0xff bytes) from the issue until the wait_group that
//     covers its group, the data after; wait_group 1 leaves the newest
//     group pending;
//   cp_async_read_before_wait: an ldmatrix of a pending destination (must
//     fail the launch);
//   mma_missing_lane: lane 31 skips the mma.sync (must fail the launch).
//
// usage: mma_cases CASE     exit 0: right result; 3: wrong result; 4: the launch
//                           failed (report on stderr)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "cuda/mma.cuh"

namespace {

using jaxops::cuda::launch_kernel;
namespace mma = jaxops::cuda::mma;

int g_wrong = 0;

void wrong(const std::string& what) {
  if (g_wrong++ < 8) std::fprintf(stderr, "wrong result: %s\n", what.c_str());
}

template <typename T>
uint16_t bits_of(T v) {
  uint16_t b;
  std::memcpy(&b, &v, 2);
  return b;
}

template <typename T>
uint32_t pack(T low, T high) {
  return bits_of(low) | static_cast<uint32_t>(bits_of(high)) << 16;
}

// -- mma.sync -------------------------------------------------------------------------------

// a [16][16], b [16][8] (T), c, d [16][8] float, by the m16n8k16 formulas.
template <typename T>
__global__ void mma_m16n8k16_tile(const T* a, const T* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const auto at = [&](int i) { return a[(g + 8 * ((i >> 1) & 1)) * 16 + 2 * t + (i & 1) + 8 * (i >> 2)]; };
  const auto bt = [&](int i) { return b[(2 * t + (i & 1) + 8 * (i >> 1)) * 8 + g]; };
  uint32_t ra[4], rb[2];
  for (int r = 0; r < 4; ++r) ra[r] = pack(at(2 * r), at(2 * r + 1));
  for (int r = 0; r < 2; ++r) rb[r] = pack(bt(2 * r), bt(2 * r + 1));
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  mma::mma_m16n8k16<T>(acc, ra, rb);
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[i];
}

// a [16][8], b [8][8] float (already TF32 values), by the m16n8k8 .tf32 formulas.
__global__ void mma_m16n8k8_tile(const float* a, const float* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  uint32_t ra[4], rb[2];
  for (int i = 0; i < 4; ++i) ra[i] = mma::tf32_bits(a[(g + 8 * (i & 1)) * 8 + t + 4 * (i >> 1)]);
  for (int i = 0; i < 2; ++i) rb[i] = mma::tf32_bits(b[(t + 4 * i) * 8 + g]);
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  mma::mma_m16n8k8_tf32(acc, ra, rb);
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[i];
}

// d [16][8] against sum_k a(i, k) b(k, j) + c in double.
void check_product(const std::vector<double>& a, const std::vector<double>& b,
                   const std::vector<float>& c, const std::vector<float>& d, int K) {
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      double sum = c[i * 8 + j], scale = std::fabs(sum);
      for (int k = 0; k < K; ++k) {
        sum += a[i * K + k] * b[k * 8 + j];
        scale += std::fabs(a[i * K + k] * b[k * 8 + j]);
      }
      if (!(std::fabs(d[i * 8 + j] - sum) <= 1e-5 * (1.0 + scale))) {
        wrong("D[" + std::to_string(i) + "][" + std::to_string(j) + "] = " +
              std::to_string(d[i * 8 + j]) + ", expected " + std::to_string(sum));
      }
    }
  }
}

bool launched(cudaError_t status) {
  if (status == cudaSuccess) return true;
  std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(status));
  return false;
}

template <typename T>
int run_mma_m16n8k16() {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<T> a(16 * 16), b(16 * 8);
  std::vector<double> ad(a.size()), bd(b.size());
  for (size_t i = 0; i < a.size(); ++i) ad[i] = static_cast<float>(a[i] = T(normal(rng)));
  for (size_t i = 0; i < b.size(); ++i) bd[i] = static_cast<float>(b[i] = T(normal(rng)));
  std::vector<float> c(16 * 8), d(16 * 8);
  for (float& v : c) v = normal(rng);
  if (!launched(launch_kernel(mma_m16n8k16_tile<T>, dim3(1), dim3(32), nullptr, a.data(),
                                 b.data(), c.data(), d.data()))) {
    return 4;
  }
  check_product(ad, bd, c, d, 16);
  return g_wrong ? 3 : 0;
}

int run_mma_tf32() {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.f, 1.f);
  // TF32 values (10 explicit mantissa bits), so that the product is exact in double.
  const auto tf32 = [](float x) { return nvcuda::wmma::__float_to_tf32(x); };
  std::vector<float> a(16 * 8), b(8 * 8), c(16 * 8), d(16 * 8);
  std::vector<double> ad(a.size()), bd(b.size());
  for (size_t i = 0; i < a.size(); ++i) ad[i] = a[i] = tf32(normal(rng));
  for (size_t i = 0; i < b.size(); ++i) bd[i] = b[i] = tf32(normal(rng));
  for (float& v : c) v = normal(rng);
  if (!launched(launch_kernel(mma_m16n8k8_tile, dim3(1), dim3(32), nullptr, a.data(),
                                     b.data(), c.data(), d.data()))) {
    return 4;
  }
  check_product(ad, bd, c, d, 8);
  return g_wrong ? 3 : 0;
}

// -- ldmatrix ---------------------------------------------------------------------------------

// A 32 x 8 matrix of 16-bit values v(r, c) = 8 r + c in shared memory; lane l
// addresses row l; out[lane][m] is register m.
template <int kMatrices, bool kTrans>
__global__ void ldmatrix_rows(uint32_t* out) {
  __shared__ __align__(16) uint16_t matrix[32][8];
  const int lane = threadIdx.x;
  for (int c = 0; c < 8; ++c) matrix[lane][c] = static_cast<uint16_t>(8 * lane + c);
  __syncwarp();
  uint32_t r[kMatrices];
  mma::ldmatrix<kMatrices, kTrans>(r, matrix[lane]);
  for (int m = 0; m < kMatrices; ++m) out[lane * 4 + m] = r[m];
}

template <int kMatrices, bool kTrans>
int check_ldmatrix() {
  std::vector<uint32_t> out(32 * 4);
  if (!launched(launch_kernel(ldmatrix_rows<kMatrices, kTrans>, dim3(1), dim3(32), nullptr,
                                     out.data()))) {
    return 4;
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int m = 0; m < kMatrices; ++m) {
      for (int half = 0; half < 2; ++half) {
        // Row and column within matrix m (rows 8m .. 8m + 7 of the whole).
        const int row = kTrans ? 2 * t + half : g, col = kTrans ? g : 2 * t + half;
        const uint32_t expected = 8 * (8 * m + row) + col;
        const uint32_t got = out[lane * 4 + m] >> (16 * half) & 0xffffu;
        if (got != expected) {
          wrong("ldmatrix x" + std::to_string(kMatrices) + (kTrans ? ".trans" : "") + " lane " +
                std::to_string(lane) + " register " + std::to_string(m) + " half " +
                std::to_string(half) + ": " + std::to_string(got) + ", expected " +
                std::to_string(expected));
        }
      }
    }
  }
  return 0;
}

int run_ldmatrix() {
  const int status[] = {check_ldmatrix<1, false>(), check_ldmatrix<2, false>(),
                        check_ldmatrix<4, false>(), check_ldmatrix<1, true>(),
                        check_ldmatrix<2, true>(),  check_ldmatrix<4, true>()};
  for (int s : status) {
    if (s != 0) return s;
  }
  return g_wrong ? 3 : 0;
}

// A [16][16] row-major, B^T [8][16] (rows of keys) and B [16][8] (rows of
// values) into shared memory; A by ldmatrix.x4; B by ldmatrix.x2 from B^T, and
// again by ldmatrix.x2.trans from B: d[0] and d[1] both A B.
__global__ void ldmatrix_then_mma(const __nv_bfloat16* a, const __nv_bfloat16* b, float* d) {
  __shared__ __align__(16) __nv_bfloat16 sa[16][16], sbt[8][16], sb[16][8];
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 256; i += 32) sa[i / 16][i % 16] = a[i];
  for (int i = lane; i < 128; i += 32) {
    sb[i / 8][i % 8] = b[i];
    sbt[i % 8][i / 8] = b[i];
  }
  __syncwarp();
  uint32_t ra[4], rb[2], rb_trans[2];
  // Matrices: rows 0-7 and 8-15 of columns 0-7, then of columns 8-15.
  mma::ldmatrix<4, false>(ra, &sa[(lane & 7) + 8 * ((lane >> 3) & 1)][8 * (lane >> 4)]);
  // Keys 0-7 at dims 0-7, then at dims 8-15 (lanes 16-31 repeat: unused).
  mma::ldmatrix<2, false>(rb, &sbt[lane & 7][8 * ((lane >> 3) & 1)]);
  // Value rows 0-7, then 8-15.
  mma::ldmatrix<2, true>(rb_trans, &sb[lane & 15][0]);
  float acc[2][4] = {};
  mma::mma_m16n8k16<__nv_bfloat16>(acc[0], ra, rb);
  mma::mma_m16n8k16<__nv_bfloat16>(acc[1], ra, rb_trans);
  for (int v = 0; v < 2; ++v) {
    for (int i = 0; i < 4; ++i) d[v * 128 + (g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[v][i];
  }
}

int run_ldmatrix_mma() {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<__nv_bfloat16> a(256), b(128);
  std::vector<double> ad(256), bd(128);
  for (int i = 0; i < 256; ++i) ad[i] = static_cast<float>(a[i] = __nv_bfloat16(normal(rng)));
  for (int i = 0; i < 128; ++i) bd[i] = static_cast<float>(b[i] = __nv_bfloat16(normal(rng)));
  std::vector<float> d(256), zero(128, 0.f);
  if (!launched(launch_kernel(ldmatrix_then_mma, dim3(1), dim3(32), nullptr, a.data(),
                                     b.data(), d.data()))) {
    return 4;
  }
  check_product(ad, bd, zero, std::vector<float>(d.begin(), d.begin() + 128), 16);
  check_product(ad, bd, zero, std::vector<float>(d.begin() + 128, d.end()), 16);
  return g_wrong ? 3 : 0;
}

// -- cp.async -----------------------------------------------------------------------------------

// Each of 64 threads copies 16 bytes (8 halves) of row `thread` of src into
// its row of a [64][8] tile, in two groups: rows < 32 first, then the others,
// rows 48 and up zero-filled. Poison before the waits, the data after
// (seen[0] before any wait, seen[1] after wait_group 1, seen[2] after 0).
__global__ void cp_async_groups(const __half* src, __half* seen) {
  __shared__ __align__(16) __half tile[64][8];
  const int row = threadIdx.x;
  const bool first = row < 32;
  if (first) mma::cp_async_16(tile[row], src + 8 * row, 16);
  mma::cp_async_commit();
  if (!first) mma::cp_async_16(tile[row], src + 8 * row, row < 48 ? 16 : 0);
  mma::cp_async_commit();
  for (int c = 0; c < 8; ++c) seen[row * 8 + c] = tile[row][c];
  mma::cp_async_wait<1>();
  for (int c = 0; c < 8; ++c) seen[512 + row * 8 + c] = tile[row][c];
  mma::cp_async_wait<0>();
  for (int c = 0; c < 8; ++c) seen[1024 + row * 8 + c] = tile[row][c];
}

int run_cp_async() {
  std::vector<__half> src(512), seen(1536);
  for (int i = 0; i < 512; ++i) src[i] = __half(static_cast<float>(i % 97) - 40.f);
  if (!launched(launch_kernel(cp_async_groups, dim3(1), dim3(64), nullptr, src.data(),
                                     seen.data()))) {
    return 4;
  }
  const uint16_t poison = 0xffffu;
  for (int row = 0; row < 64; ++row) {
    for (int c = 0; c < 8; ++c) {
      const int i = row * 8 + c;
      const uint16_t data = row < 48 ? bits_of(src[i]) : 0;
      const uint16_t expected[3] = {poison, row < 32 ? data : poison, data};
      for (int when = 0; when < 3; ++when) {
        if (bits_of(seen[when * 512 + i]) != expected[when]) {
          wrong("row " + std::to_string(row) + " column " + std::to_string(c) + " at stage " +
                std::to_string(when) + ": bits " + std::to_string(bits_of(seen[when * 512 + i])) +
                ", expected " + std::to_string(expected[when]));
        }
      }
    }
  }
  return g_wrong ? 3 : 0;
}

// Lane 0 reads (by ldmatrix) a row another lane copies asynchronously, before any wait.
__global__ void cp_async_read_before_wait(const __half* src, uint32_t* out) {
  __shared__ __align__(16) __half tile[8][8];
  const int lane = threadIdx.x;
  if (lane < 8) mma::cp_async_16(tile[lane], src + 8 * lane, 16);
  mma::cp_async_commit();
  uint32_t r[1];
  mma::ldmatrix<1, false>(r, tile[lane & 7]);
  out[lane] = r[0];
  mma::cp_async_wait<0>();
}

int run_read_before_wait() {
  std::vector<__half> src(64, __half(1.f));
  std::vector<uint32_t> out(32);
  if (!launched(launch_kernel(cp_async_read_before_wait, dim3(1), dim3(32), nullptr,
                                     src.data(), out.data()))) {
    return 4;
  }
  return 0;
}

__global__ void mma_missing_lane(float* d) {
  if (threadIdx.x == 31) return;
  const uint32_t a[4] = {}, b[2] = {};
  float acc[4] = {};
  mma::mma_m16n8k16<__half>(acc, a, b);
  d[threadIdx.x] = acc[0];
}

int run_missing_lane() {
  std::vector<float> d(32);
  if (!launched(launch_kernel(mma_missing_lane, dim3(1), dim3(32), nullptr, d.data()))) {
    return 4;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string name = argv[1];
  if (name == "mma_f16") return run_mma_m16n8k16<__half>();
  if (name == "mma_bf16") return run_mma_m16n8k16<__nv_bfloat16>();
  if (name == "mma_tf32") return run_mma_tf32();
  if (name == "ldmatrix") return run_ldmatrix();
  if (name == "ldmatrix_mma") return run_ldmatrix_mma();
  if (name == "cp_async") return run_cp_async();
  if (name == "cp_async_read_before_wait") return run_read_before_wait();
  if (name == "mma_missing_lane") return run_missing_lane();
  std::fprintf(stderr, "unknown case %s\n", name.c_str());
  return 2;
}
