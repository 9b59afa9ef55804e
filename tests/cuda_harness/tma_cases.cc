// Test-only: the harness's emulation of cuda/tma.cuh (include/tma_emulation.h)
// against the PTX ISA's definitions, through the device functions kernels call,
// and the warp-specialised pipeline of tma_pipeline.cuh against a host product.
//
//   load: TMA loads of 2D, 3D and 4D boxes with every swizzle (none, 32, 64,
//     128 B), 2- and 4-byte elements, boxes partly out of bounds on every side
//     and an element stride: every byte of shared memory checked against the
//     element the box names (zero out of bounds) at the place the swizzle
//     table puts it (written out here as CUTLASS documents it: 16-byte chunk c
//     of 128-byte row r at chunk c ^ (r mod 8) for 128 B; its low two bits
//     XOR r mod 4 for 64 B; its low bit XOR r mod 2 for 32 B);
//   store, reduce_add: boxes from shared memory to 2D/3D/4D tensors, out of
//     bounds elements unwritten, the rest of the tensor untouched; .add f32;
//   mbarrier_phases: arrivals only, transactions only, both, transactions
//     completing before they are expected, parity flipping over phases: every
//     try_wait.parity result against the ISA's;
//   encode_validation: cuTensorMapEncodeTiled's and make_tensor_map_2d's
//     answers to invalid arguments;
//   swizzle_agreement: tma::swizzled_offset and wgmma::swizzled_offset (which
//     tests/test_cute_oracle.py checks against CuTe's Swizzle) agree;
//   pipeline: tma_pipeline.cuh's kernel on odd shapes, every element of C
//     against a double product, the setmaxnreg plan recorded per warpgroup;
//   the hazards (each must fail the launch with a clear report):
//     read_before_complete, expect_tx_mismatch (deadlock), named_count_mismatch,
//     named_partial_warp, setmaxnreg_partial_warpgroup (deadlock),
//     setmaxnreg_overcommit, store_without_fence, store_not_waited.
//
// usage: tma_cases CASE     exit 0: right result; 3: wrong result; 4: the launch
//                           failed (report on stderr)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "cuda/tensor_map.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"
#include "tests/cuda_harness/tma_pipeline.cuh"

extern "C" unsigned long long jaxops_harness_tma_counts(int which);

namespace {

using jaxops::cuda::dynamic_shared_memory;
using jaxops::cuda::launch_kernel;
using jaxops::cuda::launch_kernel_dynamic_shared;
namespace tma = jaxops::cuda::tma;

int g_wrong = 0;

void wrong(const std::string& what) {
  if (g_wrong++ < 8) std::fprintf(stderr, "wrong result: %s\n", what.c_str());
}

bool launched(cudaError_t status) {
  if (status == cudaSuccess) return true;
  std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(status));
  return false;
}

// Shared memory aligned for the 128-byte swizzle (1024 bytes), from the
// block's dynamic shared memory (the launches ask for 1024 bytes more).
__device__ unsigned char* aligned_shared() {
  unsigned char* raw = dynamic_shared_memory<unsigned char>();
  return raw + (1024 - reinterpret_cast<uintptr_t>(raw) % 1024) % 1024;
}

// Where the swizzle table puts byte `offset` of a dense box.
uint32_t swizzle_table(int swizzle_bytes, uint32_t offset) {
  const uint32_t row = offset / 128, chunk = offset / 16 % 8, within = offset % 16;
  uint32_t moved = chunk;
  if (swizzle_bytes == 128) moved = chunk ^ (row % 8);
  if (swizzle_bytes == 64) moved = (chunk & 4u) | ((chunk & 3u) ^ (row % 4));
  if (swizzle_bytes == 32) moved = (chunk & 6u) | ((chunk & 1u) ^ (row % 2));
  return row * 128 + moved * 16 + within;
}

// A tensor described as a tensor map sees it: dims innermost first, dense rows
// padded to 16 bytes.
struct Tensor {
  int rank;
  uint64_t dims[4];
  uint64_t strides[4];  // bytes; strides[0] is the element size
  int element;
  std::vector<unsigned char> bytes;
};

