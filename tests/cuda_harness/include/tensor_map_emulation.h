// Test-only: the part of the CUDA driver API a TMA launcher uses
// (cuTensorMapEncodeTiled and the CUtensorMap it fills), emulated on the CPU,
// and the runtime's cudaGetDriverEntryPointByVersion that finds it, so that
// cuda/tensor_map.h runs unchanged under the harness. Included by this
// directory's <cuda.h>.
//
// The emulated encoder validates its arguments with the driver's documented
// rules (CUDA 13 cuda.h, cuTensorMapEncodeTiled) and returns
// CUDA_ERROR_INVALID_VALUE where the driver would: rank 1..5, a 16-byte
// aligned global address, dims in [1, 2^32], byte strides multiples of 16
// below 2^40, box dims in [1, 256] with an inner dimension spanning a multiple
// of 16 bytes and no more than the swizzle's span, element strides in [1, 8],
// the NaN out-of-bounds fill only for float types; a map object that is not
// 64-byte aligned too. Valid inputs it does not emulate (interleaved layouts,
// the packed 4/6-bit types, the 128B_ATOM swizzles, the NaN fill) give
// CUDA_ERROR_NOT_SUPPORTED. The parameters are stored in the 128-byte opaque
// map (TensorMapParams), which the TMA emulation (tma_emulation.h) reads.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_on_cpu.h"

using cuuint32_t = uint32_t;
using cuuint64_t = uint64_t;

enum CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

enum CUtensorMapDataType {
  CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0,
  CU_TENSOR_MAP_DATA_TYPE_UINT16,
  CU_TENSOR_MAP_DATA_TYPE_UINT32,
  CU_TENSOR_MAP_DATA_TYPE_INT32,
  CU_TENSOR_MAP_DATA_TYPE_UINT64,
  CU_TENSOR_MAP_DATA_TYPE_INT64,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
  CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ,
  CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
  CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ,
  CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B,
  CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B,
  CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B,
};
enum CUtensorMapInterleave {
  CU_TENSOR_MAP_INTERLEAVE_NONE = 0,
  CU_TENSOR_MAP_INTERLEAVE_16B,
  CU_TENSOR_MAP_INTERLEAVE_32B,
};
enum CUtensorMapSwizzle {
  CU_TENSOR_MAP_SWIZZLE_NONE = 0,
  CU_TENSOR_MAP_SWIZZLE_32B,
  CU_TENSOR_MAP_SWIZZLE_64B,
  CU_TENSOR_MAP_SWIZZLE_128B,
  CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B,
  CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B_FLIP_8B,
  CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B,
};
enum CUtensorMapL2promotion {
  CU_TENSOR_MAP_L2_PROMOTION_NONE = 0,
  CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
  CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
};
enum CUtensorMapFloatOOBfill {
  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0,
  CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
};

struct alignas(128) CUtensorMap {
  cuuint64_t opaque[16];
};

namespace jaxops_harness {

// What the emulated encoder stores in a CUtensorMap.
struct TensorMapParams {
  uint64_t magic;
  const unsigned char* global;
  uint64_t dims[5];
  uint64_t byte_strides[5];  // [0] is the element size: dimension 0 is dense
  uint32_t box[5];
  uint8_t element_strides[5];
  uint8_t rank;
  uint8_t data_type;  // CUtensorMapDataType
  uint8_t element_bytes;
  uint8_t swizzle;  // CUtensorMapSwizzle: NONE, 32B, 64B, 128B
};
static_assert(sizeof(TensorMapParams) <= sizeof(CUtensorMap), "the parameters fit the map");
constexpr uint64_t kTensorMapMagic = 0x6a61786f70734d41ull;  // "jaxopsMA"

// The parameters of a map the emulated encoder filled; null for anything else.
inline const TensorMapParams* tensor_map_params(const CUtensorMap* map) {
  const auto* p = reinterpret_cast<const TensorMapParams*>(map);
  return map != nullptr && p->magic == kTensorMapMagic ? p : nullptr;
}

inline int tensor_map_element_bytes(CUtensorMapDataType t) {
  switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
    default: return 0;  // the packed sub-byte types
  }
}

}  // namespace jaxops_harness

