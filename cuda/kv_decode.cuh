// The CUDA decode kernels: attention of a few query rows per kv head (T new
// tokens x the G query heads of a GQA group) against a KV cache, bound by
// reading each key and value row once (FlashDecoding). Shared by
// jaxops.attention's decode path (cuda/attention_decode.cu, a dense
// [B, S, K, H] cache) and jaxops.paged_attention (cuda/paged_attention.cu,
// pages through block tables), which differ only in where key j's rows live:
// the kernel is templated on a *row source* that says so, as the CPU's decode
// core (cpu/kv_decode.h) is.
//
// Each family defines its own __global__ kernels around decode_block and
// decode_merge_row (so that a profile names the op) and launches them with
// launch_decode; paged attention also around mla_decode_block (below: a value
// head dim of its own, values in the key rows, heads up to 576), launched
// with launch_mla_decode.
//
// Work (params/decode_plan.h): a block of four warps owns one group
// (sequence, kv head), a tile of its T * G rows and one split of its keys;
// with several splits the partial states go to the workspace and
// decode_merge_kernel combines them by their log-sum-exp. Inside a block each
// warp walks its own keys (steps w, w + 4, ... of 32 / lanes_per_key keys)
// with its own online-softmax state, merged with the other warps' at the end:
// no block barrier in the loop.
//
// A warp step, with the next step's rows already in flight:
//   - key and value rows are copied into the warp's shared memory as they
//     are (16-byte cp.async; element loads when a row is not a whole number
//     of 16-byte units), lanes_per_key lanes per row, at most
//     kMaxUnitsPerLane units of each per lane: up to 8 KiB of K and V in
//     flight per warp, issued one step ahead;
//   - each lane takes the dot products of its units of a key row (converted
//     when read) with every row's float32 query (shared memory, broadcast), a
//     butterfly over the row's lanes completes them;
//   - masking (each row's key interval), scale, soft cap, then the online
//     softmax in log2 units (exp2f), a warp max per row; the probabilities go
//     to shared memory;
//   - O += P V with the lanes along the head dim (kOut elements each), every
//     probability a broadcast read.
// int8 rows are converted exactly (the exponent trick: no I2F) and scaled per
// row: the key scale multiplies the dot product, the value scale the value.
//
// Arithmetic is float32 at every precision (the allow_tf32 policy allows
// TF32 but decoding is bound by memory). NaN and infinities: a NaN or +inf
// logit makes its row NaN, as the reference; a key outside every row's
// interval is never read; a key inside some row's interval reaches the others
// with probability 0 (0 * NaN is NaN, as in the reference's product).
//
// The row source concept (a small struct passed by value to the kernel):
//
//   struct MyRows {
//     using Element = float | __half | __nv_bfloat16 | int8_t;
//     static constexpr bool kScaled;   // int8 rows with per-row scales
//     const Element* key;              // row i's elements at key + i * head_dim
//     const Element* value;            // at value + i * Hv (Hv: the value head dim)
//     const float* key_scales;         // [rows] when kScaled
//     const float* value_scales;
//     // Sequence b's query rows, valid lengths and position of query row 0.
//     __device__ SequenceMask sequence(int b) const;
//     // The row holding key j (< capacity) of kv head kh of sequence b.
//     __device__ int64_t row(int b, int kh, int j) const;
//   };
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <math_constants.h>

#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"
#include "params/decode_plan.h"

#ifdef JAXOPS_CUDA_HARNESS
#include "mma_emulation.h"  // the asynchronous copies' emulation
#endif

namespace jaxops::cuda::kv_decode {

using params::DecodePlan;

constexpr int kWarpSize = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
// Resident blocks per SM the decode kernels are compiled for (registers
// capped at 65536 / (3 * 128) = 170 per thread).
constexpr int kMinBlocksPerSm = 3;
constexpr unsigned kFullWarp = 0xffffffffu;
// 16-byte units of a key (and of a value) row a lane holds per step.
constexpr int kMaxUnitsPerLane = 8;
// A lane's share of a head vector in O += P V (head dims up to 256).
constexpr int kMaxOut = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// A grid's x extent (and so every index the kernels keep in 32 bits).
constexpr int64_t kMaxBlocks = int64_t{1} << 31;

// What a call computes, filled on the host.
struct DecodeShape {
  int batch = 0;         // B
  int q_len = 0;         // T
  int num_heads = 0;     // N
  int num_kv_heads = 0;  // K
  int head_dim = 0;      // H
  int capacity = 0;      // keys a sequence can hold (S, or pages x page size)
  float scale = 1.0f;    // logits = scale * q.k
  float soft_cap = 0.0f; // > 0: logits = cap * tanh(logits / cap)
  bool causal = false;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded
};

// Query row t < q_valid of a sequence sits at position offset + t; it attends
// keys j < kv_valid with j <= position (causal), j >= position - window_left
// and j <= position + window_right (where given). Rows t >= q_valid attend none.
struct SequenceMask {
  int64_t offset;
  int q_valid;
  int kv_valid;
};

// How one launch lays the work out (host-computed, constant for the grid).
struct DecodeLaunch {
  DecodeShape shape;
  int rows_per_tile, row_tiles, splits, keys_per_split;
  int lanes_per_key;   // a power of two: lanes reading one key row
  int units_per_lane;  // <= kMaxUnitsPerLane
  int units_per_row;
  int q_stride;        // floats per query row in shared memory (a multiple of 4)
  int row_stride;      // bytes per key or value row in shared memory (a multiple of 16)
  int rows_pad;        // rows_per_tile rounded up to 4
};

// The dynamic shared memory of a block: offsets in bytes. Each warp has two
// stages of key and value rows (and their scales) that cp.async fills, the
// step's probabilities and rescaling factors. The merge of the warps' states
// overlays the warps' buffers once the loop is done.
struct DecodeSharedLayout {
  size_t q, lo, hi, warps, warp_bytes, stage_bytes, keys, values, key_scales, value_scales, p,
      alpha, merge, bytes;
  __host__ __device__ explicit DecodeSharedLayout(const DecodeLaunch& L) {
    const auto align16 = [](size_t n) { return (n + 15) / 16 * 16; };
    const size_t step = static_cast<size_t>(kWarpSize / L.lanes_per_key);
    q = 0;
    lo = align16(q + sizeof(float) * L.rows_per_tile * L.q_stride);
    hi = lo + align16(sizeof(int) * L.rows_per_tile);
    warps = hi + align16(sizeof(int) * L.rows_per_tile);
    // Within a stage.
    keys = 0;
    values = keys + step * L.row_stride;
    key_scales = values + step * L.row_stride;
    value_scales = key_scales + align16(sizeof(float) * step);
    stage_bytes = value_scales + align16(sizeof(float) * step);
    // Within a warp's buffers, after its two stages.
    p = 2 * stage_bytes;
    alpha = p + align16(sizeof(float) * step * L.rows_pad);
    warp_bytes = alpha + align16(sizeof(float) * L.rows_pad);
    merge = warps;
    // Per warp and row: the output, max and sum; per row: the warps' weights,
    // the max and the sum.
    const size_t merge_bytes =
        sizeof(float) * L.rows_per_tile * (kWarps * (L.shape.head_dim + 2) + kWarps + 2);
    const size_t loop_bytes = kWarps * warp_bytes;
    bytes = warps + (loop_bytes > merge_bytes ? loop_bytes : merge_bytes);
  }
};

// The MLA kernel's launch (mla_decode_block, below): a value head dim Hv of
// its own (value rows of their own, or the first Hv features of the key
// rows), heads up to params::kCudaMlaDecodeMaxHeadDim. Its warps share each
// step's keys: a step is step_keys = kWarps * 32 / lanes_per_key keys, warp w
// scores keys [w * 32 / L, (w + 1) * 32 / L) of it for every row of the tile,
// and then takes O += P V for its part of the tile: column_groups warps along
// the value's columns (kMlaOut a lane, 128 a warp) times kWarps /
// column_groups along the rows (warp_rows each).
constexpr int kMlaOut = 4;
constexpr int kMlaWarpColumns = kMlaOut * kWarpSize;
constexpr int kMlaMaxRows = 16;  // params::kMlaDecodeMaxRowsPerTile
// 16-byte units (or elements) of a key row a lane scores per step, at most.
constexpr int kMlaMaxUnitsPerLane = 16;
// A step's keys: at most 32 (4 lanes a key at least), and stages of at most
// kMlaMaxStageBytes (rows of wide values of their own take fewer keys).
constexpr int kMlaMinLanesPerKey = 4;
constexpr int64_t kMlaMaxStageBytes = 40 * 1024;
// A merge lane's outputs: 16 x 32 lanes = params::kCudaMlaDecodeMaxValueHeadDim.
constexpr int kMlaMergeOut = 16;

struct MlaLaunch {
  DecodeShape shape;
  int value_head_dim;  // Hv (<= head_dim when the values are in the keys)
  int rows_per_tile, row_tiles, splits, keys_per_split;
  int lanes_per_key;   // L, a power of two: lanes scoring one key
  int step_keys;       // kWarps * kWarpSize / L
  int key_units;       // units of a key row (16 bytes, or elements)
  int value_units;     // 16-byte units of a value row, or its elements
  bool value_vectors;  // value rows copied as 16-byte units (else as elements)
  int q_stride;        // floats per query row in shared memory (lane-interleaved)
  int key_stride;      // bytes per key row in a stage (a multiple of 16)
  int value_stride;    // bytes per value row in a stage (0: values in the keys)
  int column_groups;   // 1, 2 or 4
  int warp_rows;       // rows of a warp's part of O
  int warp_rows_pow2;  // warp_rows rounded up to a power of two (<= 16)
  int warp_rows_pad;   // warp_rows_pow2, at least 4
  int rows_pad;        // rows_per_tile rounded up to 4
};

// The width of a launch's partial outputs (the merge's rows).
__host__ __device__ __forceinline__ int output_head_dim(const DecodeLaunch& L) {
  return L.shape.head_dim;
}
__host__ __device__ __forceinline__ int output_head_dim(const MlaLaunch& L) {
  return L.value_head_dim;
}

// The MLA kernel's dynamic shared memory: the float32 query rows, each row's
// key interval, the step's logits (every row of the tile, written by the
// warp that scored the key), two stages of key and value rows (and scales)
// that cp.async fills, and per warp the step's probabilities and rescaling
// factors of its rows.
struct MlaSharedLayout {
  size_t q, lo, hi, logits, stages, stage_bytes, keys, values, key_scales, value_scales, warps,
      warp_bytes, p, alpha, bytes;
  __host__ __device__ explicit MlaSharedLayout(const MlaLaunch& L) {
    const auto align16 = [](size_t n) { return (n + 15) / 16 * 16; };
    const size_t step = static_cast<size_t>(L.step_keys);
    q = 0;
    lo = align16(q + sizeof(float) * L.rows_per_tile * L.q_stride);
    hi = lo + align16(sizeof(int) * L.rows_per_tile);
    logits = hi + align16(sizeof(int) * L.rows_per_tile);
    stages = logits + align16(sizeof(float) * step * L.rows_pad);
    // Within a stage.
    keys = 0;
    values = keys + step * L.key_stride;
    key_scales = values + step * L.value_stride;
    value_scales = key_scales + align16(sizeof(float) * step);
    stage_bytes = value_scales + align16(sizeof(float) * step);
    warps = stages + 2 * stage_bytes;
    // Within a warp's buffers.
    p = 0;
    alpha = p + align16(sizeof(float) * step * L.warp_rows_pad);
    warp_bytes = alpha + align16(sizeof(float) * L.warp_rows_pad);
    bytes = warps + kWarps * warp_bytes;
  }
};

// -- asynchronous copies ------------------------------------------------------------

// Global to shared memory without registers (cp.async, sm_80+): `bytes` of 4,
// 8 or 16 (16: .cg, cached in L2 only, as a stream read once wants). The
// protocol below: a copy is waited for (copy_async_wait) and the warp
// synchronised before its data is read, and a buffer is refilled only after a
// __syncwarp that follows its last read. The CPU harness keeps the 16-byte
// copies (the key and value rows) asynchronous at the strictest legal timing
// (include/mma_emulation.h: the destination is poisoned at issue and written
// at the issuing lane's covering wait), so a missing wait or __syncwarp reads
// poison in the tests; the 4-byte scale copies it makes at once.
template <int kBytes>
__device__ __forceinline__ void copy_async(void* shared_dst, const void* global_src) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
#ifndef JAXOPS_CUDA_HARNESS
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(global_src),
                 "n"(kBytes)
                 : "memory");
  }