Tensor make_tensor(int rank, const uint64_t* dims, int element) {
  Tensor t{rank, {}, {}, element, {}};
  uint64_t stride = static_cast<uint64_t>(element);
  for (int d = 0; d < rank; ++d) {
    t.dims[d] = dims[d];
    t.strides[d] = stride;
    stride = d == 0 ? (dims[0] * element + 15) / 16 * 16 : stride * dims[d];
  }
  t.bytes.assign(stride + 16, 0);
  return t;
}

// -- loads ------------------------------------------------------------------------------------

// One thread issues the load; every thread waits on the barrier, then copies
// the box's bytes out.
__global__ void load_box(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1, int c2,
                         int c3, uint32_t bytes, unsigned char* out) {
  unsigned char* box = aligned_shared();
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x == 0) {
    tma::init(&bar, 1);
    tma::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::arrive_expect_tx(&bar, bytes);
    if (rank == 2) tma::load_2d(box, &map, c0, c1, &bar);
    if (rank == 3) tma::load_3d(box, &map, c0, c1, c2, &bar);
    if (rank == 4) tma::load_4d(box, &map, c0, c1, c2, c3, &bar);
  }
  tma::wait_parity(&bar, 0);
  const unsigned char* landed = tma::landed(box, bytes);
  for (uint32_t i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = landed[i];
}

struct LoadCase {
  int rank;
  uint64_t dims[4];
  uint32_t box[4];
  uint32_t element_strides[4];
  int coords[4];
  int swizzle;
  int element;
};

