// The inner loop of the 2:4 sparse row-lane GEMV (cpu/sparse.cc,
// row_lane_dots) for 8 lanes of x rows on AVX2 (the avx2 variant):
// one ymm FMA per kept value, its weight broadcast against the 8 rows of x at
// the value's input column (xt: 8 floats per column).
//
// What sets the pace is the issue width, not the FMA pipes: per kept value a
// broadcast (a load), the FMA (a load of x with an indexed address, two uops
// on Intel cores) and the index arithmetic. The generic loop spends 2-3 ALU
// operations per value on that arithmetic (shift, and, scale of each 2-bit
// position), ~6 uops per FMA in all. Here a 256-entry table turns a metadata
// byte (4 values, 8 input columns) into the 4 values' byte offsets in xt
// (position * 32, one per byte), and the group's start column goes into the
// address's displacement: one byte extraction (movzx, plus a shift per two
// values) per value, ~4.5 uops per FMA.
#pragma once

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define JAXOPS_SPARSE_ROW_LANES_AVX2 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace jaxops::cpu::sparse_avx2 {

// x rows per input column of xt (one ymm of float32).
inline constexpr int kRowLanes = 8;

// Bytes of xt per input column and per group of 4 columns.
inline constexpr int64_t kColumnBytes = kRowLanes * sizeof(float);
inline constexpr int64_t kGroupBytes = 4 * kColumnBytes;

// The byte offsets, in xt, of the 4 values of one metadata byte relative to
// their group's first column (position * 32, one per byte, value 0 in the
// low byte), for every metadata byte.
struct ColumnOffsetTable {
  uint32_t offsets[256];
  constexpr ColumnOffsetTable() : offsets() {
    for (unsigned b = 0; b < 256; ++b) {
      for (unsigned i = 0; i < 4; ++i) {
        offsets[b] |= ((b >> (2 * i)) & 3u) * kColumnBytes << (8 * i);
      }
    }
  }
};
inline constexpr ColumnOffsetTable kColumnOffsets;

// The two low bytes of offsets (the next group's two column offsets), which
// then shifts right by 16 bits. In assembly because GCC extracts each byte
// with a copy, a shift and a movzx from the unshifted register (3 uops);
// movzx from the low and the high byte register (%b, %h: "Q", a register with
// an addressable high byte) takes 1 each, plus one shift per group. A movzx
// from a high byte cannot take a REX prefix, so its destination is a legacy
// register ("R").
inline void next_group_offsets(uint64_t& offsets, uint64_t& first, uint64_t& second) {
  asm("movzbl %b2, %k0\n\t"
      "movzbl %h2, %k1\n\t"
      "shrq $16, %2"
      : "=&r"(first), "=&R"(second), "+Q"(offsets)
      :
      : "cc");
}

// acc += w * xt at the column `offset` bytes past group_start.
template <typename V>
inline void value_fma(float w, const char* group_start, uint64_t offset, V& acc) {
  __m256 a = acc;
  a = _mm256_fmadd_ps(_mm256_set1_ps(w),
                      _mm256_loadu_ps(reinterpret_cast<const float*>(group_start + offset)), a);
  acc = a;
}

// even[o] and odd[o] += the products of output o's kept values (v[o]; its
// metadata meta[o]) with the 8-lane columns of xt, for the first `bytes`
// metadata bytes rounded down to an even count; returns the bytes covered.
// Even values accumulate into even[o], odd ones into odd[o] (2 * O FMA
// chains).
template <int O, typename V>
inline int64_t row_lane_byte_pairs(const float* xt, const float* const* v,
                                   const uint8_t* const* meta, int64_t bytes, V* even, V* odd) {
  const int64_t pairs = bytes / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    // The 16 columns of the pair: 4 groups.
    const char* window = reinterpret_cast<const char*>(xt) + 4 * kGroupBytes * j;
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const float* w = v[o] + 8 * j;
      uint64_t offsets = 0;
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        if (g % 2 == 0) offsets = kColumnOffsets.offsets[meta[o][2 * j + g / 2]];
        const char* group = window + g * kGroupBytes;
        uint64_t first, second;
        next_group_offsets(offsets, first, second);
        value_fma(w[2 * g], group, first, even[o]);
        value_fma(w[2 * g + 1], group, second, odd[o]);
      }
    }
  }
  return 2 * pairs;
}

}  // namespace jaxops::cpu::sparse_avx2

#endif