#else
  if constexpr (kBytes == 16) {
    jaxops_harness::cp_async_16(shared_dst, global_src, 16);
  } else {
    std::memcpy(shared_dst, global_src, kBytes);
  }
#endif
}

// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void copy_async_commit() {
#ifndef JAXOPS_CUDA_HARNESS
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  jaxops_harness::cp_async_commit();
#endif
}

// Waits until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#ifndef JAXOPS_CUDA_HARNESS
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#else
  jaxops_harness::cp_async_wait(kPending);
#endif
}

// -- conversions --------------------------------------------------------------------

// The elements of one 32-bit word as float32 (int8 without its row's scale).
template <typename Element>
struct Word;
template <>
struct Word<float> {
  static constexpr int kElements = 1;
  __device__ __forceinline__ static void unpack(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
};
template <>
struct Word<__nv_bfloat16> {
  static constexpr int kElements = 2;
  // A bfloat16 is the high half of the float32 with its bits.
  __device__ __forceinline__ static void unpack(uint32_t w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
};
template <>
struct Word<__half> {
  static constexpr int kElements = 2;
  __device__ __forceinline__ static void unpack(uint32_t w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
};
template <>
struct Word<int8_t> {
  static constexpr int kElements = 4;
  // Byte x + 128 in the mantissa of 2^23 is the float 2^23 + 128 + x, exactly:
  // one integer op and one add per element instead of a quarter-rate I2F.
  __device__ __forceinline__ static void unpack(uint32_t w, float* f) {
    const uint32_t biased = w ^ 0x80808080u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[k] = __uint_as_float(((biased >> (8 * k)) & 0xffu) | 0x4b000000u) - 8388736.0f;
    }
  }
};

__device__ __forceinline__ float element_to_float(float v) { return v; }
__device__ __forceinline__ float element_to_float(__half v) { return to_float(v); }
__device__ __forceinline__ float element_to_float(__nv_bfloat16 v) { return to_float(v); }
__device__ __forceinline__ float element_to_float(int8_t v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T zero_element() {
  return from_float<T>(0.0f);
}
template <>
__device__ __forceinline__ int8_t zero_element<int8_t>() {
  return 0;
}

// A unit of a row: 16 bytes (uint4) or one element.
template <typename Element, typename Unit>
struct Units {
  static constexpr int kElements = 1;
  __device__ __forceinline__ static void unpack(const Unit& u, float* f) {
    f[0] = element_to_float(u);
  }
  __device__ __forceinline__ static Unit zero() { return zero_element<Element>(); }
};
template <typename Element>
struct Units<Element, uint4> {
  static constexpr int kElements = 4 * Word<Element>::kElements;
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    constexpr int e = Word<Element>::kElements;
    Word<Element>::unpack(u.x, f);
    Word<Element>::unpack(u.y, f + e);
    Word<Element>::unpack(u.z, f + 2 * e);
    Word<Element>::unpack(u.w, f + 3 * e);
  }
  __device__ __forceinline__ static uint4 zero() { return make_uint4(0u, 0u, 0u, 0u); }
};

// Elements [h0, h0 + kOut) of a value row in shared memory as float32, zero
// past head_dim. A whole lane share is one aligned vector read (the row is
// 16-byte aligned and h0 a multiple of kOut).
template <typename Element, int kOut>
__device__ __forceinline__ void load_value_share(const unsigned char* row, int h0, int head_dim,
                                                 float (&f)[kOut]) {
  constexpr int kBytes = kOut * static_cast<int>(sizeof(Element));
  const unsigned char* at = row + static_cast<size_t>(h0) * sizeof(Element);
  if (h0 + kOut <= head_dim) {
    constexpr int e = Word<Element>::kElements;
    if constexpr (kBytes % 16 == 0) {
#pragma unroll
      for (int c = 0; c < kBytes / 16; ++c) {
        const uint4 u = reinterpret_cast<const uint4*>(at)[c];
        Units<Element, uint4>::unpack(u, f + c * 4 * e);
      }
    } else if constexpr (kBytes == 8) {
      const uint2 u = *reinterpret_cast<const uint2*>(at);
      Word<Element>::unpack(u.x, f);
      Word<Element>::unpack(u.y, f + e);
    } else {
      static_assert(kBytes == 4, "a lane's share is 4, 8 or a multiple of 16 bytes");
      Word<Element>::unpack(*reinterpret_cast<const uint32_t*>(at), f);
    }
    return;
  }
  const Element* elements = reinterpret_cast<const Element*>(at);
#pragma unroll
  for (int e = 0; e < kOut; ++e) {
    f[e] = h0 + e < head_dim ? element_to_float(elements[e]) : 0.0f;
  }
}

// -- masking ------------------------------------------------------------------------

// The keys [lo, hi) query row t attends ([0, 0) when none).
__device__ __forceinline__ void row_keys(const DecodeShape& d, const SequenceMask& m, int t,
                                         int* lo, int* hi) {
  *lo = *hi = 0;
  if (t >= m.q_valid) return;
  const int64_t position = m.offset + t;
  int64_t first = 0, end = m.kv_valid;
  if (d.window_left >= 0 && position - d.window_left > first) first = position - d.window_left;
  if (d.causal && position + 1 < end) end = position + 1;
  if (d.window_right >= 0 && position + d.window_right + 1 < end) {
    end = position + d.window_right + 1;
  }
  if (first >= end) return;
  *lo = static_cast<int>(first);
  *hi = static_cast<int>(end);
}

// The logit of a dot product in log2 units (scaled, soft-capped).
__device__ __forceinline__ float log2_logit(const DecodeShape& d, float dot) {
  const float x = dot * d.scale;
  return (d.soft_cap > 0.0f ? d.soft_cap * tanhf(x / d.soft_cap) : x) * kLog2e;
}

// A weight exp2(m - max) of a partial state with max `m` among states whose
// largest max is `max`: 1 at m == max (also when both are -inf), so that a
// state without keys adds nothing and one with NaN sums carries them.
__device__ __forceinline__ float state_weight(float m, float max) {
  return m == max ? 1.0f : exp2f(m - max);
}

// -- the kernels --------------------------------------------------------------------

// Where a decode block works, from blockIdx.x, as decode_block and
// mla_decode_block both enumerate their grid (Launch: DecodeLaunch or
// MlaLaunch): its key split, its (batch, kv head) group and its tile of query
// rows, rows of (t, g) pairs t-major over the group's G heads.
struct DecodeBlockCoordinates {
  int split, group, tile, b, kv_head, G, row0, rows;