inline CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type,
                                       cuuint32_t rank, void* global, const cuuint64_t* dims,
                                       const cuuint64_t* strides, const cuuint32_t* box,
                                       const cuuint32_t* element_strides,
                                       CUtensorMapInterleave interleave,
                                       CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                       CUtensorMapFloatOOBfill oob_fill) {
  if (map == nullptr || reinterpret_cast<uintptr_t>(map) % 64 != 0 || rank < 1 || rank > 5 ||
      global == nullptr || reinterpret_cast<uintptr_t>(global) % 16 != 0 ||
      static_cast<unsigned>(interleave) > CU_TENSOR_MAP_INTERLEAVE_32B ||
      static_cast<unsigned>(swizzle) > CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B ||
      static_cast<unsigned>(l2) > CU_TENSOR_MAP_L2_PROMOTION_L2_256B ||
      static_cast<unsigned>(oob_fill) > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA ||
      static_cast<unsigned>(type) > CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE && rank < 3) return CUDA_ERROR_INVALID_VALUE;
  const int element = jaxops_harness::tensor_map_element_bytes(type);
  const bool float_type = type >= CU_TENSOR_MAP_DATA_TYPE_FLOAT16 &&
                          type <= CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
  if (oob_fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE && (!float_type || element == 0)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t{1} << 32)) return CUDA_ERROR_INVALID_VALUE;
    if (box[i] == 0 || box[i] > 256) return CUDA_ERROR_INVALID_VALUE;
    if (element_strides[i] == 0 || element_strides[i] > 8) return CUDA_ERROR_INVALID_VALUE;
    if (i + 1 < rank && (strides[i] % 16 != 0 || strides[i] >= (uint64_t{1} << 40))) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  if (element != 0 && interleave == CU_TENSOR_MAP_INTERLEAVE_NONE) {
    const uint64_t inner = uint64_t{box[0]} * element;
    if (inner % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
    const uint64_t span = swizzle == CU_TENSOR_MAP_SWIZZLE_NONE  ? ~uint64_t{0}
                          : swizzle == CU_TENSOR_MAP_SWIZZLE_32B ? 32
                          : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64
                                                                 : 128;
    if (inner > span) return CUDA_ERROR_INVALID_VALUE;
  }
  if (interleave == CU_TENSOR_MAP_INTERLEAVE_32B && swizzle != CU_TENSOR_MAP_SWIZZLE_32B) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (element == 0 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE ||
      swizzle > CU_TENSOR_MAP_SWIZZLE_128B || oob_fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  jaxops_harness::TensorMapParams p{};
  p.magic = jaxops_harness::kTensorMapMagic;
  p.global = static_cast<const unsigned char*>(global);
  p.rank = static_cast<uint8_t>(rank);
  p.data_type = static_cast<uint8_t>(type);
  p.element_bytes = static_cast<uint8_t>(element);
  p.swizzle = static_cast<uint8_t>(swizzle);
  for (cuuint32_t i = 0; i < rank; ++i) {
    p.dims[i] = dims[i];
    p.byte_strides[i] = i == 0 ? static_cast<uint64_t>(element) : strides[i - 1];
    p.box[i] = box[i];
    // Dimension 0 has no element stride without interleave (the driver ignores it).
    p.element_strides[i] = static_cast<uint8_t>(i == 0 ? 1 : element_strides[i]);
  }
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &p, sizeof p);
  return CUDA_SUCCESS;
}

// -- the runtime's driver entry points ------------------------------------------------

enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
enum cudaGetDriverEntryPointFlags {
  cudaEnableDefault = 0x0,
  cudaEnableLegacyStream = 0x1,
  cudaEnablePerThreadDefaultStream = 0x2,
};

// Finds the driver functions emulated here (cuTensorMapEncodeTiled, since 12.0).
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn,
                                                    unsigned int version, unsigned long long,
                                                    cudaDriverEntryPointQueryResult* status) {
  if (symbol == nullptr || fn == nullptr) return cudaErrorInvalidValue;
  *fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0) {
    if (version >= 12000) {
      *fn = reinterpret_cast<void*>(&cuTensorMapEncodeTiled);
      found = cudaDriverEntryPointSuccess;
    } else {
      found = cudaDriverEntryPointVersionNotSufficent;
    }
  }
  if (status != nullptr) *status = found;
  return cudaSuccess;
}
