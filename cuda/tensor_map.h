// Host side of the tensor memory accelerator: the CUtensorMap a TMA load or
// store of cuda/tma.cuh names, encoded by the driver's cuTensorMapEncodeTiled.
// The driver function is looked up through the runtime
// (cudaGetDriverEntryPointByVersion), so the library does not link libcuda;
// under the CPU harness the same lookup finds its emulation
// (tests/cuda_harness/include/tensor_map_emulation.h).
//
// make_tensor_map_{2,3,4}d validate their arguments with the driver's rules
// first and return an error message (empty on success), never abort: a
// launcher turns the message into its ffi::Error.
#pragma once

#include <cstdint>
#include <string>

#include <cuda.h>
#include <cuda_runtime.h>

namespace jaxops::cuda::tma {

// The element types the attention kernels move.
enum class TensorDtype { kFloat16, kBfloat16, kFloat32, kUint8, kUint16, kUint32 };

inline uint32_t dtype_bytes(TensorDtype dtype) {
  switch (dtype) {
    case TensorDtype::kUint8: return 1;
    case TensorDtype::kFloat16:
    case TensorDtype::kBfloat16:
    case TensorDtype::kUint16: return 2;
    default: return 4;
  }
}

inline CUtensorMapDataType driver_dtype(TensorDtype dtype) {
  switch (dtype) {
    case TensorDtype::kFloat16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case TensorDtype::kBfloat16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case TensorDtype::kFloat32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case TensorDtype::kUint8: return CU_TENSOR_MAP_DATA_TYPE_UINT8;
    case TensorDtype::kUint16: return CU_TENSOR_MAP_DATA_TYPE_UINT16;
    default: return CU_TENSOR_MAP_DATA_TYPE_UINT32;
  }
}

// The shared-memory swizzle, by the bytes of its span (0: none).
inline bool driver_swizzle(uint32_t swizzle_bytes, CUtensorMapSwizzle* out) {
  switch (swizzle_bytes) {
    case 0: *out = CU_TENSOR_MAP_SWIZZLE_NONE; return true;
    case 32: *out = CU_TENSOR_MAP_SWIZZLE_32B; return true;
    case 64: *out = CU_TENSOR_MAP_SWIZZLE_64B; return true;
    case 128: *out = CU_TENSOR_MAP_SWIZZLE_128B; return true;
    default: return false;
  }
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver the runtime loaded (null when there
// is none). Looked up at every call, not cached in a function-local static: the
// lookup is a table search in the runtime, and the CPU harness treats such
// statics in kernel sources as __shared__ variables.
inline EncodeTiled encode_tiled_entry_point() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<EncodeTiled>(fn);
}

// A tensor of `rank` dimensions, innermost first: dims[i] elements,
// byte_strides[i] between consecutive indices of dimension i + 1 (rank - 1 of
// them; dimension 0 is dense), a box of box[i] elements copied per TMA
// instruction, in shared memory with a swizzle of `swizzle_bytes` (0, 32, 64,
// 128). Out-of-bounds elements of a box read as zero.
inline std::string make_tensor_map(CUtensorMap* map, TensorDtype dtype, int rank,
                                   const void* global, const uint64_t* dims,
                                   const uint64_t* byte_strides, const uint32_t* box,
                                   uint32_t swizzle_bytes) {
  const uint32_t element = dtype_bytes(dtype);
  CUtensorMapSwizzle swizzle;
  if (rank < 1 || rank > 5) return "a tensor map has 1 to 5 dimensions, not " + std::to_string(rank);
  if (!driver_swizzle(swizzle_bytes, &swizzle)) {
    return "TMA swizzle must be 0, 32, 64 or 128 bytes, not " + std::to_string(swizzle_bytes);
  }
  if (reinterpret_cast<uintptr_t>(global) % 16 != 0) {
    return "a TMA tensor's global address must be 16-byte aligned";
  }
  for (int i = 0; i < rank; ++i) {
    const std::string dim = "dimension " + std::to_string(i);
    if (dims[i] == 0 || dims[i] > (uint64_t{1} << 32)) {
      return "TMA " + dim + " has " + std::to_string(dims[i]) + " elements (1 to 2^32)";
    }
    if (box[i] == 0 || box[i] > 256) {
      return "TMA box " + dim + " has " + std::to_string(box[i]) + " elements (1 to 256)";
    }
    if (i + 1 < rank && (byte_strides[i] % 16 != 0 || byte_strides[i] >= (uint64_t{1} << 40))) {
      return "TMA byte stride of " + dim + " + 1 is " + std::to_string(byte_strides[i]) +
             " (a multiple of 16 below 2^40)";
    }
  }
  const uint32_t inner_bytes = box[0] * element;
  if (inner_bytes % 16 != 0) {
    return "a TMA box's inner dimension must span a multiple of 16 bytes, not " +
           std::to_string(inner_bytes);
  }
  if (swizzle_bytes != 0 && inner_bytes > swizzle_bytes) {
    return "a TMA box's inner dimension spans " + std::to_string(inner_bytes) +
           " bytes, more than its " + std::to_string(swizzle_bytes) + "-byte swizzle";
  }
  const EncodeTiled encode = encode_tiled_entry_point();
  if (encode == nullptr) return "the CUDA driver has no cuTensorMapEncodeTiled (driver older than 12.0)";
  cuuint64_t driver_dims[5], driver_strides[4];
  cuuint32_t driver_box[5], element_strides[5];
  for (int i = 0; i < rank; ++i) {
    driver_dims[i] = dims[i];
    driver_box[i] = box[i];
    element_strides[i] = 1;
    if (i + 1 < rank) driver_strides[i] = byte_strides[i];
  }
  const CUresult result = encode(
      map, driver_dtype(dtype), static_cast<cuuint32_t>(rank), const_cast<void*>(global),
      driver_dims, driver_strides, driver_box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(result));
  }
  return "";
}

inline std::string make_tensor_map_2d(CUtensorMap* map, TensorDtype dtype, const void* global,
                                      uint64_t dim0, uint64_t dim1, uint64_t stride1_bytes,
                                      uint32_t box0, uint32_t box1, uint32_t swizzle_bytes) {
  const uint64_t dims[] = {dim0, dim1}, strides[] = {stride1_bytes};
  const uint32_t box[] = {box0, box1};
  return make_tensor_map(map, dtype, 2, global, dims, strides, box, swizzle_bytes);
}

inline std::string make_tensor_map_3d(CUtensorMap* map, TensorDtype dtype, const void* global,
                                      const uint64_t (&dims)[3], const uint64_t (&byte_strides)[2],
                                      const uint32_t (&box)[3], uint32_t swizzle_bytes) {
  return make_tensor_map(map, dtype, 3, global, dims, byte_strides, box, swizzle_bytes);
}

inline std::string make_tensor_map_4d(CUtensorMap* map, TensorDtype dtype, const void* global,
                                      const uint64_t (&dims)[4], const uint64_t (&byte_strides)[3],
                                      const uint32_t (&box)[4], uint32_t swizzle_bytes) {
  return make_tensor_map(map, dtype, 4, global, dims, byte_strides, box, swizzle_bytes);
}

}  // namespace jaxops::cuda::tma