  template <typename Launch>
  __device__ __forceinline__ explicit DecodeBlockCoordinates(const Launch& L) {
    const DecodeShape& d = L.shape;
    int block = static_cast<int>(blockIdx.x);
    split = block % L.splits;
    block /= L.splits;
    tile = block % L.row_tiles;
    group = block / L.row_tiles;
    b = group / d.num_kv_heads;
    kv_head = group % d.num_kv_heads;
    G = d.num_heads / d.num_kv_heads;
    row0 = tile * L.rows_per_tile;
    const int all_rows = d.q_len * G;
    rows = all_rows - row0 < L.rows_per_tile ? all_rows - row0 : L.rows_per_tile;
  }

  // The block's first row of the split-K partial states.
  template <typename Launch>
  __device__ __forceinline__ int64_t first_partial_row(const Launch& L) const {
    return ((static_cast<int64_t>(group) * L.row_tiles + tile) * L.splits + split) * L.rows_per_tile;
  }
};

// The keys [lo_s[r], hi_s[r]) each row of the block's tile attends, written
// to shared memory by the block's threads ([0, 0) past the tile's rows).
template <typename Launch>
__device__ __forceinline__ void store_row_keys(const Launch& L, const DecodeBlockCoordinates& at,
                                               const SequenceMask& mask, int* lo_s, int* hi_s) {
  for (int r = static_cast<int>(threadIdx.x); r < L.rows_per_tile; r += kThreads) {
    int lo = 0, hi = 0;
    if (r < at.rows) row_keys(L.shape, mask, (at.row0 + r) / at.G, &lo, &hi);
    lo_s[r] = lo;
    hi_s[r] = hi;
  }
}


// The body of a decode kernel (a family's __global__ wrapper calls it, so the
// kernel carries the op's name): one block of kThreads threads, whose group
// (b, kv head), row tile and key split come from blockIdx.x.
template <typename Rows, typename Q, typename Unit, int kOut, int kRows>
__device__ __forceinline__ void decode_block(const DecodeLaunch& L, const Rows& rows_of,
                                             const Q* query, Q* out, float* logsumexp,
                                             float* partial) {
  using Element = typename Rows::Element;
  using U = Units<Element, Unit>;
  constexpr int kUnitElements = U::kElements;
  const DecodeShape& d = L.shape;
  const DecodeBlockCoordinates at(L);
  const int split = at.split, b = at.b, kv_head = at.kv_head, G = at.G, row0 = at.row0;
  const int rows = at.rows, H = d.head_dim;
  const SequenceMask mask = rows_of.sequence(b);

  const DecodeSharedLayout layout(L);
  unsigned char* shared = dynamic_shared_memory<unsigned char>();
  float* q_s = reinterpret_cast<float*>(shared + layout.q);
  int* lo_s = reinterpret_cast<int*>(shared + layout.lo);
  int* hi_s = reinterpret_cast<int*>(shared + layout.hi);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  unsigned char* warp_buffers = shared + layout.warps + warp * layout.warp_bytes;
  float* p_s = reinterpret_cast<float*>(warp_buffers + layout.p);
  float* alpha_s = reinterpret_cast<float*>(warp_buffers + layout.alpha);

  // Query rows as float32, zero past head_dim (so a lane's units past the row
  // multiply zeros); row r is query row t = (row0 + r) / G of head
  // kv_head * G + (row0 + r) % G.
  for (int i = static_cast<int>(threadIdx.x); i < L.rows_per_tile * L.q_stride; i += kThreads) {
    const int r = i / L.q_stride, h = i % L.q_stride;
    float x = 0.0f;
    if (r < rows && h < H) {
      const int t = (row0 + r) / G, n = kv_head * G + (row0 + r) % G;
      x = to_float(query[((static_cast<int64_t>(b) * d.q_len + t) * d.num_heads + n) * H + h]);
    }
    q_s[i] = x;
  }
  store_row_keys(L, at, mask, lo_s, hi_s);
  const int keys_per_step = kWarpSize / L.lanes_per_key;
  for (int i = lane; i < keys_per_step * L.rows_pad; i += kWarpSize) p_s[i] = 0.0f;
  __syncthreads();

  // The keys of this split that some row attends: the rows' intervals are
  // monotone in t, so their union is one interval.
  int begin = d.capacity, end = 0;
  for (int r = 0; r < rows; ++r) {
    if (lo_s[r] < hi_s[r]) {
      begin = lo_s[r] < begin ? lo_s[r] : begin;
      end = hi_s[r] > end ? hi_s[r] : end;
    }
  }
  const int split_begin = split * L.keys_per_split;
  if (split_begin > begin) begin = split_begin;
  if (end - split_begin > L.keys_per_split) end = split_begin + L.keys_per_split;

  const int slot = lane / L.lanes_per_key, part = lane % L.lanes_per_key;
  const int step_keys = kWarps * keys_per_step;
  const int h0 = lane * kOut;
  float o[kRows][kOut];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kOut; ++e) o[r][e] = 0.0f;
  }
  // Row r's running max of the log2-unit logits (-inf: no key yet) and its sum
  // of exp2(x - max), held by lane r (a shuffle reads the max).
  float m = -CUDART_INF_F;
  float l = 0.0f;

  // A step's rows go to stage `stage` of the warp: this lane copies its units
  // of key slot `slot` (units part, part + lanes_per_key, ...), zeros for a
  // slot past the keys, so the step's products see zeros there.
  const auto issue_step = [&](int stage, int first) {
    unsigned char* buffers = warp_buffers + stage * layout.stage_bytes;
    unsigned char* k_dst = buffers + layout.keys + slot * L.row_stride;
    unsigned char* v_dst = buffers + layout.values + slot * L.row_stride;
    const int key = first + slot;
    const bool valid = key < end;
    const int64_t row = valid ? rows_of.row(b, kv_head, key) : 0;
    const Unit* k_row = reinterpret_cast<const Unit*>(rows_of.key + row * H);
    const Unit* v_row = reinterpret_cast<const Unit*>(rows_of.value + row * H);
#pragma unroll
    for (int i = 0; i < kMaxUnitsPerLane; ++i) {
      const int u = part + i * L.lanes_per_key;
      if (i < L.units_per_lane && u < L.units_per_row) {
        Unit* k_unit = reinterpret_cast<Unit*>(k_dst) + u;
        Unit* v_unit = reinterpret_cast<Unit*>(v_dst) + u;
        if (!valid) {
          *k_unit = U::zero();
          *v_unit = U::zero();
        } else if constexpr (sizeof(Unit) == 16) {
          copy_async<16>(k_unit, k_row + u);
          copy_async<16>(v_unit, v_row + u);
        } else {  // element rows: plain loads (odd head dims, not tuned)
          *k_unit = __ldg(k_row + u);
          *v_unit = __ldg(v_row + u);
        }
      }
    }
    if (part == 0) {
      float* k_scale = reinterpret_cast<float*>(buffers + layout.key_scales) + slot;
      float* v_scale = reinterpret_cast<float*>(buffers + layout.value_scales) + slot;
      if (!Rows::kScaled || !valid) {
        *k_scale = valid ? 1.0f : 0.0f;
        *v_scale = valid ? 1.0f : 0.0f;
      } else {
        copy_async<4>(k_scale, rows_of.key_scales + row);
        copy_async<4>(v_scale, rows_of.value_scales + row);
      }
    }
    copy_async_commit();
  };