int check_load(const LoadCase& c) {
  Tensor t = make_tensor(c.rank, c.dims, c.element);
  // Distinct nonzero elements: 1 + (7 i mod 65521) over the tensor's elements.
  uint64_t elements = 1;
  for (int d = 0; d < c.rank; ++d) elements *= c.dims[d];
  for (uint64_t i = 0; i < elements; ++i) {
    uint64_t rest = i, offset = 0;
    for (int d = 0; d < c.rank; ++d) {
      offset += rest % c.dims[d] * t.strides[d];
      rest /= c.dims[d];
    }
    const uint32_t v = 1 + static_cast<uint32_t>(7 * i % 65521);
    std::memcpy(&t.bytes[offset], &v, static_cast<size_t>(c.element));
  }
  CUtensorMap map;
  const CUtensorMapDataType type =
      c.element == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT32;
  const CUtensorMapSwizzle swizzle = c.swizzle == 0    ? CU_TENSOR_MAP_SWIZZLE_NONE
                                     : c.swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : c.swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                       : CU_TENSOR_MAP_SWIZZLE_128B;
  const CUresult encoded = cuTensorMapEncodeTiled(
      &map, type, c.rank, t.bytes.data(), t.dims, t.strides + 1, c.box, c.element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (encoded != CUDA_SUCCESS) {
    wrong("encoding a valid map gave CUresult " + std::to_string(encoded));
    return 3;
  }
  uint32_t extent[4];
  uint64_t box_elements = 1;
  for (int d = 0; d < c.rank; ++d) {
    extent[d] = d == 0 ? c.box[0] : (c.box[d] + c.element_strides[d] - 1) / c.element_strides[d];
    box_elements *= extent[d];
  }
  const auto bytes = static_cast<uint32_t>(box_elements * c.element);
  std::vector<unsigned char> out(bytes, 0xee);
  if (!launched(launch_kernel_dynamic_shared(load_box, dim3(1), dim3(64), bytes + 1024, nullptr, map,
                                             c.rank, c.coords[0], c.coords[1], c.coords[2],
                                             c.coords[3], bytes, out.data()))) {
    return 4;
  }
  for (uint64_t e = 0; e < box_elements; ++e) {
    uint64_t rest = e, offset = 0;
    bool inside = true;
    for (int d = 0; d < c.rank; ++d) {
      const int64_t coordinate = c.coords[d] + static_cast<int64_t>(rest % extent[d]) *
                                                   (d == 0 ? 1 : c.element_strides[d]);
      rest /= extent[d];
      inside = inside && coordinate >= 0 && coordinate < static_cast<int64_t>(c.dims[d]);
      offset += static_cast<uint64_t>(coordinate) * t.strides[d];
    }
    uint32_t expected = 0, got = 0;
    if (inside) std::memcpy(&expected, &t.bytes[offset], static_cast<size_t>(c.element));
    const uint32_t at = swizzle_table(c.swizzle, static_cast<uint32_t>(e * c.element));
    std::memcpy(&got, &out[at], static_cast<size_t>(c.element));
    if (got != expected) {
      wrong(std::to_string(c.rank) + "D load, swizzle " + std::to_string(c.swizzle) +
            ": box element " + std::to_string(e) + " at shared byte " + std::to_string(at) +
            " is " + std::to_string(got) + ", expected " + std::to_string(expected));
    }
  }
  return 0;
}

int run_load() {
  const LoadCase cases[] = {
      // rank, dims, box, element strides, coords (out of bounds low and high), swizzle, bytes
      {2, {40, 9}, {24, 5}, {1, 1}, {-8, 6}, 0, 2},
      {2, {40, 9}, {16, 11}, {1, 1}, {30, -3}, 32, 2},
      {2, {40, 9}, {32, 12}, {1, 1}, {-5, -2}, 64, 2},
      {2, {40, 9}, {64, 10}, {1, 1}, {-16, 0}, 128, 2},
      {2, {50, 21}, {32, 16}, {1, 1}, {20, 9}, 128, 4},
      {3, {24, 7, 5}, {8, 3, 4}, {1, 1, 1}, {20, -1, 3}, 0, 4},
      {3, {24, 7, 5}, {16, 9, 2}, {1, 1, 1}, {-4, 0, 4}, 32, 2},
      {3, {24, 7, 5}, {32, 6, 3}, {1, 2, 1}, {0, 1, -1}, 64, 2},
      {3, {30, 6, 4}, {64, 8, 2}, {1, 1, 1}, {-10, -1, 3}, 128, 2},
      {4, {12, 5, 4, 3}, {8, 4, 3, 2}, {1, 1, 1, 1}, {8, 3, -1, 2}, 0, 2},
      {4, {12, 5, 4, 3}, {16, 2, 3, 4}, {1, 1, 1, 1}, {-2, 4, 2, -1}, 32, 2},
      {4, {12, 5, 4, 3}, {16, 3, 2, 2}, {1, 1, 2, 1}, {0, -1, 0, 1}, 64, 4},
      {4, {20, 5, 4, 3}, {32, 4, 2, 2}, {1, 1, 1, 1}, {-6, 2, 3, 2}, 128, 4},
  };
  for (const LoadCase& c : cases) {
    const int status = check_load(c);
    if (status == 4) return 4;
  }
  return g_wrong ? 3 : 0;
}

// -- stores and reductions ----------------------------------------------------------------------

// Every thread writes box elements e (value 1 + e / 2), swizzled, and fences
// them; after a barrier thread 0 stores (or adds) the box and waits.
template <bool kAdd>
__global__ void store_box(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1, int c2,
                          int c3, uint32_t elements, int swizzle) {
  unsigned char* box = aligned_shared();
  for (uint32_t e = threadIdx.x; e < elements; e += blockDim.x) {
    const float v = 1.0f + 0.5f * static_cast<float>(e);
    std::memcpy(box + tma::swizzled_offset(static_cast<tma::Swizzle>(swizzle), 4 * e), &v, 4);
  }
  tma::fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (rank == 2) tma::store_2d<kAdd>(&map, box, c0, c1);
    if (rank == 3) tma::store_3d<kAdd>(&map, box, c0, c1, c2);
    if (rank == 4) tma::store_4d<kAdd>(&map, box, c0, c1, c2, c3);
    tma::bulk_commit_group();
    tma::bulk_wait_group<0>();
  }
}

struct StoreCase {
  int rank;
  uint64_t dims[4];
  uint32_t box[4];
  int coords[4];
  int swizzle;
};

