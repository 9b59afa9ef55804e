// The load and product layer of the tensor-core attention kernels (sm_80+,
// FlashAttention-2): shared-memory tiles in a swizzled layout, their
// asynchronous loads from the [B, len, heads, H] tensors, and one warp's
// fragment loads and mma.sync products on them (instructions: cuda/mma.cuh).
// The tile loops (attention_forward.cu, attention_backward.cu,
// attention_jvp.cu) reach shared memory and the tensor cores only through
// this file, so that a Hopper path (wgmma fed by TMA) can replace this layer
// and keep the loops.
//
// A tile is kRows rows of kCols elements (the padded head dim), each row
// kCols * sizeof(T) bytes (a multiple of 128), in 16-byte chunks; chunk c of
// row r sits at position c ^ (r & 7) of its row. ldmatrix reads one chunk
// column of 8 consecutive rows, and a warp's tile load writes whole rows: with
// the XOR both touch 8 distinct 16-byte bank groups, free of bank conflicts
// (unswizzled, rows of 256 bytes would put all 8 in the same banks).
//
// Fragments (a warp's 16 x 8 accumulator tiles, A and B operands) follow the
// mma.sync layouts of cuda/mma.cuh. An accumulator array acc[j][i] covers
// columns 8j .. 8j + 7: element i of lane (g, t) is row g + 8 (i >> 1),
// column 8j + 2t + (i & 1).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/float_convert.cuh"
#include "cuda/mma.cuh"

namespace jaxops::cuda::attention_mma {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
// The dynamic shared memory a block may take on sm_80 (163 KiB; sm_90 has 227):
// every tile configuration fits it.
constexpr int kMaxSharedBytes = 163 * 1024;
// The kernels keep logits in log2 units, for exp2 on the special-function unit.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The tensor-core instruction of an element type: mma.sync m16n8k16 for
// bfloat16/float16 (k-steps of 16 elements), m16n8k8 with TF32 operands for
// float32 (k-steps of 8; the caller's precision policy allows TF32). A k-step
// spans 32 bytes of a row either way: two of its 16-byte chunks.
template <typename T>
struct Operand {
  static_assert(mma::kHalfType<T>, "bfloat16 or float16");
  static constexpr int kK = 16;
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    mma::mma_m16n8k16<T>(d, a, b);
  }
  template <int kN>
  __device__ __forceinline__ static void round(uint32_t (&)[kN]) {}
  // Two values as one register of two T (lo at the lower index).
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    uint32_t r;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      std::memcpy(&r, &v, sizeof r);
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      std::memcpy(&r, &v, sizeof r);
    }
    return r;
  }
};

template <>
struct Operand<float> {
  static constexpr int kK = 8;
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    mma::mma_m16n8k8_tf32(d, a, b);
  }
  // Operands are rounded to TF32 to nearest (unrounded, the tensor cores would
  // truncate them: a bias towards zero).
  template <int kN>
  __device__ __forceinline__ static void round(uint32_t (&r)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) r[i] = mma::tf32_bits(__uint_as_float(r[i]));
  }
};

template <typename T, int kCols>
struct SwizzledTile {
  static constexpr int kRowBytes = kCols * static_cast<int>(sizeof(T));
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr int kChunkElements = 16 / static_cast<int>(sizeof(T));
  static_assert(kChunks % 8 == 0, "rows of a multiple of 128 bytes (the swizzle's period)");

  unsigned char* base;

  __device__ __forceinline__ unsigned char* chunk(int row, int c) const {
    return base + row * kRowBytes + ((c ^ (row & 7)) << 4);
  }
  __device__ __forceinline__ const T& at(int row, int col) const {
    return reinterpret_cast<const T*>(chunk(row, col / kChunkElements))[col % kChunkElements];
  }
};

// The rows of one (batch, head) of a [B, len, heads, head_dim] tensor: row r
// at first + r * stride; rows outside [begin, end) are zeros in a tile, and so
// are the columns past head_dim.
template <typename T>
struct TileSource {
  const T* first;
  int64_t stride;
  int64_t begin;
  int64_t end;
  int head_dim;
  // cp.async applies: rows are whole 16-byte chunks, 16-byte aligned.
  bool vectors;
};