  int first_key = begin + warp * keys_per_step;
  if (first_key < end) issue_step(0, first_key);
  for (int stage = 0; first_key < end; first_key += step_keys, stage ^= 1) {
    // The next step's rows travel while this one is computed (an empty group
    // past the last step keeps the wait below uniform).
    if (first_key + step_keys < end) {
      issue_step(stage ^ 1, first_key + step_keys);
    } else {
      copy_async_commit();
    }
    copy_async_wait<1>();
    __syncwarp();  // every lane's copies of this step have landed
    const unsigned char* buffers = warp_buffers + stage * layout.stage_bytes;
    const Unit* k_s = reinterpret_cast<const Unit*>(buffers + layout.keys + slot * L.row_stride);
    const unsigned char* v_s = buffers + layout.values;
    const float* k_scale_s = reinterpret_cast<const float*>(buffers + layout.key_scales);
    const float* v_scale_s = reinterpret_cast<const float*>(buffers + layout.value_scales);

    // Scores: this lane's units against every row, then across the key's lanes.
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.0f;
#pragma unroll 2
    for (int i = 0; i < kMaxUnitsPerLane; ++i) {
      const int u = part + i * L.lanes_per_key;
      if (i < L.units_per_lane && u < L.units_per_row) {
        float k[kUnitElements];
        U::unpack(k_s[u], k);
        const int at = u * kUnitElements;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < rows) {
            const float* q_row = q_s + r * L.q_stride + at;
            if constexpr (kUnitElements % 4 == 0) {
#pragma unroll
              for (int e = 0; e < kUnitElements; e += 4) {
                const float4 q4 = *reinterpret_cast<const float4*>(q_row + e);
                s[r] = fmaf(q4.x, k[e], s[r]);
                s[r] = fmaf(q4.y, k[e + 1], s[r]);
                s[r] = fmaf(q4.z, k[e + 2], s[r]);
                s[r] = fmaf(q4.w, k[e + 3], s[r]);
              }
            } else {
#pragma unroll
              for (int e = 0; e < kUnitElements; ++e) s[r] = fmaf(q_row[e], k[e], s[r]);
            }
          }
        }
      }
    }
    for (int offset = 1; offset < L.lanes_per_key; offset *= 2) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) s[r] += __shfl_xor_sync(kFullWarp, s[r], offset);
      }
    }
    const int key = first_key + slot;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool attends = r < rows && key >= lo_s[r] && key < hi_s[r] && key < end;
      s[r] = attends ? log2_logit(d, Rows::kScaled ? s[r] * k_scale_s[slot] : s[r])
                     : -CUDART_INF_F;
    }

    // Online softmax: the step's max per row over the warp (fmaxf skips NaN,
    // which then reaches the row through exp2f), the rescaling of the row.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < rows) {
        float step_max = s[r];
        for (int offset = L.lanes_per_key; offset < kWarpSize; offset *= 2) {
          step_max = fmaxf(step_max, __shfl_xor_sync(kFullWarp, step_max, offset));
        }
        const float m_old = __shfl_sync(kFullWarp, m, r);
        const float m_new = fmaxf(m_old, step_max);
        const float shift = m_new == -CUDART_INF_F ? 0.0f : m_new;
        const float alpha = exp2f(m_old - shift);
        if (lane == r) m = m_new;
#pragma unroll
        for (int e = 0; e < kOut; ++e) o[r][e] *= alpha;
        if (part == 0) p_s[slot * L.rows_pad + r] = exp2f(s[r] - shift);
        if (lane == 0) alpha_s[r] = alpha;
      }
    }
    __syncwarp();
    if (lane < rows) {
      float sum = 0.0f;
      for (int j = 0; j < keys_per_step; ++j) sum += p_s[j * L.rows_pad + lane];
      l = l * alpha_s[lane] + sum;
    }
    for (int j = 0; j < keys_per_step; ++j) {
      float v[kOut];
      load_value_share<Element, kOut>(v_s + j * L.row_stride, h0, H, v);
      if constexpr (Rows::kScaled) {
        const float scale = v_scale_s[j];
#pragma unroll
        for (int e = 0; e < kOut; ++e) v[e] *= scale;
      }
      const float* p_row = p_s + j * L.rows_pad;
#pragma unroll
      for (int r = 0; r < kRows; r += 4) {
        if (r < rows) {
          const float4 p4 = *reinterpret_cast<const float4*>(p_row + r);
          const float p[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
          for (int k = 0; k < 4 && r + k < kRows; ++k) {
#pragma unroll
            for (int e = 0; e < kOut; ++e) o[r + k][e] = fmaf(p[k], v[e], o[r + k][e]);
          }
        }
      }
    }
    __syncwarp();  // this step's buffers are read: the step after next refills them
  }
  copy_async_wait<0>();

  // The warps' states merged in a fixed order (the same bits every run).
  __syncthreads();
  float* merge_o = reinterpret_cast<float*>(shared + layout.merge);  // [warp][row][H]
  float* merge_m = merge_o + kWarps * L.rows_per_tile * H;           // [warp][row]
  float* merge_l = merge_m + kWarps * L.rows_per_tile;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) {
      float* o_row = merge_o + (warp * L.rows_per_tile + r) * H;
#pragma unroll
      for (int e = 0; e < kOut; ++e) {
        if (h0 + e < H) o_row[h0 + e] = o[r][e];
      }
    }
  }
  if (lane < rows) {
    merge_m[warp * L.rows_per_tile + lane] = m;
    merge_l[warp * L.rows_per_tile + lane] = l;
  }
  __syncthreads();

  // Per row: the largest of the warps' maxima, each warp's weight and the sum.
  float* merge_weight = merge_l + kWarps * L.rows_per_tile;  // [row][warp]
  float* merge_max = merge_weight + L.rows_per_tile * kWarps;  // [row]
  float* merge_sum = merge_max + L.rows_per_tile;              // [row]
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += kThreads) {
    float max = -CUDART_INF_F, sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) max = fmaxf(max, merge_m[w * L.rows_per_tile + r]);
    for (int w = 0; w < kWarps; ++w) {
      const float weight = state_weight(merge_m[w * L.rows_per_tile + r], max);
      merge_weight[r * kWarps + w] = weight;
      sum += weight * merge_l[w * L.rows_per_tile + r];
    }
    merge_max[r] = max;
    merge_sum[r] = sum;
  }
  __syncthreads();
  const int64_t partial_row0 = at.first_partial_row(L);
  const int64_t partial_rows =
      static_cast<int64_t>(d.batch) * d.num_kv_heads * L.row_tiles * L.splits * L.rows_per_tile;
  for (int i = static_cast<int>(threadIdx.x); i < rows * H; i += kThreads) {
    const int r = i / H, h = i % H;
    float acc = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      acc += merge_weight[r * kWarps + w] * merge_o[(w * L.rows_per_tile + r) * H + h];
    }
    if (L.splits > 1) {
      partial[(partial_row0 + r) * H + h] = acc;
    } else {
      const int t = (row0 + r) / G, n = kv_head * G + (row0 + r) % G;
      const float sum = merge_sum[r];
      out[((static_cast<int64_t>(b) * d.q_len + t) * d.num_heads + n) * H + h] =
          from_float<Q>(sum != 0.0f ? acc / sum : 0.0f);  // a NaN sum: a NaN row
    }
  }
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += kThreads) {
    const float max = merge_max[r], sum = merge_sum[r];
    if (L.splits > 1) {
      float* state = partial + partial_rows * H + 2 * (partial_row0 + r);
      state[0] = max;
      state[1] = sum;
    } else if (logsumexp != nullptr) {
      const int t = (row0 + r) / G, n = kv_head * G + (row0 + r) % G;
      logsumexp[(static_cast<int64_t>(b) * d.num_heads + n) * d.q_len + t] =
          sum != 0.0f ? (max + log2f(sum)) * kLn2 : -CUDART_INF_F;
    }
  }
}