int check_store(const StoreCase& c, bool add) {
  Tensor t = make_tensor(c.rank, c.dims, 4);
  std::vector<float> initial(t.bytes.size() / 4);
  for (size_t i = 0; i < initial.size(); ++i) initial[i] = -0.25f * static_cast<float>(i % 97);
  std::memcpy(t.bytes.data(), initial.data(), initial.size() * 4);
  CUtensorMap map;
  const std::string error = tma::make_tensor_map(&map, tma::TensorDtype::kFloat32, c.rank,
                                                 t.bytes.data(), t.dims, t.strides + 1, c.box,
                                                 static_cast<uint32_t>(c.swizzle));
  if (!error.empty()) {
    wrong("make_tensor_map: " + error);
    return 3;
  }
  uint32_t elements = 1;
  for (int d = 0; d < c.rank; ++d) elements *= c.box[d];
  const auto kernel = add ? store_box<true> : store_box<false>;
  const int swizzle_mode = c.swizzle == 0 ? 0 : c.swizzle == 32 ? 1 : c.swizzle == 64 ? 2 : 3;
  if (!launched(launch_kernel_dynamic_shared(kernel, dim3(1), dim3(64), elements * 4 + 1024, nullptr,
                                             map, c.rank, c.coords[0], c.coords[1], c.coords[2],
                                             c.coords[3], elements, swizzle_mode))) {
    return 4;
  }
  std::vector<float> expected = initial, got(initial.size());
  for (uint32_t e = 0; e < elements; ++e) {
    uint32_t rest = e;
    uint64_t offset = 0;
    bool inside = true;
    for (int d = 0; d < c.rank; ++d) {
      const int64_t coordinate = c.coords[d] + static_cast<int64_t>(rest % c.box[d]);
      rest /= c.box[d];
      inside = inside && coordinate >= 0 && coordinate < static_cast<int64_t>(c.dims[d]);
      offset += static_cast<uint64_t>(coordinate) * t.strides[d];
    }
    if (!inside) continue;
    const float v = 1.0f + 0.5f * static_cast<float>(e);
    expected[offset / 4] = add ? expected[offset / 4] + v : v;
  }
  std::memcpy(got.data(), t.bytes.data(), got.size() * 4);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected[i]) {
      wrong(std::string(add ? "reduce-add " : "store ") + std::to_string(c.rank) + "D: float " +
            std::to_string(i) + " of the tensor is " + std::to_string(got[i]) + ", expected " +
            std::to_string(expected[i]));
    }
  }
  return 0;
}

int run_store(bool add) {
  const StoreCase cases[] = {
      {2, {44, 7}, {32, 4}, {20, 5}, 128},
      {2, {44, 7}, {8, 3}, {-4, -1}, 32},
      {3, {20, 6, 3}, {16, 4, 2}, {12, -2, 2}, 64},
      {4, {12, 5, 3, 2}, {4, 3, 2, 2}, {-1, 3, 1, 1}, 0},
  };
  for (const StoreCase& c : cases) {
    if (check_store(c, add) == 4) return 4;
  }
  return g_wrong ? 3 : 0;
}

// -- mbarrier phases ------------------------------------------------------------------------------

// Thread 0 alone (the other lanes leave) walks barriers through their phases
// and records every try_wait.parity answer.
__global__ void mbarrier_walk(const __grid_constant__ CUtensorMap map, int* out) {
  __shared__ __align__(8) uint64_t bars[4];
  unsigned char* box = aligned_shared();
  if (threadIdx.x != 0) return;
  int n = 0;
  const auto record = [&](uint64_t* bar, uint32_t parity) {
    out[n++] = tma::try_wait_parity(bar, parity) ? 1 : 0;
  };
  // Arrivals only: two arrivals complete phase 0.
  tma::init(&bars[0], 2);
  tma::fence_barrier_init();
  record(&bars[0], 0);            // 0: nothing arrived
  record(&bars[0], 1);            // 1: the preceding phase (parity 1) counts as complete
  tma::arrive(&bars[0]);
  record(&bars[0], 0);            // 0: one of two arrivals
  tma::arrive(&bars[0]);
  record(&bars[0], 0);            // 1: phase 0 completed
  record(&bars[0], 1);            // 0: phase 1 is the current one
  // Transactions only: the arrival count is met, 64 bytes are still expected.
  tma::init(&bars[1], 1);
  tma::expect_tx(&bars[1], 64);
  tma::arrive(&bars[1]);
  record(&bars[1], 0);            // 0: 64 bytes pending, no copy in flight
  tma::load_2d(box, &map, 0, 0, &bars[1]);
  record(&bars[1], 0);            // 1: the copy landed and completed them
  // Both, with the bytes completing before they are expected (tx goes negative).
  tma::init(&bars[2], 1);
  tma::load_2d(box, &map, 0, 0, &bars[2]);
  record(&bars[2], 0);            // 0: the copy lands (-64 bytes), one arrival pending
  tma::arrive_expect_tx(&bars[2], 64);
  record(&bars[2], 0);            // 1: both done
  // The parity flips with every phase.
  tma::init(&bars[3], 1);
  for (int phase = 0; phase < 3; ++phase) {
    tma::arrive(&bars[3]);
    record(&bars[3], phase & 1);        // 1
    record(&bars[3], (phase & 1) ^ 1);  // 0
  }
  tma::invalidate(&bars[3]);
  out[n] = -1;
}

