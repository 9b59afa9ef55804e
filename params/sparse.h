// The parameters of the 2:4 structured-sparse linear layer, one set for the CPU
// kernels (cpu/sparse.h), the CUDA kernels and the FFI handlers that fill them
// (xla_ffi/sparse_common.h).
//
// The packed weight W [out, in] (in a multiple of 4; every group of 4
// consecutive inputs holds at most 2 nonzeros):
//   values   [out, in / 2]          the 2 kept values of each group, in index order
//   metadata [out, ceil(in / 8)]    uint8; byte j holds the 2-bit in-group positions
//                                   of values 4j .. 4j + 3 (groups 2j and 2j + 1),
//                                   low bits first; the high nibble of the last byte
//                                   is unused when in / 4 is odd
// so value k of a row sits at input column 4 * (k / 2) + position(k). A
// position is 2 bits, so no metadata byte can name a column outside its group:
// traced metadata needs no clamping. Two equal positions in one group add
// their values (decompression is a scatter-add), in every kernel alike. So do
// pruned columns' zeros times a NaN or an infinity: every kernel gives the NaN
// that the dense product with the decompressed weight gives (0 * inf = NaN),
// though none multiplies by the pruned zeros.
#pragma once

#include <cstdint>

#include "params/host_device.h"

namespace jaxops::params {

struct SparseLinearShape {
  int64_t rows;  // product of x's leading axes
  int64_t in;    // input features (a multiple of 4)
  int64_t out;   // output features
};

inline constexpr int64_t kSparseGroup = 4;

JAXOPS_HOST_DEVICE int64_t sparse_values_cols(int64_t in) { return in / 2; }
JAXOPS_HOST_DEVICE int64_t sparse_metadata_cols(int64_t in) { return (in / kSparseGroup + 1) / 2; }

// The position in its group of value k of a packed row.
JAXOPS_HOST_DEVICE int sparse_position(const uint8_t* metadata_row, int64_t k) {
  return (metadata_row[k >> 2] >> (2 * (k & 3))) & 3;
}

// The input column of value k of a packed row.
JAXOPS_HOST_DEVICE int64_t sparse_column(const uint8_t* metadata_row, int64_t k) {
  return kSparseGroup * (k >> 1) + sparse_position(metadata_row, k);
}

// The in-group positions group `group` of a packed row keeps, as a 4-bit set
// (bit p: position p); the others are its pruned columns (three of them when
// both values name one position).
JAXOPS_HOST_DEVICE unsigned sparse_kept_positions(const uint8_t* metadata_row, int64_t group) {
  const unsigned nibble = (metadata_row[group >> 1] >> (4 * (group & 1))) & 0xfu;
  return (1u << (nibble & 3u)) | (1u << (nibble >> 2));
}

}  // namespace jaxops::params