// The body of the MLA decode kernel (a family's __global__ wrapper calls it):
// one block of kThreads threads, whose group (b, kv head), row tile and key
// split come from blockIdx.x, as decode_block's. kValuesInKeys: value row j is
// the first Hv elements of key row j, read from the key row's copy in shared
// memory (the row crosses the memory bus once for both products), its scale
// the key's; otherwise value rows of Hv elements of their own.
//
// A step of step_keys keys, its rows already in shared memory (cp.async, one
// step ahead):
//   A. each warp scores its keys (lanes_per_key lanes a key, each a share of
//      the key's units against every row's float32 query, a butterfly over the
//      key's lanes) and writes the masked, scaled, capped log2 logits of every
//      row; block barrier;
//   B. each warp updates the online softmax of its rows (its lanes take a
//      row's keys in turn, a shuffle max and sum), writes their probabilities
//      and rescaling factors to its buffers; warps owning the same rows compute
//      the same states (same logits, same order), so no merge across warps;
//   C. O += P V over the step's keys for the warp's rows and 128 columns, a
//      vector read of the value row and broadcast reads of the probabilities.
// Two block barriers a step: the first (after the stage's wait) also tells
// every thread that the other stage and the logits are free again.
template <typename Rows, typename Q, typename Unit, bool kValuesInKeys>
__device__ __forceinline__ void mla_decode_block(const MlaLaunch& L, const Rows& rows_of,
                                                 const Q* query, Q* out, float* logsumexp,
                                                 float* partial) {
  using Element = typename Rows::Element;
  using U = Units<Element, Unit>;
  constexpr int kUnitElements = U::kElements;
  const DecodeShape& d = L.shape;
  const DecodeBlockCoordinates at(L);
  const int split = at.split, b = at.b, kv_head = at.kv_head, G = at.G, row0 = at.row0;
  const int rows = at.rows, H = d.head_dim, Hv = L.value_head_dim;
  const SequenceMask mask = rows_of.sequence(b);

  const MlaSharedLayout layout(L);
  unsigned char* shared = dynamic_shared_memory<unsigned char>();
  float* q_s = reinterpret_cast<float*>(shared + layout.q);
  int* lo_s = reinterpret_cast<int*>(shared + layout.lo);
  int* hi_s = reinterpret_cast<int*>(shared + layout.hi);
  float* logits_s = reinterpret_cast<float*>(shared + layout.logits);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  unsigned char* warp_buffers = shared + layout.warps + warp * layout.warp_bytes;
  float* p_s = reinterpret_cast<float*>(warp_buffers + layout.p);
  float* alpha_s = reinterpret_cast<float*>(warp_buffers + layout.alpha);

  // Query rows as float32 (zero past head_dim). For 16-byte key units of
  // kUnitElements >= 4 elements they are lane-interleaved, so that the L lanes
  // of a key reading float4 c of their i-th units (unit i * L + part) read L
  // consecutive float4, free of bank conflicts, rather than L float4 a unit
  // apart: that float4 is float4 (i * kUnitElements / 4 + c) * L + part of the
  // row. Element units read consecutive floats in the row's own order.
  for (int i = static_cast<int>(threadIdx.x); i < L.rows_per_tile * L.q_stride; i += kThreads) {
    const int r = i / L.q_stride, at = i % L.q_stride;
    int h = at;
    if constexpr (kUnitElements >= 4) {
      const int within = at % 4;
      int t = at / 4;
      const int part = t % L.lanes_per_key;
      t /= L.lanes_per_key;
      const int c = t % (kUnitElements / 4), unit_step = t / (kUnitElements / 4);
      h = (unit_step * L.lanes_per_key + part) * kUnitElements + c * 4 + within;
    }
    float x = 0.0f;
    if (r < rows && h < H) {
      const int t = (row0 + r) / G, n = kv_head * G + (row0 + r) % G;
      x = to_float(query[((static_cast<int64_t>(b) * d.q_len + t) * d.num_heads + n) * H + h]);
    }
    q_s[i] = x;
  }
  store_row_keys(L, at, mask, lo_s, hi_s);
  __syncthreads();

  // The keys of this split that some row attends (one interval, as in
  // decode_block).
  int begin = d.capacity, end = 0;
  for (int r = 0; r < rows; ++r) {
    if (lo_s[r] < hi_s[r]) {
      begin = lo_s[r] < begin ? lo_s[r] : begin;
      end = hi_s[r] > end ? hi_s[r] : end;
    }
  }
  const int split_begin = split * L.keys_per_split;
  if (split_begin > begin) begin = split_begin;
  if (end - split_begin > L.keys_per_split) end = split_begin + L.keys_per_split;

  // This lane's key of a step (scored and copied by it) and its share.
  const int keys_per_warp = kWarpSize / L.lanes_per_key;
  const int slot = warp * keys_per_warp + lane / L.lanes_per_key;
  const int part = lane % L.lanes_per_key;
  // This warp's part of O: rows [warp_row0, warp_row0 + warp_rows) of the
  // tile, columns [column0, column0 + 128) (this lane: kMlaOut from h0).
  const int column_group = warp % L.column_groups;
  const int warp_row0 = warp / L.column_groups * L.warp_rows;
  const int warp_rows = rows - warp_row0 < L.warp_rows ? rows - warp_row0 : L.warp_rows;
  const int h0 = column_group * kMlaWarpColumns + lane * kMlaOut;
  const bool has_columns = column_group * kMlaWarpColumns < Hv;
  // The softmax state of row warp_row0 + state_row, in each of the lanes
  // state_row + k * warp_rows_pow2 (the same value in each).
  const int state_row = lane % L.warp_rows_pow2, state_part = lane / L.warp_rows_pow2;
  const int state_lanes = kWarpSize / L.warp_rows_pow2;
  float m = -CUDART_INF_F;
  float l = 0.0f;
  float o[kMlaMaxRows][kMlaOut];
#pragma unroll
  for (int r = 0; r < kMlaMaxRows; ++r) {
#pragma unroll
    for (int e = 0; e < kMlaOut; ++e) o[r][e] = 0.0f;
  }

  // A step's rows go to stage `stage`: this lane copies its units of key
  // `slot` (and of its value row), zeros for a slot past the keys.
  const auto issue_step = [&](int stage, int first) {
    unsigned char* buffers = shared + layout.stages + stage * layout.stage_bytes;
    const int key = first + slot;
    const bool valid = key < end;
    const int64_t row = valid ? rows_of.row(b, kv_head, key) : 0;
    Unit* k_dst = reinterpret_cast<Unit*>(buffers + layout.keys + slot * L.key_stride);
    const Unit* k_row = reinterpret_cast<const Unit*>(rows_of.key + row * H);
    for (int u = part; u < L.key_units; u += L.lanes_per_key) {
      if (!valid) {
        k_dst[u] = U::zero();
      } else if constexpr (sizeof(Unit) == 16) {
        copy_async<16>(k_dst + u, k_row + u);
      } else {  // element rows: plain loads (odd head dims, not tuned)
        k_dst[u] = __ldg(k_row + u);
      }
    }
    if constexpr (!kValuesInKeys) {
      unsigned char* v_dst = buffers + layout.values + slot * L.value_stride;
      const Element* v_row = rows_of.value + row * Hv;
      if (L.value_vectors) {
        for (int u = part; u < L.value_units; u += L.lanes_per_key) {
          uint4* v_unit = reinterpret_cast<uint4*>(v_dst) + u;
          if (valid) {
            copy_async<16>(v_unit, reinterpret_cast<const uint4*>(v_row) + u);
          } else {
            *v_unit = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      } else {
        Element* v_elements = reinterpret_cast<Element*>(v_dst);
        for (int h = part; h < L.value_units; h += L.lanes_per_key) {
          v_elements[h] = valid ? __ldg(v_row + h) : zero_element<Element>();
        }
      }
    }
    if (part == 0) {
      float* k_scale = reinterpret_cast<float*>(buffers + layout.key_scales) + slot;
      if (!Rows::kScaled || !valid) {
        *k_scale = valid ? 1.0f : 0.0f;
      } else {
        copy_async<4>(k_scale, rows_of.key_scales + row);
      }
      if constexpr (!kValuesInKeys) {
        float* v_scale = reinterpret_cast<float*>(buffers + layout.value_scales) + slot;
        if (!Rows::kScaled || !valid) {
          *v_scale = valid ? 1.0f : 0.0f;
        } else {
          copy_async<4>(v_scale, rows_of.value_scales + row);
        }
      }
    }
    copy_async_commit();
  };

  int first = begin;
  if (first < end) issue_step(0, first);
  for (int stage = 0; first < end; first += L.step_keys, stage ^= 1) {
    copy_async_wait<0>();
    __syncthreads();  // the stage has landed; every warp is past the last step
    if (first + L.step_keys < end) issue_step(stage ^ 1, first + L.step_keys);
    const unsigned char* buffers = shared + layout.stages + stage * layout.stage_bytes;
    const float* k_scale_s = reinterpret_cast<const float*>(buffers + layout.key_scales);
    const float* v_scale_s =
        reinterpret_cast<const float*>(buffers + (kValuesInKeys ? layout.key_scales
                                                                : layout.value_scales));

    // A. This lane's units of key `slot` against every row, then across the
    // key's lanes.
    {
      const Unit* k_s = reinterpret_cast<const Unit*>(buffers + layout.keys + slot * L.key_stride);
      float s[kMlaMaxRows];
#pragma unroll
      for (int r = 0; r < kMlaMaxRows; ++r) s[r] = 0.0f;
      // Float4 c of this lane's i-th unit is at q_lane + (i * kUnitElements / 4 + c) * 4 * L.
      const float* q_lane = q_s + (kUnitElements >= 4 ? part * 4 : 0);
      const int q_unit_step = kUnitElements >= 4 ? kUnitElements * L.lanes_per_key : 0;
#pragma unroll 2
      for (int u = part, i = 0; u < L.key_units; u += L.lanes_per_key, ++i) {
        float k[kUnitElements];
        U::unpack(k_s[u], k);
#pragma unroll
        for (int r = 0; r < kMlaMaxRows; ++r) {
          if (r < rows) {
            if constexpr (kUnitElements >= 4) {
              const float* q_unit = q_lane + r * L.q_stride + i * q_unit_step;
#pragma unroll
              for (int c = 0; c < kUnitElements / 4; ++c) {
                const float4 q4 =
                    *reinterpret_cast<const float4*>(q_unit + c * 4 * L.lanes_per_key);
                s[r] = fmaf(q4.x, k[4 * c], s[r]);
                s[r] = fmaf(q4.y, k[4 * c + 1], s[r]);
                s[r] = fmaf(q4.z, k[4 * c + 2], s[r]);
                s[r] = fmaf(q4.w, k[4 * c + 3], s[r]);
              }
            } else {
#pragma unroll
              for (int e = 0; e < kUnitElements; ++e) {
                s[r] = fmaf(q_s[r * L.q_stride + u * kUnitElements + e], k[e], s[r]);
              }
            }
          }
        }
      }
      for (int offset = 1; offset < L.lanes_per_key; offset *= 2) {
#pragma unroll
        for (int r = 0; r < kMlaMaxRows; ++r) {
          if (r < rows) s[r] += __shfl_xor_sync(kFullWarp, s[r], offset);
        }
      }
      const int key = first + slot;
      const float k_scale = k_scale_s[slot];
#pragma unroll
      for (int r = 0; r < kMlaMaxRows; ++r) {
        // The key's lanes share its rows' writes.
        if (r < rows && (r & (L.lanes_per_key - 1)) == part) {
          const bool attends = key >= lo_s[r] && key < hi_s[r] && key < end;
          logits_s[slot * L.rows_pad + r] =
              attends ? log2_logit(d, Rows::kScaled ? s[r] * k_scale : s[r]) : -CUDART_INF_F;
        }
      }
    }
    __syncthreads();  // every key's logits are written

    if (warp_rows > 0) {  // (uniform over the warp)
      // B. The online softmax of this warp's rows: the step's max (fmaxf skips
      // NaN, which reaches the row through exp2f), probabilities, sum.
      const bool own = state_row < warp_rows;
      const float* row_logits = logits_s + warp_row0 + state_row;
      float step_max = -CUDART_INF_F;
      for (int j = state_part; j < L.step_keys; j += state_lanes) {
        step_max = fmaxf(step_max, own ? row_logits[j * L.rows_pad] : -CUDART_INF_F);
      }
      for (int offset = L.warp_rows_pow2; offset < kWarpSize; offset *= 2) {
        step_max = fmaxf(step_max, __shfl_xor_sync(kFullWarp, step_max, offset));
      }
      const float m_new = fmaxf(m, step_max);
      const float shift = m_new == -CUDART_INF_F ? 0.0f : m_new;
      const float alpha = exp2f(m - shift);
      m = m_new;
      float sum = 0.0f;
      for (int j = state_part; j < L.step_keys; j += state_lanes) {
        const float p = own ? exp2f(row_logits[j * L.rows_pad] - shift) : 0.0f;
        p_s[j * L.warp_rows_pad + state_row] = p;
        sum += p;
      }
      for (int offset = L.warp_rows_pow2; offset < kWarpSize; offset *= 2) {
        sum += __shfl_xor_sync(kFullWarp, sum, offset);
      }
      l = l * alpha + sum;
      if (state_part == 0 && state_row < L.warp_rows_pad) alpha_s[state_row] = alpha;
      __syncwarp();

      // C. O += P V for this warp's rows and columns.
      if (has_columns) {
#pragma unroll
        for (int r = 0; r < kMlaMaxRows; r += 4) {
          if (r < warp_rows) {
            const float4 a4 = *reinterpret_cast<const float4*>(alpha_s + r);
            const float a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
            for (int k = 0; k < 4 && r + k < kMlaMaxRows; ++k) {
#pragma unroll
              for (int e = 0; e < kMlaOut; ++e) o[r + k][e] *= a[k];
            }
          }
        }
        const unsigned char* v_rows =
            buffers + (kValuesInKeys ? layout.keys : layout.values);
        const int v_stride = kValuesInKeys ? L.key_stride : L.value_stride;
        for (int j = 0; j < L.step_keys; ++j) {
          float v[kMlaOut];
          load_value_share<Element, kMlaOut>(v_rows + j * v_stride, h0, Hv, v);
          if constexpr (Rows::kScaled) {
            const float scale = v_scale_s[j];
#pragma unroll
            for (int e = 0; e < kMlaOut; ++e) v[e] *= scale;
          }
          const float* p_row = p_s + j * L.warp_rows_pad;
#pragma unroll
          for (int r = 0; r < kMlaMaxRows; r += 4) {
            if (r < warp_rows) {
              const float4 p4 = *reinterpret_cast<const float4*>(p_row + r);
              const float p[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
              for (int k = 0; k < 4 && r + k < kMlaMaxRows; ++k) {
#pragma unroll
                for (int e = 0; e < kMlaOut; ++e) o[r + k][e] = fmaf(p[k], v[e], o[r + k][e]);
              }
            }
          }
        }
      }
    }
  }

  // This warp's rows and columns: to the output, or to the split's partial
  // state; the first column group's warp writes the rows' states.
  if (warp_rows <= 0) return;
  const int64_t partial_row0 = at.first_partial_row(L);
  const int64_t partial_rows =
      static_cast<int64_t>(d.batch) * d.num_kv_heads * L.row_tiles * L.splits * L.rows_per_tile;
#pragma unroll
  for (int r = 0; r < kMlaMaxRows; ++r) {
    if (r < warp_rows) {
      const float sum = __shfl_sync(kFullWarp, l, r);
      const int tile_row = warp_row0 + r;
      const int t = (row0 + tile_row) / G, n = kv_head * G + (row0 + tile_row) % G;
#pragma unroll
      for (int e = 0; e < kMlaOut; ++e) {
        const int h = h0 + e;
        if (!has_columns || h >= Hv) continue;
        if (L.splits > 1) {
          partial[(partial_row0 + tile_row) * Hv + h] = o[r][e];
        } else {
          out[((static_cast<int64_t>(b) * d.q_len + t) * d.num_heads + n) * Hv + h] =
              from_float<Q>(sum != 0.0f ? o[r][e] / sum : 0.0f);  // a NaN sum: a NaN row
        }
      }
    }
  }
  if (column_group == 0 && state_part == 0 && state_row < warp_rows) {
    const int tile_row = warp_row0 + state_row;
    if (L.splits > 1) {
      float* state = partial + partial_rows * Hv + 2 * (partial_row0 + tile_row);
      state[0] = m;
      state[1] = l;
    } else if (logsumexp != nullptr) {
      const int t = (row0 + tile_row) / G, n = kv_head * G + (row0 + tile_row) % G;
      logsumexp[(static_cast<int64_t>(b) * d.num_heads + n) * d.q_len + t] =
          l != 0.0f ? (m + log2f(l)) * kLn2 : -CUDART_INF_F;
    }
  }
}

// The body of a merge kernel: combines the splits' partial states of one
// query row (a block of kThreads threads per row of every group): out =
// sum_s w_s o_s / sum_s w_s l_s with w_s = exp2(m_s - M), M the largest max.
// Warp w takes splits w, w + 4, ...; the four are combined in order, so the
// result does not depend on timing. A lane holds kOut of the row's outputs
// (kMaxOut: up to 256 for the decode kernel, kMlaMergeOut: 512 for the MLA
// kernel's; Launch is either kernel's launch, whose output_head_dim is the
// partial rows' width).
template <int kOut, typename Launch, typename Q>
__device__ __forceinline__ void decode_merge_row(const Launch& L, const float* partial, Q* out,
                                                 float* logsumexp) {
  const DecodeShape& d = L.shape;
  __shared__ float warp_max[kWarps];
  __shared__ float warp_sum[kWarps];
  __shared__ float warp_out[kWarps][kOut * kWarpSize];
  const int G = d.num_heads / d.num_kv_heads, H = output_head_dim(L);
  const int all_rows = d.q_len * G;
  const int group = static_cast<int>(blockIdx.x) / all_rows;
  const int row = static_cast<int>(blockIdx.x) % all_rows;
  const int b = group / d.num_kv_heads, kv_head = group % d.num_kv_heads;
  const int tile = row / L.rows_per_tile, r = row % L.rows_per_tile;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  // Split s's row is first + s * rows_per_tile.
  const int64_t first =
      (static_cast<int64_t>(group) * L.row_tiles + tile) * L.splits * L.rows_per_tile + r;
  const int64_t partial_rows =
      static_cast<int64_t>(d.batch) * d.num_kv_heads * L.row_tiles * L.splits * L.rows_per_tile;
  const float* state = partial + partial_rows * H;

  float max = -CUDART_INF_F;
  for (int s = warp; s < L.splits; s += kWarps) {
    max = fmaxf(max, state[2 * (first + static_cast<int64_t>(s) * L.rows_per_tile)]);
  }
  if (lane == 0) warp_max[warp] = max;
  __syncthreads();
  max = warp_max[0];
  for (int w = 1; w < kWarps; ++w) max = fmaxf(max, warp_max[w]);

  float acc[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) acc[i] = 0.0f;
  float sum = 0.0f;
  for (int s = warp; s < L.splits; s += kWarps) {
    const int64_t at = first + static_cast<int64_t>(s) * L.rows_per_tile;
    const float weight = state_weight(state[2 * at], max);
    sum += weight * state[2 * at + 1];
#pragma unroll
    for (int i = 0; i < kOut; ++i) {
      const int h = lane + i * kWarpSize;
      if (h < H) acc[i] += weight * partial[at * H + h];
    }
  }
#pragma unroll
  for (int i = 0; i < kOut; ++i) warp_out[warp][lane + i * kWarpSize] = acc[i];
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  if (warp != 0) return;
  sum = 0.0f;
  for (int w = 0; w < kWarps; ++w) sum += warp_sum[w];
  const int t = row / G, n = kv_head * G + row % G;
  Q* out_row = out + ((static_cast<int64_t>(b) * d.q_len + t) * d.num_heads + n) * H;
#pragma unroll
  for (int i = 0; i < kOut; ++i) {
    const int h = lane + i * kWarpSize;
    if (h < H) {
      float total = 0.0f;
      for (int w = 0; w < kWarps; ++w) total += warp_out[w][h];
      out_row[h] = from_float<Q>(sum != 0.0f ? total / sum : 0.0f);
    }
  }
  if (logsumexp != nullptr && lane == 0) {
    logsumexp[(static_cast<int64_t>(b) * d.num_heads + n) * d.q_len + t] =
        sum != 0.0f ? (max + log2f(sum)) * kLn2 : -CUDART_INF_F;
  }
}

// -- the launch ---------------------------------------------------------------------

// The lane layout of a row of `units` units: the fewest lanes per key (a power
// of two) that hold it in kMaxUnitsPerLane units each.
inline DecodeLaunch decode_launch(const DecodeShape& shape, const DecodePlan& plan,
                                  int64_t units, int64_t unit_bytes, int64_t unit_elements) {
  DecodeLaunch L;
  L.shape = shape;
  L.rows_per_tile = static_cast<int>(plan.rows_per_tile);
  L.row_tiles = static_cast<int>(plan.row_tiles);
  L.splits = static_cast<int>(plan.splits);
  L.keys_per_split = static_cast<int>(plan.keys_per_split);
  int lanes = 1;
  while (lanes < kWarpSize && (units + lanes - 1) / lanes > kMaxUnitsPerLane) lanes *= 2;
  L.lanes_per_key = lanes;
  L.units_per_lane = static_cast<int>((units + lanes - 1) / lanes);
  L.units_per_row = static_cast<int>(units);
  L.q_stride = static_cast<int>((L.units_per_lane * lanes * unit_elements + 3) / 4 * 4);
  // A 16-byte pad per row spreads the lanes' 16-byte accesses over the banks.
  L.row_stride = static_cast<int>((units * unit_bytes + 15) / 16 * 16 + 16);
  L.rows_pad = (L.rows_per_tile + 3) / 4 * 4;
  return L;
}

// A family's kernels: Kernels::decode<Rows, Q, Unit, kOut, kRows>() and
// Kernels::merge<Q>() are its __global__ wrappers of decode_block and
// decode_merge_row.
template <typename Kernels, typename Rows, typename Q, typename Unit, int kOut, int kRows>
cudaError_t launch_decode_kernels(cudaStream_t stream, const DecodeLaunch& L, const Rows& rows,
                                  const Q* query, Q* out, float* logsumexp, float* partial) {
  const int64_t groups = static_cast<int64_t>(L.shape.batch) * L.shape.num_kv_heads;
  const int64_t blocks = groups * L.row_tiles * L.splits;
  const size_t shared = DecodeSharedLayout(L).bytes;
  cudaError_t status = launch_kernel_dynamic_shared(
      Kernels::template decode<Rows, Q, Unit, kOut, kRows>(), dim3(static_cast<unsigned>(blocks)),
      dim3(kThreads), shared, stream, L, rows, query, out, logsumexp, partial);
  if (status != cudaSuccess || L.splits == 1) return status;
  const int64_t merged = groups * L.shape.q_len * (L.shape.num_heads / L.shape.num_kv_heads);
  return launch_kernel(Kernels::template merge<Q>(), dim3(static_cast<unsigned>(merged)),
                       dim3(kThreads), stream, L, static_cast<const float*>(partial), out,
                       logsumexp);
}

// Runs the decode of `shape` with `plan` (its splits need `workspace`, of
// params::decode_workspace_bytes bytes) on the family's kernels. Rows of
// 16-byte multiples whose pointers are 16-byte aligned take the vector loads,
// others element loads.
template <typename Kernels, typename Rows, typename Q>
cudaError_t launch_decode(cudaStream_t stream, const DecodeShape& shape, const DecodePlan& plan,
                          const Rows& rows, const Q* query, Q* out, float* logsumexp,
                          void* workspace) {
  using Element = typename Rows::Element;
  if (shape.head_dim > params::kCudaDecodeMaxHeadDim || shape.num_kv_heads <= 0 ||
      plan.rows_per_tile > params::decode_max_rows_per_tile(shape.head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t groups = static_cast<int64_t>(shape.batch) * shape.num_kv_heads;
  const int64_t blocks = groups * plan.row_tiles * plan.splits;
  if (blocks == 0) return cudaSuccess;
  if (plan.splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const int64_t merged = groups * shape.q_len * (shape.num_heads / shape.num_kv_heads);
  if (blocks >= kMaxBlocks || merged >= kMaxBlocks) return cudaErrorInvalidValue;
  float* partial = static_cast<float*>(workspace);
  const int64_t row_bytes = shape.head_dim * static_cast<int64_t>(sizeof(Element));
  const bool aligned = reinterpret_cast<uintptr_t>(rows.key) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(rows.value) % 16 == 0;
  const bool wide = shape.head_dim > 128;
  if (row_bytes % 16 == 0 && aligned) {
    const DecodeLaunch L = decode_launch(shape, plan, row_bytes / 16, 16, 16 / sizeof(Element));
    return wide ? launch_decode_kernels<Kernels, Rows, Q, uint4, 8, 8>(
                      stream, L, rows, query, out, logsumexp, partial)
                : launch_decode_kernels<Kernels, Rows, Q, uint4, 4, 16>(
                      stream, L, rows, query, out, logsumexp, partial);
  }
  const DecodeLaunch L = decode_launch(shape, plan, shape.head_dim, sizeof(Element), 1);
  return wide ? launch_decode_kernels<Kernels, Rows, Q, Element, 8, 8>(
                    stream, L, rows, query, out, logsumexp, partial)
              : launch_decode_kernels<Kernels, Rows, Q, Element, 4, 16>(
                    stream, L, rows, query, out, logsumexp, partial);
}

// The MLA kernel's layout for key rows of `key_units` units of
// `key_unit_bytes` bytes (16-byte units of key_unit_elements elements, or
// elements) and value rows of value_head_dim elements of `element_bytes`
// (copied as 16-byte units when value_vectors; none of their own when the
// values are in the keys): the fewest lanes a key (4 at least) that score it
// in kMlaMaxUnitsPerLane units each, more where a step's rows would pass
// kMlaMaxStageBytes.
inline MlaLaunch mla_launch(const DecodeShape& shape, int value_head_dim, const DecodePlan& plan,
                            int64_t key_units, int64_t key_unit_bytes, int64_t key_unit_elements,
                            bool values_in_keys, bool value_vectors, int64_t element_bytes) {
  const auto round_up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  MlaLaunch L;
  L.shape = shape;
  L.value_head_dim = value_head_dim;
  L.rows_per_tile = static_cast<int>(plan.rows_per_tile);
  L.row_tiles = static_cast<int>(plan.row_tiles);
  L.splits = static_cast<int>(plan.splits);
  L.keys_per_split = static_cast<int>(plan.keys_per_split);
  // A 16-byte pad per row spreads the rows' 16-byte accesses over the banks.
  L.key_units = static_cast<int>(key_units);
  L.key_stride = static_cast<int>(round_up(key_units * key_unit_bytes, 16) + 16);
  const int64_t value_bytes = value_head_dim * element_bytes;
  L.value_vectors = !values_in_keys && value_vectors;
  L.value_units = static_cast<int>(L.value_vectors ? value_bytes / 16 : value_head_dim);
  L.value_stride = values_in_keys ? 0 : static_cast<int>(round_up(value_bytes, 16) + 16);
  int lanes = kMlaMinLanesPerKey;
  while (lanes < kWarpSize && (key_units + lanes - 1) / lanes > kMlaMaxUnitsPerLane) lanes *= 2;
  const int64_t row_bytes = L.key_stride + L.value_stride;
  while (lanes < kWarpSize && int64_t{kWarps} * kWarpSize / lanes * row_bytes > kMlaMaxStageBytes) {
    lanes *= 2;
  }
  L.lanes_per_key = lanes;
  L.step_keys = kWarps * kWarpSize / lanes;
  const int64_t units_per_lane = (key_units + lanes - 1) / lanes;
  // Interleaved 16-byte units (kv_decode's mla_decode_block) fill whole
  // rounds of the L lanes; element units only need float4 rows.
  L.q_stride = static_cast<int>(key_unit_elements >= 4
                                    ? units_per_lane * lanes * key_unit_elements
                                    : round_up(units_per_lane * lanes * key_unit_elements, 4));
  const int64_t column_chunks = (value_head_dim + kMlaWarpColumns - 1) / kMlaWarpColumns;
  L.column_groups = column_chunks <= 1 ? 1 : (column_chunks <= 2 ? 2 : kWarps);
  L.warp_rows = static_cast<int>((plan.rows_per_tile * L.column_groups + kWarps - 1) / kWarps);
  int pow2 = 1;
  while (pow2 < L.warp_rows) pow2 *= 2;
  L.warp_rows_pow2 = pow2;
  L.warp_rows_pad = pow2 > 4 ? pow2 : 4;
  L.rows_pad = static_cast<int>(round_up(plan.rows_per_tile, 4));
  return L;
}

// A family's MLA kernels: Kernels::mla<Rows, Q, Unit, kValuesInKeys>() and
// Kernels::mla_merge<Q>() are its __global__ wrappers of mla_decode_block and
// decode_merge_row<kMlaMergeOut>.
template <typename Kernels, typename Rows, typename Q, typename Unit, bool kValuesInKeys>
cudaError_t launch_mla_kernels(cudaStream_t stream, const MlaLaunch& L, const Rows& rows,
                               const Q* query, Q* out, float* logsumexp, float* partial) {
  const int64_t groups = static_cast<int64_t>(L.shape.batch) * L.shape.num_kv_heads;
  const int64_t blocks = groups * L.row_tiles * L.splits;
  const size_t shared = MlaSharedLayout(L).bytes;
  cudaError_t status = launch_kernel_dynamic_shared(
      Kernels::template mla<Rows, Q, Unit, kValuesInKeys>(), dim3(static_cast<unsigned>(blocks)),
      dim3(kThreads), shared, stream, L, rows, query, out, logsumexp, partial);
  if (status != cudaSuccess || L.splits == 1) return status;
  const int64_t merged = groups * L.shape.q_len * (L.shape.num_heads / L.shape.num_kv_heads);
  return launch_kernel(Kernels::template mla_merge<Q>(), dim3(static_cast<unsigned>(merged)),
                       dim3(kThreads), stream, L, static_cast<const float*>(partial), out,
                       logsumexp);
}

// Runs the decode of `shape` with value rows of `value_head_dim` elements
// (the first value_head_dim of each key row when kValuesInKeys; rows.value is
// then not read) and `plan` (its splits need `workspace`, of
// params::decode_workspace_bytes(groups, value_head_dim, plan) bytes) on the
// family's MLA kernels. Key rows of 16-byte multiples whose pointer is
// 16-byte aligned take 16-byte units, others elements; value rows alike.
template <typename Kernels, typename Rows, typename Q, bool kValuesInKeys>
cudaError_t launch_mla_decode(cudaStream_t stream, const DecodeShape& shape, int value_head_dim,
                              const DecodePlan& plan, const Rows& rows, const Q* query, Q* out,
                              float* logsumexp, void* workspace) {
  using Element = typename Rows::Element;
  if (shape.head_dim > params::kCudaMlaDecodeMaxHeadDim || value_head_dim < 0 ||
      value_head_dim > params::kCudaMlaDecodeMaxValueHeadDim ||
      (kValuesInKeys && value_head_dim > shape.head_dim) || shape.num_kv_heads <= 0 ||
      plan.rows_per_tile > params::kMlaDecodeMaxRowsPerTile) {
    return cudaErrorInvalidValue;
  }
  const int64_t groups = static_cast<int64_t>(shape.batch) * shape.num_kv_heads;
  const int64_t blocks = groups * plan.row_tiles * plan.splits;
  if (blocks == 0) return cudaSuccess;
  if (plan.splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const int64_t merged = groups * shape.q_len * (shape.num_heads / shape.num_kv_heads);
  if (blocks >= kMaxBlocks || merged >= kMaxBlocks) return cudaErrorInvalidValue;
  float* partial = static_cast<float*>(workspace);
  constexpr int64_t kElementBytes = sizeof(Element);
  const int64_t key_bytes = shape.head_dim * kElementBytes;
  const bool key_vectors =
      key_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(rows.key) % 16 == 0;
  const bool value_vectors = !kValuesInKeys && (value_head_dim * kElementBytes) % 16 == 0 &&
                             reinterpret_cast<uintptr_t>(rows.value) % 16 == 0;
  if (key_vectors) {
    const MlaLaunch L = mla_launch(shape, value_head_dim, plan, key_bytes / 16, 16,
                                   16 / kElementBytes, kValuesInKeys, value_vectors,
                                   kElementBytes);
    return launch_mla_kernels<Kernels, Rows, Q, uint4, kValuesInKeys>(stream, L, rows, query,
                                                                      out, logsumexp, partial);
  }
  const MlaLaunch L = mla_launch(shape, value_head_dim, plan, shape.head_dim, kElementBytes, 1,
                                 kValuesInKeys, value_vectors, kElementBytes);
  return launch_mla_kernels<Kernels, Rows, Q, Element, kValuesInKeys>(stream, L, rows, query,
                                                                      out, logsumexp, partial);
}

}  // namespace jaxops::cuda::kv_decode