int run_mbarrier_phases() {
  std::vector<uint16_t> tensor(32 * 4, 1);
  CUtensorMap map;
  const std::string error = tma::make_tensor_map_2d(&map, tma::TensorDtype::kUint16, tensor.data(),
                                                    32, 4, 64, 32, 1, 0);
  if (!error.empty()) {
    wrong(error);
    return 3;
  }
  std::vector<int> out(32, 7);
  if (!launched(launch_kernel_dynamic_shared(mbarrier_walk, dim3(1), dim3(32), 2048, nullptr, map,
                                             out.data()))) {
    return 4;
  }
  const int expected[] = {0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0, -1};
  for (size_t i = 0; i < sizeof expected / sizeof expected[0]; ++i) {
    if (out[i] != expected[i]) {
      wrong("try_wait.parity answer " + std::to_string(i) + " is " + std::to_string(out[i]) +
            ", expected " + std::to_string(expected[i]));
    }
  }
  return g_wrong ? 3 : 0;
}

// -- the host encoder's validation -----------------------------------------------------------------

int run_encode_validation() {
  std::vector<float> storage(64 * 64 + 4);
  auto* data = reinterpret_cast<unsigned char*>(storage.data());  // 16-byte aligned (malloc)
  CUtensorMap map;
  const cuuint64_t dims[] = {64, 64}, strides[] = {256};
  const cuuint32_t box[] = {32, 8}, ones[] = {1, 1};
  const auto encode = [&](CUtensorMap* m, void* global, const cuuint64_t* d, const cuuint64_t* s,
                          const cuuint32_t* b, const cuuint32_t* es, CUtensorMapSwizzle sw) {
    return cuTensorMapEncodeTiled(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, global, d, s, b, es,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                                  CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  const auto expect = [&](CUresult got, CUresult want, const char* what) {
    if (got != want) {
      wrong(std::string(what) + ": CUresult " + std::to_string(got) + ", expected " +
            std::to_string(want));
    }
  };
  expect(encode(&map, data, dims, strides, box, ones, CU_TENSOR_MAP_SWIZZLE_128B), CUDA_SUCCESS,
         "a valid map");
  expect(encode(&map, data + 8, dims, strides, box, ones, CU_TENSOR_MAP_SWIZZLE_128B),
         CUDA_ERROR_INVALID_VALUE, "a global address 8 bytes off");
  const cuuint64_t odd_stride[] = {260};
  expect(encode(&map, data, dims, odd_stride, box, ones, CU_TENSOR_MAP_SWIZZLE_NONE),
         CUDA_ERROR_INVALID_VALUE, "a stride not a multiple of 16");
  const cuuint32_t big_box[] = {32, 257};
  expect(encode(&map, data, dims, strides, big_box, ones, CU_TENSOR_MAP_SWIZZLE_NONE),
         CUDA_ERROR_INVALID_VALUE, "a box of 257 rows");
  const cuuint32_t wide_box[] = {64, 8};  // 256 bytes
  expect(encode(&map, data, dims, strides, wide_box, ones, CU_TENSOR_MAP_SWIZZLE_128B),
         CUDA_ERROR_INVALID_VALUE, "an inner box of 256 bytes under a 128-byte swizzle");
  expect(encode(&map, data, dims, strides, box, ones, CU_TENSOR_MAP_SWIZZLE_64B),
         CUDA_ERROR_INVALID_VALUE, "an inner box of 128 bytes under a 64-byte swizzle");
  const cuuint32_t ragged_box[] = {6, 8};  // 24 bytes
  expect(encode(&map, data, dims, strides, ragged_box, ones, CU_TENSOR_MAP_SWIZZLE_NONE),
         CUDA_ERROR_INVALID_VALUE, "an inner box of 24 bytes");
  const cuuint32_t bad_strides[] = {1, 9};
  expect(encode(&map, data, dims, strides, box, bad_strides, CU_TENSOR_MAP_SWIZZLE_NONE),
         CUDA_ERROR_INVALID_VALUE, "an element stride of 9");
  const cuuint64_t zero_dim[] = {64, 0};
  expect(encode(&map, data, zero_dim, strides, box, ones, CU_TENSOR_MAP_SWIZZLE_NONE),
         CUDA_ERROR_INVALID_VALUE, "a dimension of 0");
  expect(encode(reinterpret_cast<CUtensorMap*>(reinterpret_cast<unsigned char*>(&map) + 0) , data,
                dims, strides, box, ones, CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B),
         CUDA_ERROR_NOT_SUPPORTED, "a 128B_ATOM_32B swizzle (valid, not emulated)");
  const auto message = [&](const std::string& got, const char* part, const char* what) {
    if (got.find(part) == std::string::npos) {
      wrong(std::string(what) + ": make_tensor_map_2d said \"" + got + "\", expected \"" + part +
            "\" in it");
    }
  };
  using tma::TensorDtype;
  message(tma::make_tensor_map_2d(&map, TensorDtype::kFloat32, data + 4, 64, 64, 256, 32, 8, 128),
          "16-byte aligned", "a misaligned global address");
  message(tma::make_tensor_map_2d(&map, TensorDtype::kFloat32, data, 64, 64, 200, 32, 8, 128),
          "multiple of 16", "a stride of 200 bytes");
  message(tma::make_tensor_map_2d(&map, TensorDtype::kFloat32, data, 64, 64, 256, 32, 300, 0),
          "1 to 256", "a box of 300 rows");
  message(tma::make_tensor_map_2d(&map, TensorDtype::kBfloat16, data, 64, 64, 256, 128, 8, 128),
          "more than its 128-byte swizzle", "a 256-byte inner box");
  message(tma::make_tensor_map_2d(&map, TensorDtype::kFloat32, data, 64, 64, 256, 32, 8, 96),
          "0, 32, 64 or 128", "a swizzle of 96 bytes");
  message(tma::make_tensor_map_2d(&map, TensorDtype::kFloat16, data, 64, 64, 256, 12, 8, 0),
          "multiple of 16 bytes", "an inner box of 24 bytes");
  if (!tma::make_tensor_map_2d(&map, TensorDtype::kBfloat16, data, 64, 64, 256, 64, 8, 128).empty()) {
    wrong("a valid bf16 map gave an error");
  }
  return g_wrong ? 3 : 0;
}

// -- one swizzle for TMA and wgmma -------------------------------------------------------------

// A TMA load's swizzle and the one wgmma's descriptors read must be the same
// function: every byte offset of four repeats of each pattern.
int run_swizzle_agreement() {
  const std::pair<tma::Swizzle, jaxops::cuda::wgmma::Swizzle> pairs[] = {
      {tma::Swizzle::kNone, jaxops::cuda::wgmma::Swizzle::kNone},
      {tma::Swizzle::k32B, jaxops::cuda::wgmma::Swizzle::k32B},
      {tma::Swizzle::k64B, jaxops::cuda::wgmma::Swizzle::k64B},
      {tma::Swizzle::k128B, jaxops::cuda::wgmma::Swizzle::k128B},
  };
  for (const auto& [t, w] : pairs) {
    for (uint32_t offset = 0; offset < 4 * 1024; ++offset) {
      const uint32_t a = tma::swizzled_offset(t, offset);
      const uint32_t b = jaxops::cuda::wgmma::swizzled_offset(w, offset);
      if (a != b) {
        wrong("swizzle " + std::to_string(static_cast<int>(t)) + ", byte " + std::to_string(offset) +
              ": tma puts it at " + std::to_string(a) + ", wgmma reads it at " + std::to_string(b));
      }
    }
  }
  return g_wrong ? 3 : 0;
}

// -- the pipeline --------------------------------------------------------------------------------

int run_pipeline() {
  namespace pipeline = jaxops_tests::tma_pipeline;
  const int M = 200, N = 40, K = 200;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<float> a(static_cast<size_t>(M) * K), b(static_cast<size_t>(N) * K);
  for (float& v : a) v = uniform(rng);
  for (float& v : b) v = uniform(rng);
  std::vector<float> c(static_cast<size_t>(M) * N, std::nanf(""));
  CUtensorMap a_map, b_map, c_map;
  using tma::TensorDtype;
  for (const std::string& error :
       {tma::make_tensor_map_2d(&a_map, TensorDtype::kFloat32, a.data(), K, M, K * 4,
                                pipeline::kBlockK, pipeline::kBlockM, 128),
        tma::make_tensor_map_2d(&b_map, TensorDtype::kFloat32, b.data(), K, N, K * 4,
                                pipeline::kBlockK, pipeline::kBlockN, 128),
        tma::make_tensor_map_2d(&c_map, TensorDtype::kFloat32, c.data(), N, M, N * 4,
                                pipeline::kBlockN, 64, 0)}) {
    if (!error.empty()) {
      wrong(error);
      return 3;
    }
  }
  const dim3 grid((M + pipeline::kBlockM - 1) / pipeline::kBlockM,
                  (N + pipeline::kBlockN - 1) / pipeline::kBlockN);
  const int k_tiles = (K + pipeline::kBlockK - 1) / pipeline::kBlockK;
  const unsigned long long loads_before = jaxops_harness_tma_counts(0);
  if (!launched(launch_kernel_dynamic_shared(pipeline::row_block_product_kernel, grid,
                                             dim3(pipeline::kThreads), pipeline::kSharedBytes,
                                             nullptr, a_map, b_map, c_map, k_tiles))) {
    return 4;
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double sum = 0, scale = 0;
      for (int k = 0; k < K; ++k) {
        sum += double{a[i * K + k]} * b[j * K + k];
        scale += std::fabs(double{a[i * K + k]} * b[j * K + k]);
      }
      if (!(std::fabs(c[i * N + j] - sum) <= 1e-5 * (1.0 + scale))) {
        wrong("C[" + std::to_string(i) + "][" + std::to_string(j) + "] = " +
              std::to_string(c[i * N + j]) + ", expected " + std::to_string(sum));
      }
    }
  }
  const unsigned long long loads = jaxops_harness_tma_counts(0) - loads_before;
  if (loads != 2ull * k_tiles * grid.x * grid.y) {
    wrong(std::to_string(loads) + " TMA loads, expected " +
          std::to_string(2ull * k_tiles * grid.x * grid.y));
  }
  const int plan[] = {pipeline::kProducerRegisters, pipeline::kConsumerRegisters,
                      pipeline::kConsumerRegisters};
  for (int w = 0; w < 3; ++w) {
    if (jaxops_harness::setmaxnreg_plan(w) != plan[w]) {
      wrong("warpgroup " + std::to_string(w) + "'s setmaxnreg plan is " +
            std::to_string(jaxops_harness::setmaxnreg_plan(w)) + ", expected " +
            std::to_string(plan[w]));
    }
  }
  return g_wrong ? 3 : 0;
}

// -- hazards ----------------------------------------------------------------------------------------

// Thread 0 reads the destination of its own load before waiting on the barrier.
__global__ void read_before_complete(const __grid_constant__ CUtensorMap map, float* out) {
  unsigned char* box = aligned_shared();
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x != 0) return;
  tma::init(&bar, 1);
  tma::arrive_expect_tx(&bar, 32 * 4 * 4);
  tma::load_2d(box, &map, 0, 0, &bar);
  out[0] = tma::landed(reinterpret_cast<const float*>(box), 32)[0];
  tma::wait_parity(&bar, 0);
}