template <typename T>
__host__ __device__ inline bool vector_rows(const T* x, int64_t head_dim) {
  return head_dim * static_cast<int64_t>(sizeof(T)) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

// Rows row0 .. row0 + kRows - 1 of `src` into `tile`, by every thread of the
// block: cp.async copies (zero-filled where nothing is read) that land at the
// caller's cp_async_wait, or, where rows are not whole 16-byte chunks, plain
// loads stored at once.
template <int kThreads, int kRows, typename T, int kCols>
__device__ __forceinline__ void load_tile(const SwizzledTile<T, kCols>& tile,
                                          const TileSource<T>& src, int64_t row0) {
  using Tile = SwizzledTile<T, kCols>;
  constexpr int kE = Tile::kChunkElements;
  for (int i = threadIdx.x; i < kRows * Tile::kChunks; i += kThreads) {
    const int r = i / Tile::kChunks, c = i % Tile::kChunks, col = c * kE;
    const int64_t row = row0 + r;
    const bool row_read = row >= src.begin && row < src.end;
    unsigned char* dst = tile.chunk(r, c);
    if (src.vectors) {
      const bool read = row_read && col < src.head_dim;
      mma::cp_async_16(dst, read ? src.first + row * src.stride + col : src.first, read ? 16 : 0);
    } else {
      T values[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        values[e] = row_read && col + e < src.head_dim ? src.first[row * src.stride + col + e]
                                                       : from_float<T>(0.0f);
      }
      std::memcpy(dst, values, sizeof values);
    }
  }
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }

// The A operand of k-step ks for rows row0 .. row0 + 15 of a tile (ldmatrix.x4:
// rows 0-7 and 8-15 of the step's first chunk, then of its second).
template <typename T, int kCols>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const SwizzledTile<T, kCols>& tile,
                                       int row0, int ks) {
  const int lane = lane_id();
  mma::ldmatrix<4, false>(a, tile.chunk(row0 + (lane & 15), 2 * ks + (lane >> 4)));
  Operand<T>::template round<4>(a);
}

// The B operands of k-step ks for n-tiles n0 and n0 + 8 of B(k, n) =
// tile(n, k): keys for Q K^T (ldmatrix.x4: rows n0.., both chunks of the
// step, then rows n0 + 8..).
template <typename T, int kCols>
__device__ __forceinline__ void load_b(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                       const SwizzledTile<T, kCols>& tile, int n0, int ks) {
  const int lane = lane_id();
  uint32_t r[4];
  mma::ldmatrix<4, false>(r, tile.chunk(n0 + (lane & 7) + ((lane >> 4) << 3),
                                        2 * ks + ((lane >> 3) & 1)));
  Operand<T>::template round<4>(r);
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}

// The B operands of the k-step at rows k0.. for n-tiles n0 and n0 + 8 of
// B(k, n) = tile(k, n): values for P V. They pair with A operands from
// accumulators (a_from_accumulators), whose k order they follow: for
// 16-bit types the natural one (ldmatrix.x4.trans: rows k0 + 0-7 and 8-15 of
// column chunk n0 / 8, then of the next); for float32 (TF32 holds 32 bits,
// which ldmatrix cannot transpose) the k-step's 8 rows are taken in the order
// 0, 2, 4, 6 | 1, 3, 5, 7, so that k index t holds accumulator column 2t and
// k index t + 4 column 2t + 1, as the accumulator registers hold them: no
// shuffles, the product is the same sum.
template <typename T, int kCols>
__device__ __forceinline__ void load_b_trans(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                             const SwizzledTile<T, kCols>& tile, int k0, int n0) {
  const int lane = lane_id();
  if constexpr (std::is_same<T, float>::value) {
    const int g = lane >> 2, t = lane & 3;
    b0[0] = mma::tf32_bits(tile.at(k0 + 2 * t, n0 + g));
    b0[1] = mma::tf32_bits(tile.at(k0 + 2 * t + 1, n0 + g));
    b1[0] = mma::tf32_bits(tile.at(k0 + 2 * t, n0 + 8 + g));
    b1[1] = mma::tf32_bits(tile.at(k0 + 2 * t + 1, n0 + 8 + g));
  } else {
    uint32_t r[4];
    mma::ldmatrix<4, true>(r, tile.chunk(k0 + (lane & 15), n0 / 8 + (lane >> 4)));
    b0[0] = r[0];
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
  }
}

