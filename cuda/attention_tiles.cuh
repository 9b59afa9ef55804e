// Device code that the CUDA attention kernels share (attention.cu: forward and
// backward; attention_jvp.cu: forward mode): block-wide products between
// shared-memory tiles, the masking of one (batch, head), tile loads and the
// shared-memory carving. See attention.cu for the design.
//
// Tiles live in shared memory with head vectors padded to a multiple of 16
// (hp) and rows padded against bank conflicts. Every product is a block_gemm
// between shared-memory tiles: tensor cores through nvcuda::wmma on sm_80+
// for __half/__nv_bfloat16, and for float32 as TF32 where the call allows it
// (the float32 precision policy, docs/precision.md), with accumulators loaded
// from and stored to the f32 shared tiles, so nothing depends on the
// fragment's element-to-lane layout; a float32 SIMT loop otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>
#include <mma.h>

#include "cuda/attention.h"
#include "cuda/float_convert.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define JAXOPS_ATTENTION_TENSOR_CORES 1
#endif

namespace jaxops::cuda::attention_tiles {

constexpr int kThreads = 128;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr unsigned kFullWarp = 0xffffffffu;
// Tile sizes are the largest of 64x64, 32x32, 16x16 whose shared memory fits
// this (sm_80's per-block limit is 163 KiB, sm_90's 227 KiB).
constexpr size_t kSharedBudget = 160 * 1024;

// The neighbouring threads that share each of kRows rows of a block's tile
// (the online softmax's groups of lanes).
template <int kRows>
__host__ __device__ constexpr int row_threads() {
  static_assert(kThreads % kRows == 0 && kThreads / kRows <= kWarpSize, "rows share warps evenly");
  return kThreads / kRows;
}

// Reductions over aligned groups of kWidth neighbouring lanes.
template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullWarp, v, offset));
  }
  return v;
}

template <int kWidth>
__device__ __forceinline__ float group_sum(float v) {
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullWarp, v, offset);
  }
  return v;
}

// -- shared-memory layout --------------------------------------------------------------

// Hands out 128-byte aligned pieces of a block's shared memory; with a null
// base it only measures.
class SharedCarver {
 public:
  __host__ __device__ explicit SharedCarver(unsigned char* base) : base_(base) {}
  template <typename U>
  __host__ __device__ U* take(int64_t count) {
    U* piece = reinterpret_cast<U*>(base_ + used_);
    used_ += (static_cast<size_t>(count) * sizeof(U) + 127) / 128 * 128;
    return piece;
  }
  __host__ __device__ size_t used() const { return used_; }

 private:
  unsigned char* base_;
  size_t used_ = 0;
};

// Leading dimensions: element tiles [rows][hp + 8], float tiles [rows][cols + 4]
// (multiples of 8 and 4 as wmma requires, off the 32-bank period).
struct Strides {
  int hp;    // query/key head dim padded to 16
  int hvp;   // value head dim padded to 16
  int ld_t;  // T tiles over the query/key head dim
  int ld_o;  // f32 accumulators over the query/key head dim
  int ld_tv;  // T tiles over the value head dim
  int ld_ov;  // f32 accumulators over the value head dim
  int ld_s;  // f32 scores [kBr][kBc]
  int ld_p;  // T probabilities [kBr][kBc]
  __host__ __device__ Strides(int hp_, int hvp_, int bc)
      : hp(hp_), hvp(hvp_), ld_t(hp_ + 8), ld_o(hp_ + 4), ld_tv(hvp_ + 8), ld_ov(hvp_ + 4),
        ld_s(bc + 4), ld_p(bc + 8) {}
};


// -- block-wide products between shared-memory tiles -----------------------------------

template <typename TA, typename TB>
constexpr bool kHalfOperands =
    std::is_same<TA, TB>::value &&
    (std::is_same<TA, __half>::value || std::is_same<TA, __nv_bfloat16>::value);

template <typename TA, typename TB>
constexpr bool kFloatOperands = std::is_same<TA, float>::value && std::is_same<TB, float>::value;