// The phase expects 16 bytes more than the load brings: the warp waits forever.
__global__ void expect_tx_mismatch(const __grid_constant__ CUtensorMap map) {
  unsigned char* box = aligned_shared();
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x == 0) tma::init(&bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::arrive_expect_tx(&bar, 32 * 4 * 4 + 16);
    tma::load_2d(box, &map, 0, 0, &bar);
  }
  tma::wait_parity(&bar, 0);
}

// Warps 0 and 1 sync on barrier 1 with 128 threads, warps 2 and 3 with 64.
__global__ void named_count_mismatch() {
  tma::named_sync(1, threadIdx.x < 64 ? 128 : 64);
}

// Lanes 0..15 of warps 0 and 1 make up barrier 2's 32 threads.
__global__ void named_partial_warp() {
  if (threadIdx.x % 32 < 16) tma::named_sync(2, 32);
}

// Warp 3 of the warpgroup leaves before its setmaxnreg.
__global__ void setmaxnreg_partial_warpgroup() {
  if (threadIdx.x >= 96) return;
  tma::setmaxnreg_dec<40>();
}

// Three warpgroups of 240 registers: 92160 of the SM's 65536.
__global__ void setmaxnreg_overcommit() { tma::setmaxnreg_inc<240>(); }

// A TMA store of generic-proxy writes without fence.proxy.async.
__global__ void store_without_fence(const __grid_constant__ CUtensorMap map) {
  float* box = reinterpret_cast<float*>(aligned_shared());
  box[threadIdx.x] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::store_2d(&map, box, 0, 0);
    tma::bulk_commit_group();
    tma::bulk_wait_group<0>();
  }
}