// The A operand of k-step kk from accumulator tiles (their columns as the k
// axis): 16-bit types take tiles 2kk and 2kk + 1 as they are (the m16n8k16 A
// layout is two accumulator tiles side by side), rounded to T; float32 takes
// tile kk in load_b_trans's k order, rounded to TF32.
template <typename T, int kTiles>
__device__ __forceinline__ void a_from_accumulators(uint32_t (&a)[4],
                                                    const float (&acc)[kTiles][4], int kk) {
  if constexpr (std::is_same<T, float>::value) {
    a[0] = mma::tf32_bits(acc[kk][0]);
    a[1] = mma::tf32_bits(acc[kk][2]);
    a[2] = mma::tf32_bits(acc[kk][1]);
    a[3] = mma::tf32_bits(acc[kk][3]);
  } else {
    a[0] = Operand<T>::pack(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = Operand<T>::pack(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = Operand<T>::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = Operand<T>::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

// acc[j] += A B_j (16 rows of A; n-tiles j of B(k, n) = b(n0 + 8j + n, k))
// over kSteps k-steps, A from registers: a[ks] is k-step ks (load_a).
template <typename T, int kSteps, int kNTiles, int kCols>
__device__ __forceinline__ void mma_abt(float (&acc)[kNTiles][4], const uint32_t (&a)[kSteps][4],
                                        const SwizzledTile<T, kCols>& b, int n0) {
  static_assert(kNTiles % 2 == 0, "n-tiles in pairs");
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t b0[2], b1[2];
      load_b(b0, b1, b, n0 + 8 * j, ks);
      Operand<T>::mma(acc[j], a[ks], b0);
      Operand<T>::mma(acc[j + 1], a[ks], b1);
    }
  }
}

// The same with A rows a_row0 .. a_row0 + 15 of a tile, loaded at each
// k-step; the k-steps are unrolled by two only, which bounds the registers
// that loads hoisted ahead of their products take (the other warps hide the
// latency).
template <typename T, int kSteps, int kNTiles, int kCols>
__device__ __forceinline__ void mma_abt(float (&acc)[kNTiles][4],
                                        const SwizzledTile<T, kCols>& a, int a_row0,
                                        const SwizzledTile<T, kCols>& b, int n0) {
  static_assert(kNTiles % 2 == 0, "n-tiles in pairs");
#pragma unroll 2
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t fa[4];
    load_a(fa, a, a_row0, ks);
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t b0[2], b1[2];
      load_b(b0, b1, b, n0 + 8 * j, ks);
      Operand<T>::mma(acc[j], fa, b0);
      Operand<T>::mma(acc[j + 1], fa, b1);
    }
  }
}

// acc[j] += P B_j with P the accumulator tiles p (16 rows x 8 kPTiles columns,
// the k axis) and B(k, n) = b(k0 + k, n0 + 8j + n).
template <typename T, int kPTiles, int kNTiles, int kCols>
__device__ __forceinline__ void mma_pb(float (&acc)[kNTiles][4], const float (&p)[kPTiles][4],
                                       const SwizzledTile<T, kCols>& b, int k0, int n0) {
  static_assert(kNTiles % 2 == 0, "n-tiles in pairs");
  constexpr int kK = Operand<T>::kK;
#pragma unroll
  for (int kk = 0; kk < kPTiles * 8 / kK; ++kk) {
    uint32_t a[4];
    a_from_accumulators<T>(a, p, kk);
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t b0[2], b1[2];
      load_b_trans(b0, b1, b, k0 + kk * kK, n0 + 8 * j);
      Operand<T>::mma(acc[j], a, b0);
      Operand<T>::mma(acc[j + 1], a, b1);
    }
  }
}

// 2^x on the special-function unit (ex2.approx.ftz.f32: one instruction,
// relative error below 2^-22; a result below 2^-126 flushes to zero, as such a
// softmax weight next to the row's largest, 1, vanishes in a float32 sum
// anyway). exp2f would add a denormal scaling around it. The harness computes
// exp2f.
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef JAXOPS_CUDA_HARNESS
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Reductions over the 4 lanes of a quad (the lanes that share accumulator rows).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullWarp, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFullWarp, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kFullWarp, v, 1);
  return v + __shfl_xor_sync(kFullWarp, v, 2);
}

// The max of `running` and the elements of half r of a warp's accumulator
// tiles (r = 0: row g, r = 1: row g + 8), over the quad that holds the row.
template <int kNTiles>
__device__ __forceinline__ float row_tile_max(const float (&acc)[kNTiles][4], int r,
                                              float running) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
    running = fmaxf(running, fmaxf(acc[j][2 * r], acc[j][2 * r + 1]));
  }
  return quad_max(running);
}

}  // namespace jaxops::cuda::attention_mma