#ifdef JAXOPS_ATTENTION_TENSOR_CORES
// The wmma shape of each operand type: 16-bit operands as they are
// (m16n16k16); float32 ones as TF32 (m16n16k8), each fragment element rounded
// to nearest with __float_to_tf32 after the load, as the wmma documentation
// requires of tf32 fragments (unrounded, the low mantissa bits would be
// dropped: a truncation, biased towards zero).
template <typename T>
struct TensorCoreOperand {
  using type = T;
  static constexpr int kK = 16;
  template <typename Fragment>
  __device__ __forceinline__ static void round(Fragment&) {}
};
template <>
struct TensorCoreOperand<float> {
  using type = nvcuda::wmma::precision::tf32;
  static constexpr int kK = 8;
  template <typename Fragment>
  __device__ __forceinline__ static void round(Fragment& f) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = nvcuda::wmma::__float_to_tf32(f.x[i]);
  }
};

// block_gemm on the tensor cores: each warp owns 16x16 tiles of c.
template <bool kTransA, bool kTransB, bool kAccumulate, typename T>
__device__ __forceinline__ void tensor_core_block_gemm(float* c, int ldc, const T* a, int lda,
                                                       const T* b, int ldb, int M, int N, int K) {
  namespace wmma = nvcuda::wmma;
  using Operand = TensorCoreOperand<T>;
  using Element = typename Operand::type;
  constexpr int kK = Operand::kK;
  using LayoutA = std::conditional_t<kTransA, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int tiles_n = N / 16;
  for (int tile = warp; tile < M / 16 * tiles_n; tile += kWarps) {
    const int m0 = tile / tiles_n * 16, n0 = tile % tiles_n * 16;
    wmma::fragment<wmma::accumulator, 16, 16, kK, float> acc;
    if (kAccumulate) {
      wmma::load_matrix_sync(acc, c + m0 * ldc + n0, ldc, wmma::mem_row_major);
    } else {
      wmma::fill_fragment(acc, 0.0f);
    }
    for (int k0 = 0; k0 < K; k0 += kK) {
      wmma::fragment<wmma::matrix_a, 16, 16, kK, Element, LayoutA> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, kK, Element, LayoutB> fb;
      wmma::load_matrix_sync(fa, kTransA ? a + k0 * lda + m0 : a + m0 * lda + k0, lda);
      wmma::load_matrix_sync(fb, kTransB ? b + n0 * ldb + k0 : b + k0 * ldb + n0, ldb);
      Operand::round(fa);
      Operand::round(fb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + m0 * ldc + n0, acc, ldc, wmma::mem_row_major);
  }
}
#endif

// block_gemm on the CUDA cores, in float32: each thread owns a 2x2 block of c
// (M and N are even).
template <bool kTransA, bool kTransB, bool kAccumulate, typename TA, typename TB>
__device__ __forceinline__ void simt_block_gemm(float* c, int ldc, const TA* a, int lda,
                                                const TB* b, int ldb, int M, int N, int K) {
  const int blocks_n = N / 2;
  for (int i = threadIdx.x; i < M / 2 * blocks_n; i += kThreads) {
    const int m = i / blocks_n * 2, n = i % blocks_n * 2;
    float c00 = 0.0f, c01 = 0.0f, c10 = 0.0f, c11 = 0.0f;
    if (kAccumulate) {
      c00 = c[m * ldc + n];
      c01 = c[m * ldc + n + 1];
      c10 = c[(m + 1) * ldc + n];
      c11 = c[(m + 1) * ldc + n + 1];
    }
    for (int k = 0; k < K; ++k) {
      const float a0 = to_float(kTransA ? a[k * lda + m] : a[m * lda + k]);
      const float a1 = to_float(kTransA ? a[k * lda + m + 1] : a[(m + 1) * lda + k]);
      const float b0 = to_float(kTransB ? b[n * ldb + k] : b[k * ldb + n]);
      const float b1 = to_float(kTransB ? b[(n + 1) * ldb + k] : b[k * ldb + n + 1]);
      c00 = fmaf(a0, b0, c00);
      c01 = fmaf(a0, b1, c01);
      c10 = fmaf(a1, b0, c10);
      c11 = fmaf(a1, b1, c11);
    }
    c[m * ldc + n] = c00;
    c[m * ldc + n + 1] = c01;
    c[(m + 1) * ldc + n] = c10;
    c[(m + 1) * ldc + n + 1] = c11;
  }
}

// c[m][n] = (kAccumulate ? c[m][n] : 0) + sum_k A(m, k) B(k, n) for m < M, n < N,
// k < K (multiples of 16), with A(m, k) = kTransA ? a[k][m] : a[m][k] and
// B(k, n) = kTransB ? b[n][k] : b[k][n]. Every thread of the block calls it;
// the caller synchronises before reading c or overwriting a, b. allow_tf32
// (uniform over the block) lets float32 operands take the TF32 tensor cores;
// it does not concern 16-bit operands, which always do on sm_80+.
template <bool kTransA, bool kTransB, bool kAccumulate, typename TA, typename TB>
__device__ __forceinline__ void block_gemm(float* c, int ldc, const TA* a, int lda, const TB* b,
                                           int ldb, int M, int N, int K, bool allow_tf32) {
#ifdef JAXOPS_ATTENTION_TENSOR_CORES
  if constexpr (kHalfOperands<TA, TB>) {
    tensor_core_block_gemm<kTransA, kTransB, kAccumulate>(c, ldc, a, lda, b, ldb, M, N, K);
  } else if constexpr (kFloatOperands<TA, TB>) {
    if (allow_tf32) {
      tensor_core_block_gemm<kTransA, kTransB, kAccumulate>(c, ldc, a, lda, b, ldb, M, N, K);
    } else {
      simt_block_gemm<kTransA, kTransB, kAccumulate>(c, ldc, a, lda, b, ldb, M, N, K);
    }
  } else
#endif
  {
    simt_block_gemm<kTransA, kTransB, kAccumulate>(c, ldc, a, lda, b, ldb, M, N, K);
  }
}

// -- masking ---------------------------------------------------------------------------

// params::value_head_dim, on the device too: the head dim of value, out and
// their gradients.
__host__ __device__ inline int64_t value_head_dim(const AttentionParams& p) {
  return p.value_head_dim >= 0 ? p.value_head_dim : p.head_dim;
}

// What a block needs to mask the rows of one (batch, query head).
struct HeadView {
  int64_t b;
  int64_t n;
  int64_t offset;    // absolute position of query row 0
  int64_t q_valid;   // rows t >= q_valid attend nothing
  int64_t kv_valid;  // keys j >= kv_valid are masked
};

__device__ __forceinline__ int64_t clamp_length(const int32_t* lengths, int64_t b, int64_t full) {
  if (lengths == nullptr) return full;
  const int64_t n = lengths[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

__device__ __forceinline__ HeadView head_view(const AttentionParams& p, int64_t b, int64_t n) {
  return {b, n, static_cast<int64_t>(*p.query_offset), clamp_length(p.q_seq_lengths, b, p.q_len),
          clamp_length(p.kv_seq_lengths, b, p.kv_len)};
}

// The element of query row t and key j in an operand broadcast to [B, N, T, S]
// through `strides` (the mask, the bias and the bias-shaped tangents).
__device__ __forceinline__ int64_t broadcast_offset(const int64_t strides[4], const HeadView& h,
                                                    int64_t t, int64_t j) {
  return h.b * strides[0] + h.n * strides[1] + t * strides[2] + j * strides[3];
}

// -- soft cap and segment ids ---------------------------------------------------------

constexpr float kLog2e = 1.4426950408889634f;

// The soft cap of a call in the units of the logits it applies to (natural or
// log2): c = logits_soft_cap * units, 0 for none, and k = -2 log2(e) / c.
struct SoftCap {
  float c;
  float k;
  __host__ __device__ bool on() const { return c > 0.0f; }
};

__host__ __device__ inline SoftCap soft_cap(const AttentionParams& p, float units) {
  const float c = p.logits_soft_cap > 0.0f ? p.logits_soft_cap * units : 0.0f;
  return {c, c > 0.0f ? -2.0f * kLog2e / c : 0.0f};
}

// 2^x by one ex2.approx.ftz (the harness computes exp2f).
__device__ __forceinline__ float soft_cap_exp2(float x) {
#ifdef JAXOPS_CUDA_HARNESS
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// c tanh(x / c) for a cap that is on, and into *slope (when not null) its
// derivative 1 - tanh^2 by x: tanh(y) = sign(y) (1 - e) / (1 + e) with
// e = 2^(-2 |y| log2(e)) <= 1, no overflow at any x, and 1 - tanh^2 =
// 4 e / (1 + e)^2 (exact near the cap, where 1 - t * t would cancel). One ex2
// and one reciprocal on the special-function unit, in registers.
__device__ __forceinline__ float capped(const SoftCap& cap, float x, float* slope = nullptr) {
  const float e = soft_cap_exp2(fabsf(x) * cap.k);
  const float r = __fdividef(1.0f, 1.0f + e);
  if (slope != nullptr) *slope = 4.0f * e * r * r;
  return copysignf(cap.c * ((1.0f - e) * r), x);
}

// The segment ids of a run of rows or keys: [lo, hi] (lo > hi: no ids). Two
// runs can attend each other only where their ranges meet; where both are one
// and the same id, no element needs its own test.
struct IdRange {
  int lo;
  int hi;
  __device__ bool meets(const IdRange& o) const { return lo <= o.hi && o.lo <= hi; }
  __device__ bool same_single(const IdRange& o) const {
    return lo == hi && o.lo == o.hi && lo == o.lo;
  }
};

// A warp's view of a tile of the other side, as far as segment ids go: whether
// its rows (or keys) meet the tile's at all, and whether both hold one and
// the same id (no element needs its own test).
struct TileIds {
  bool meets;
  bool uniform;
};

// The range of ids[begin .. end) (a run of at most a few tiles), by every lane
// of the warp: each reads every 32nd id (coalesced), then one redux.sync each
// for the min and the max. The warp's lanes all call it with the same run.
__device__ __forceinline__ IdRange warp_id_range(const int32_t* ids, int64_t begin, int64_t end) {
  constexpr unsigned kAll = 0xffffffffu;
  int lo = 0x7fffffff, hi = -0x7fffffff - 1;
  for (int64_t i = begin + static_cast<int>(threadIdx.x) % 32; i < end; i += 32) {
    const int id = ids[i];
    lo = id < lo ? id : lo;
    hi = id > hi ? id : hi;
  }
#if __CUDA_ARCH__ >= 800
  return {__reduce_min_sync(kAll, lo), __reduce_max_sync(kAll, hi)};
#else
  for (int offset = 16; offset > 0; offset /= 2) {
    const int other_lo = __shfl_xor_sync(kAll, lo, offset);
    const int other_hi = __shfl_xor_sync(kAll, hi, offset);
    lo = other_lo < lo ? other_lo : lo;
    hi = other_hi > hi ? other_hi : hi;
  }
  return {lo, hi};
#endif
}

// The first tile i' >= i of `tiles` whose ids meet `block` (tile i' holds
// positions first + i' * size .., clipped to [begin, end), of `ids`), with
// `warp`'s view of it in *seen; `tiles` where none does. Every warp of a
// block finds the same tile from the same ids.
__device__ __forceinline__ int next_meeting_tile(const int32_t* ids, int64_t first, int size,
                                                 int64_t begin, int64_t end, int i, int tiles,
                                                 const IdRange& block, const IdRange& warp,
                                                 TileIds* seen) {
  for (; i < tiles; ++i) {
    const int64_t lo = first + int64_t{i} * size;
    const int64_t from = lo > begin ? lo : begin, to = lo + size < end ? lo + size : end;
    const IdRange tile = warp_id_range(ids, from, to);
    if (block.meets(tile)) {
      *seen = {warp.meets(tile), warp.same_single(tile)};
      return i;
    }
  }
  return i;
}

// The segment ids of one batch row's queries and keys (null without ids).
struct Segments {
  const int32_t* q;
  const int32_t* kv;
  __device__ bool on() const { return q != nullptr; }
  // Whether query t and key j share a document.
  __device__ bool same(int64_t t, int64_t j) const { return q[t] == kv[j]; }
};

__device__ __forceinline__ Segments segments_of(const AttentionParams& p, int64_t b) {
  if (p.q_segment_ids == nullptr) return {nullptr, nullptr};
  return {p.q_segment_ids + b * p.q_len, p.kv_segment_ids + b * p.kv_len};
}

// The natural-unit logit of query row t and key j from their product: scale *
// dot, soft-capped (its slope into *slope when asked), plus the bias; -inf
// where (t, j) is masked: the positions, the lengths, the segment ids, the
// mask (the SIMT kernels: every element).
__device__ __forceinline__ float logit(const AttentionParams& p, const HeadView& h,
                                       const Segments& ids, const SoftCap& cap, int64_t t,
                                       int64_t j, float dot, float* slope = nullptr) {
  if (t >= h.q_valid || j >= h.kv_valid) return -CUDART_INF_F;
  const int64_t pos = t + h.offset;
  if (p.is_causal && j > pos) return -CUDART_INF_F;
  if (p.window_left >= 0 && j < pos - p.window_left) return -CUDART_INF_F;
  if (p.window_right >= 0 && j > pos + p.window_right) return -CUDART_INF_F;
  if (ids.on() && !ids.same(t, j)) return -CUDART_INF_F;
  if (p.mask != nullptr && !p.mask[broadcast_offset(p.mask_strides, h, t, j)]) {
    return -CUDART_INF_F;
  }
  float x = p.scale * dot;
  if (cap.on()) x = capped(cap, x, slope);
  if (p.bias != nullptr) x += p.bias[broadcast_offset(p.bias_strides, h, t, j)];
  return x;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

struct Range {
  int64_t begin;
  int64_t end;
};

// The keys that query rows [t0, t1) may attend (a superset: the mask and the
// bias are checked per element).
__device__ __forceinline__ Range key_range(const AttentionParams& p, const HeadView& h, int64_t t0, int64_t t1) {
  t1 = min64(t1, h.q_valid);
  if (t0 >= t1) return {0, 0};
  const int64_t first = t0 + h.offset, last = t1 - 1 + h.offset;
  int64_t lo = 0, hi = h.kv_valid;
  if (p.is_causal) hi = min64(hi, last + 1);
  if (p.window_right >= 0) hi = min64(hi, last + p.window_right + 1);
  if (p.window_left >= 0) lo = max64(lo, first - p.window_left);
  return lo < hi ? Range{lo, hi} : Range{0, 0};
}

// Whether every query row of [t0, t1) attends every key of [j0, j1) with no
// bias: the tile needs no per-element masking (scale * dot is its logit).
__device__ __forceinline__ bool tile_fully_visible(const AttentionParams& p, const HeadView& h,
                                                   int64_t t0, int64_t t1, int64_t j0,
                                                   int64_t j1) {
  if (p.mask != nullptr || p.bias != nullptr || t1 > h.q_valid || j1 > h.kv_valid) return false;
  const int64_t first = t0 + h.offset, last = t1 - 1 + h.offset;
  if (p.is_causal && j1 - 1 > first) return false;
  if (p.window_right >= 0 && j1 - 1 > first + p.window_right) return false;
  return p.window_left < 0 || j0 >= last - p.window_left;
}

// The keys one query row may attend, or the query rows that may attend one
// key, as int32 positions [begin, end) (sequence lengths stay below 2^31): the
// causal limit, the window and the lengths, the mask and the bias aside. The
// tensor-core kernels hold them for a lane's rows, so that masking an element
// is two comparisons.
struct Limits {
  int begin;
  int end;
};

// Whether query row t attends key j, given t's key limits or j's query limits.
__device__ __forceinline__ bool within(const Limits& limits, int64_t position) {
  return position >= limits.begin && position < limits.end;
}

// The log2-unit logit of query row t and key j from their product (the
// tensor-core kernels): dot * scale * log2(e), soft-capped by `cap` (in log2
// units; its slope into *slope when asked), plus bias * log2(e); -inf where
// (t, j) is not `visible` (by Limits), their segment ids differ (with
// check_ids: the tile does not hold one id on both sides) or the mask hides it.
__device__ __forceinline__ float visible_logit(const AttentionParams& p, const HeadView& h,
                                               const Segments& ids, bool check_ids,
                                               const SoftCap& cap, int64_t t, int64_t j,
                                               bool visible, float dot, float scale_log2,
                                               float* slope = nullptr) {
  if (!visible) return -CUDART_INF_F;
  if (check_ids && !ids.same(t, j)) return -CUDART_INF_F;
  if (p.mask != nullptr && !p.mask[broadcast_offset(p.mask_strides, h, t, j)]) {
    return -CUDART_INF_F;
  }
  float x = dot * scale_log2;
  if (cap.on()) x = capped(cap, x, slope);
  if (p.bias != nullptr) {
    x += p.bias[broadcast_offset(p.bias_strides, h, t, j)] * kLog2e;
  }
  return x;
}

// The query rows that may attend keys [j0, j1).
__device__ __forceinline__ Range query_range(const AttentionParams& p, const HeadView& h, int64_t j0, int64_t j1) {
  j1 = min64(j1, h.kv_valid);
  if (j0 >= j1) return {0, 0};
  int64_t lo = 0, hi = h.q_valid;
  if (p.is_causal) lo = max64(lo, j0 - h.offset);
  if (p.window_right >= 0) lo = max64(lo, j0 - p.window_right - h.offset);
  if (p.window_left >= 0) hi = min64(hi, j1 + p.window_left - h.offset);
  return lo < hi ? Range{lo, hi} : Range{0, 0};
}

__device__ __forceinline__ Limits keys_of_row(const AttentionParams& p, const HeadView& h,
                                              int64_t t) {
  const Range keys = key_range(p, h, t, t + 1);
  return {static_cast<int>(keys.begin), static_cast<int>(keys.end)};
}

__device__ __forceinline__ Limits rows_of_key(const AttentionParams& p, const HeadView& h,
                                              int64_t j) {
  const Range rows = query_range(p, h, j, j + 1);
  return {static_cast<int>(rows.begin), static_cast<int>(rows.end)};
}

// rows x [hp] of a [B, len, heads, H] tensor into a tile, zero beyond len and H
// and outside rows [begin, end) (rows no row of the block attends: a NaN or
// inf there must not meet a zero probability, as 0 * NaN is NaN):
// 16-byte vectors when H is a multiple of 16 (then H == hp and every row starts
// 16-byte aligned in an aligned buffer), single elements otherwise.
template <typename T>
__device__ __forceinline__ void load_rows(T* tile, int ld, const T* x, int64_t b, int64_t len,
                                          int64_t heads, int64_t head, int64_t head_dim,
                                          int64_t row0, int rows, int hp,
                                          int64_t begin = 0, int64_t end = INT64_MAX) {
  if (head_dim == hp && reinterpret_cast<uintptr_t>(x) % sizeof(uint4) == 0) {
    constexpr int kVector = static_cast<int>(sizeof(uint4) / sizeof(T));
    const int vectors = hp / kVector;
    for (int i = threadIdx.x; i < rows * vectors; i += kThreads) {
      const int r = i / vectors, c = i % vectors * kVector;
      const int64_t row = row0 + r;
      uint4 value = {0u, 0u, 0u, 0u};
      if (row < len && row >= begin && row < end) {
        value = *reinterpret_cast<const uint4*>(x + ((b * len + row) * heads + head) * head_dim + c);
      }
      *reinterpret_cast<uint4*>(tile + r * ld + c) = value;
    }
  } else {
    for (int i = threadIdx.x; i < rows * hp; i += kThreads) {
      const int r = i / hp, c = i % hp;
      const int64_t row = row0 + r;
      tile[r * ld + c] = row < len && row >= begin && row < end && c < head_dim
                             ? x[((b * len + row) * heads + head) * head_dim + c]
                             : from_float<T>(0.0f);
    }
  }
}

__device__ __forceinline__ void zero(float* tile, int ld, int rows, int cols) {
  for (int i = threadIdx.x; i < rows * cols; i += kThreads) tile[i / cols * ld + i % cols] = 0.0f;
}

// A block's tile of `tile` rows of a sequence of `len` rows and its (batch,
// head), from blockIdx.x = (b * heads + head) * tiles + tile. 32-bit division:
// the grid has fewer than 2^31 blocks, and 64-bit division is a call that
// would spill registers.
struct BlockIndex {
  int64_t b;
  int64_t head;
  int64_t kv_head;  // head / group
  int64_t row0;
};

__device__ __forceinline__ BlockIndex block_index(int64_t len, int tile, int64_t heads,
                                                  int64_t group) {
  const unsigned tiles = static_cast<unsigned>((len + tile - 1) / tile);
  const unsigned block = blockIdx.x;
  const unsigned bh = block / tiles;
  const unsigned head = bh % static_cast<unsigned>(heads);
  return {static_cast<int64_t>(bh / static_cast<unsigned>(heads)), static_cast<int64_t>(head),
          static_cast<int64_t>(head / static_cast<unsigned>(group)),
          static_cast<int64_t>(block % tiles) * tile};
}

// -- launches --------------------------------------------------------------------------

inline int padded_head_dim(int64_t head_dim) {
  return head_dim <= 0 ? 16 : static_cast<int>((head_dim + 15) / 16 * 16);
}

inline int64_t blocks(int64_t len, int64_t tile, int64_t heads) { return (len + tile - 1) / tile * heads; }

inline bool fits_grid(int64_t blocks) { return blocks > 0 && blocks <= 0x7fffffff; }

}  // namespace jaxops::cuda::attention_tiles