// A TMA store never waited for.
__global__ void store_not_waited(const __grid_constant__ CUtensorMap map) {
  float* box = reinterpret_cast<float*>(aligned_shared());
  box[threadIdx.x] = 1.0f;
  tma::fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::store_2d(&map, box, 0, 0);
    tma::bulk_commit_group();
  }
}

int run_hazard(const std::string& name) {
  // Not function-local statics: the harness build makes those shared memory.
  std::vector<float> tensor(32 * 4, 1.0f), out(1);
  CUtensorMap map;
  const std::string error = tma::make_tensor_map_2d(&map, tma::TensorDtype::kFloat32, tensor.data(),
                                                    32, 4, 128, 32, 4, 128);
  if (!error.empty()) {
    wrong(error);
    return 3;
  }
  cudaError_t status = cudaSuccess;
  const size_t shared = 4096;
  if (name == "read_before_complete") {
    status = launch_kernel_dynamic_shared(read_before_complete, dim3(1), dim3(32), shared, nullptr,
                                          map, out.data());
  } else if (name == "expect_tx_mismatch") {
    status = launch_kernel_dynamic_shared(expect_tx_mismatch, dim3(1), dim3(32), shared, nullptr, map);
  } else if (name == "named_count_mismatch") {
    status = launch_kernel(named_count_mismatch, dim3(1), dim3(128), nullptr);
  } else if (name == "named_partial_warp") {
    status = launch_kernel(named_partial_warp, dim3(1), dim3(64), nullptr);
  } else if (name == "setmaxnreg_partial_warpgroup") {
    status = launch_kernel(setmaxnreg_partial_warpgroup, dim3(1), dim3(128), nullptr);
  } else if (name == "setmaxnreg_overcommit") {
    status = launch_kernel(setmaxnreg_overcommit, dim3(1), dim3(384), nullptr);
  } else if (name == "store_without_fence") {
    status = launch_kernel_dynamic_shared(store_without_fence, dim3(1), dim3(128), shared, nullptr, map);
  } else if (name == "store_not_waited") {
    status = launch_kernel_dynamic_shared(store_not_waited, dim3(1), dim3(128), shared, nullptr, map);
  } else {
    std::fprintf(stderr, "unknown case %s\n", name.c_str());
    return 2;
  }
  return launched(status) ? 0 : 4;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string name = argv[1];
  if (name == "load") return run_load();
  if (name == "store") return run_store(false);
  if (name == "reduce_add") return run_store(true);
  if (name == "mbarrier_phases") return run_mbarrier_phases();
  if (name == "encode_validation") return run_encode_validation();
  if (name == "pipeline") return run_pipeline();
  if (name == "swizzle_agreement") return run_swizzle_agreement();
  return run_hazard(name);
}
