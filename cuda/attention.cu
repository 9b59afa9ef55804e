// Flash attention on CUDA, FlashAttention-2 style (see attention.h for the
// contract).
//
// Forward: a block owns a tile of kBr query rows of one (batch, head) and walks
// the key/value tiles (kBc rows) that its rows can see, skipping tiles that the
// causal limit, the window or the key length mask entirely. Per tile: S = Q K^T
// into shared memory, the masked logits, an online-softmax update of the row
// max and sum (one warp per row), then O += P V with O in shared memory (f32).
//
// Backward, three launches, no atomics on dq/dk/dv (deterministic):
//   rows:  D = rowsum(dout * out) - dlogsumexp, per query row (workspace).
//   dk/dv: a block owns kBc key rows of one (batch, kv head) and walks the
//          query tiles of every query head of its group (GQA sums in the block),
//          recomputing P from the saved logsumexp: dV += P^T dO, dS = P (dP - D)
//          with dP = dO V^T, dK += dS^T Q.
//   dq:    a block owns kBr query rows and walks their key tiles again:
//          dQ += dS K; dbias (when asked) is dS, added atomically into the
//          bias-shaped result, which sums the broadcast axes.
//
// Tiles live in shared memory with head vectors padded to a multiple of 16
// (hp) and rows padded against bank conflicts. Every product is a block_gemm
// between shared-memory tiles: tensor cores through nvcuda::wmma for
// __half/__nv_bfloat16 on sm_80+ (accumulators loaded from and stored to the
// f32 shared tiles, so nothing depends on the fragment's element-to-lane
// layout), a float32 SIMT loop otherwise. Tile sizes are the largest of 64x64,
// 32x32, 16x16 whose shared memory fits kSharedBudget (sm_80's per-block limit
// is 163 KiB, sm_90's 227 KiB).
#include "cuda/attention.h"

#include <cstdint>
#include <type_traits>

#include <math_constants.h>
#include <mma.h>

#include "cuda/launch.cuh"

#include "cuda/float_convert.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define JAXOPS_ATTENTION_TENSOR_CORES 1
#endif

namespace jaxops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr size_t kSharedBudget = 160 * 1024;

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
  int hp;    // head dim padded to 16
  int ld_t;  // T tiles over the head dim
  int ld_o;  // f32 accumulators over the head dim
  int ld_s;  // f32 scores [kBr][kBc]
  int ld_p;  // T probabilities [kBr][kBc]
  __host__ __device__ Strides(int hp_, int bc) : hp(hp_), ld_t(hp_ + 8), ld_o(hp_ + 4),
                                                 ld_s(bc + 4), ld_p(bc + 8) {}
};

template <typename T>
struct FwdShared {
  T* q;             // [kBr][ld_t]
  T* k;             // [kBc][ld_t]
  T* v;             // [kBc][ld_t]
  float* s;         // [kBr][ld_s] logits
  T* p;             // [kBr][ld_p] probabilities
  float* o;         // [kBr][ld_o] unnormalised output
  float* row_max;   // [kBr]
  float* row_sum;   // [kBr]
  size_t bytes;
  __host__ __device__ FwdShared(unsigned char* base, const Strides& st, int br, int bc) {
    SharedCarver c(base);
    q = c.take<T>(int64_t{br} * st.ld_t);
    k = c.take<T>(int64_t{bc} * st.ld_t);
    v = c.take<T>(int64_t{bc} * st.ld_t);
    s = c.take<float>(int64_t{br} * st.ld_s);
    p = c.take<T>(int64_t{br} * st.ld_p);
    o = c.take<float>(int64_t{br} * st.ld_o);
    row_max = c.take<float>(br);
    row_sum = c.take<float>(br);
    bytes = c.used();
  }
};

// Both backward kernels: the query-side and key-side tiles, P and dS.
template <typename T>
struct BwdShared {
  T* q;          // [kBr][ld_t]
  T* dout;       // [kBr][ld_t]
  T* k;          // [kBc][ld_t]
  T* v;          // [kBc][ld_t]
  float* s;      // [kBr][ld_s] logits, then P
  float* dp;     // [kBr][ld_s] dO V^T
  T* p;          // [kBr][ld_p]
  T* ds;         // [kBr][ld_p]
  float* acc0;   // dk/dv: dK [kBc][ld_o]; dq: dQ [kBr][ld_o]
  float* acc1;   // dk/dv: dV [kBc][ld_o]; dq: unused
  float* row_lse;
  float* row_d;
  size_t bytes;
  __host__ __device__ BwdShared(unsigned char* base, const Strides& st, int br, int bc,
                                bool key_side) {
    SharedCarver c(base);
    q = c.take<T>(int64_t{br} * st.ld_t);
    dout = c.take<T>(int64_t{br} * st.ld_t);
    k = c.take<T>(int64_t{bc} * st.ld_t);
    v = c.take<T>(int64_t{bc} * st.ld_t);
    s = c.take<float>(int64_t{br} * st.ld_s);
    dp = c.take<float>(int64_t{br} * st.ld_s);
    p = c.take<T>(int64_t{br} * st.ld_p);
    ds = c.take<T>(int64_t{br} * st.ld_p);
    acc0 = c.take<float>(int64_t{key_side ? bc : br} * st.ld_o);
    acc1 = key_side ? c.take<float>(int64_t{bc} * st.ld_o) : nullptr;
    row_lse = c.take<float>(br);
    row_d = c.take<float>(br);
    bytes = c.used();
  }
};

// -- block-wide products between shared-memory tiles -----------------------------------

template <typename TA, typename TB>
constexpr bool kTensorCoreOperands =
    std::is_same<TA, TB>::value &&
    (std::is_same<TA, __half>::value || std::is_same<TA, __nv_bfloat16>::value);

// c[m][n] = (kAccumulate ? c[m][n] : 0) + sum_k A(m, k) B(k, n) for m < M, n < N,
// k < K (multiples of 16), with A(m, k) = kTransA ? a[k][m] : a[m][k] and
// B(k, n) = kTransB ? b[n][k] : b[k][n]. Every thread of the block calls it;
// the caller synchronises before reading c or overwriting a, b.
template <bool kTransA, bool kTransB, bool kAccumulate, typename TA, typename TB>
__device__ __forceinline__ void block_gemm(float* c, int ldc, const TA* a, int lda, const TB* b, int ldb, int M,
                           int N, int K) {
#ifdef JAXOPS_ATTENTION_TENSOR_CORES
  if constexpr (kTensorCoreOperands<TA, TB>) {
    namespace wmma = nvcuda::wmma;
    using LayoutA = std::conditional_t<kTransA, wmma::col_major, wmma::row_major>;
    using LayoutB = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
    const int tiles_n = N / 16;
    for (int tile = warp; tile < M / 16 * tiles_n; tile += kWarps) {
      const int m0 = tile / tiles_n * 16, n0 = tile % tiles_n * 16;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      if (kAccumulate) {
        wmma::load_matrix_sync(acc, c + m0 * ldc + n0, ldc, wmma::mem_row_major);
      } else {
        wmma::fill_fragment(acc, 0.0f);
      }
      for (int k0 = 0; k0 < K; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, TA, LayoutA> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, TB, LayoutB> fb;
        wmma::load_matrix_sync(fa, kTransA ? a + k0 * lda + m0 : a + m0 * lda + k0, lda);
        wmma::load_matrix_sync(fb, kTransB ? b + n0 * ldb + k0 : b + k0 * ldb + n0, ldb);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(c + m0 * ldc + n0, acc, ldc, wmma::mem_row_major);
    }
  } else
#endif
  {
    // Each thread owns a 2x2 block of c (M and N are even).
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
}

// -- masking ---------------------------------------------------------------------------

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

// scale * dot + bias for query row t and key j, or -inf where (t, j) is masked.
__device__ __forceinline__ float logit(const AttentionParams& p, const HeadView& h, int64_t t,
                                       int64_t j, float dot) {
  if (t >= h.q_valid || j >= h.kv_valid) return -CUDART_INF_F;
  const int64_t pos = t + h.offset;
  if (p.is_causal && j > pos) return -CUDART_INF_F;
  if (p.window_left >= 0 && j < pos - p.window_left) return -CUDART_INF_F;
  if (p.window_right >= 0 && j > pos + p.window_right) return -CUDART_INF_F;
  if (p.mask != nullptr &&
      !p.mask[h.b * p.mask_strides[0] + h.n * p.mask_strides[1] + t * p.mask_strides[2] +
              j * p.mask_strides[3]]) {
    return -CUDART_INF_F;
  }
  float x = p.scale * dot;
  if (p.bias != nullptr) {
    x += p.bias[h.b * p.bias_strides[0] + h.n * p.bias_strides[1] + t * p.bias_strides[2] +
                j * p.bias_strides[3]];
  }
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

// rows x [hp] of a [B, len, heads, H] tensor into a tile, zero beyond len and H:
// 16-byte vectors when H is a multiple of 16 (then H == hp and every row starts
// 16-byte aligned in an aligned buffer), single elements otherwise.
template <typename T>
__device__ __forceinline__ void load_rows(T* tile, int ld, const T* x, int64_t b, int64_t len,
                                          int64_t heads, int64_t head, int64_t head_dim,
                                          int64_t row0, int rows, int hp) {
  if (head_dim == hp && reinterpret_cast<uintptr_t>(x) % sizeof(uint4) == 0) {
    constexpr int kVector = static_cast<int>(sizeof(uint4) / sizeof(T));
    const int vectors = hp / kVector;
    for (int i = threadIdx.x; i < rows * vectors; i += kThreads) {
      const int r = i / vectors, c = i % vectors * kVector;
      const int64_t row = row0 + r;
      uint4 value = {0u, 0u, 0u, 0u};
      if (row < len) {
        value = *reinterpret_cast<const uint4*>(x + ((b * len + row) * heads + head) * head_dim + c);
      }
      *reinterpret_cast<uint4*>(tile + r * ld + c) = value;
    }
  } else {
    for (int i = threadIdx.x; i < rows * hp; i += kThreads) {
      const int r = i / hp, c = i % hp;
      const int64_t row = row0 + r;
      tile[r * ld + c] = row < len && c < head_dim
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

// -- forward ---------------------------------------------------------------------------

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_kernel(AttentionParams p, int hp, const T* query, const T* key,
                         const T* value, T* out, float* logsumexp) {
  const Strides st(hp, kBc);
  FwdShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc);
  const BlockIndex at = block_index(p.q_len, kBr, p.num_heads, p.num_heads / p.num_kv_heads);
  const int64_t b = at.b, n = at.head, kv_head = at.kv_head, t0 = at.row0;
  const HeadView h = head_view(p, b, n);
  constexpr int kRowThreads = kThreads / kBr;
  static_assert(kThreads % kBr == 0 && kRowThreads <= kWarpSize, "rows share warps evenly");

  load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  zero(sh.o, st.ld_o, kBr, hp);
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    sh.row_max[r] = -CUDART_INF_F;
    sh.row_sum[r] = 0.0f;
  }
  const Range keys = key_range(p, h, t0, t0 + kBr);
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    __syncthreads();  // the previous tile's readers of k, v and p are done
    load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp);
    load_rows(sh.v, st.ld_t, value, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc,
              hp);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp);
    __syncthreads();
    for (int i = threadIdx.x; i < kBr * kBc; i += kThreads) {
      const int r = i / kBc, c = i % kBc;
      float& x = sh.s[r * st.ld_s + c];
      x = logit(p, h, t0 + r, j0 + c, x);
    }
    __syncthreads();
    // Online softmax, kRowThreads neighbouring threads per row (few shuffles);
    // the row's output is rescaled here too.
    {
      const int r = static_cast<int>(threadIdx.x) / kRowThreads;
      const int sub = static_cast<int>(threadIdx.x) % kRowThreads;
      const float* s_row = sh.s + r * st.ld_s;
      float tile_max = -CUDART_INF_F;
      for (int c = sub; c < kBc; c += kRowThreads) tile_max = fmaxf(tile_max, s_row[c]);
      tile_max = group_max<kRowThreads>(tile_max);
      const float old_max = sh.row_max[r];
      const float new_max = fmaxf(old_max, tile_max);
      float sum = 0.0f;
      for (int c = sub; c < kBc; c += kRowThreads) {
        const float x = s_row[c];
        const float prob = x == -CUDART_INF_F ? 0.0f : __expf(x - new_max);
        sh.p[r * st.ld_p + c] = from_float<T>(prob);
        sum += prob;
      }
      sum = group_sum<kRowThreads>(sum);
      const float alpha = old_max == -CUDART_INF_F ? 0.0f : __expf(old_max - new_max);
      for (int c = sub; c < hp; c += kRowThreads) sh.o[r * st.ld_o + c] *= alpha;
      __syncwarp();  // the row's threads have read row_max[r]
      if (sub == 0) {
        sh.row_max[r] = new_max;
        sh.row_sum[r] = sh.row_sum[r] * alpha + sum;
      }
    }
    __syncthreads();
    block_gemm<false, false, true>(sh.o, st.ld_o, sh.p, st.ld_p, sh.v, st.ld_t, kBr, hp, kBc);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBr * hp; i += kThreads) {
    const int r = i / hp, c = i % hp;
    const int64_t t = t0 + r;
    if (t >= p.q_len || c >= p.head_dim) continue;
    const float sum = sh.row_sum[r];
    out[((b * p.q_len + t) * p.num_heads + n) * p.head_dim + c] =
        from_float<T>(sum > 0.0f ? sh.o[r * st.ld_o + c] / sum : 0.0f);
  }
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    const int64_t t = t0 + r;
    if (t >= p.q_len) continue;
    const float sum = sh.row_sum[r];
    logsumexp[(b * p.num_heads + n) * p.q_len + t] =
        sum > 0.0f ? sh.row_max[r] + logf(sum) : -CUDART_INF_F;
  }
}

// -- backward --------------------------------------------------------------------------

// D = rowsum(dout * out) - dlogsumexp for every query row: kRowLanes lanes per
// row.
constexpr int kRowLanes = 8;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_rows_kernel(AttentionParams p, const T* out, const T* dout,
                              const float* dlogsumexp, float* d) {
  const int64_t rows = p.batch * p.q_len * p.num_heads;
  const int sub = static_cast<int>(threadIdx.x) % kRowLanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (kThreads / kRowLanes);
  // Every lane of a warp runs the same number of iterations (the shuffles need
  // them all); rows past the end contribute nothing.
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kRowLanes;
  const int64_t warp_first = first - static_cast<int64_t>(threadIdx.x % kWarpSize) / kRowLanes;
  for (int64_t base = warp_first; base < rows; base += stride) {
    const int64_t row = base + static_cast<int64_t>(threadIdx.x % kWarpSize) / kRowLanes;
    float sum = 0.0f;
    if (row < rows) {
      for (int64_t c = sub; c < p.head_dim; c += kRowLanes) {
        sum += to_float(out[row * p.head_dim + c]) * to_float(dout[row * p.head_dim + c]);
      }
    }
    sum = group_sum<kRowLanes>(sum);
    if (sub == 0 && row < rows) {
      const int64_t n = row % p.num_heads, t = row / p.num_heads % p.q_len;
      const int64_t b = row / (p.num_heads * p.q_len);
      const int64_t at = (b * p.num_heads + n) * p.q_len + t;
      d[at] = sum - (dlogsumexp != nullptr ? dlogsumexp[at] : 0.0f);
    }
  }
}

// The query tile's rows of logsumexp and D (-inf and 0 beyond the sequence).
__device__ __forceinline__ void load_row_stats(const AttentionParams& p, int64_t b, int64_t n, int64_t t0,
                               int rows, const float* logsumexp, const float* d, float* row_lse,
                               float* row_d) {
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    const int64_t t = t0 + r;
    const int64_t at = (b * p.num_heads + n) * p.q_len + t;
    row_lse[r] = t < p.q_len ? logsumexp[at] : -CUDART_INF_F;
    row_d[r] = t < p.q_len ? d[at] : 0.0f;
  }
}

// From S = Q K^T (sh.s) and dP = dO V^T (sh.dp) of query rows t0.. and keys
// j0..: P and dS = P (dP - D) into sh.p and sh.ds, P also into sh.s; with
// dbias, dS is added to it.
template <typename T, int kBr, int kBc>
__device__ __forceinline__ void probabilities_and_dscores(const AttentionParams& p, const HeadView& h,
                                          const Strides& st, BwdShared<T>& sh, int64_t t0,
                                          int64_t j0, float* dbias) {
  for (int i = threadIdx.x; i < kBr * kBc; i += kThreads) {
    const int r = i / kBc, c = i % kBc;
    const float x = logit(p, h, t0 + r, j0 + c, sh.s[r * st.ld_s + c]);
    const float lse = sh.row_lse[r];
    const float prob = x == -CUDART_INF_F || lse == -CUDART_INF_F ? 0.0f : __expf(x - lse);
    const float dscore = prob * (sh.dp[r * st.ld_s + c] - sh.row_d[r]);
    sh.s[r * st.ld_s + c] = prob;
    sh.p[r * st.ld_p + c] = from_float<T>(prob);
    sh.ds[r * st.ld_p + c] = from_float<T>(dscore);
    if (dbias != nullptr && x != -CUDART_INF_F) {
      atomicAdd(dbias + h.b * p.bias_strides[0] + h.n * p.bias_strides[1] +
                    (t0 + r) * p.bias_strides[2] + (j0 + c) * p.bias_strides[3],
                dscore);
    }
  }
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dkdv_kernel(AttentionParams p, int hp, const T* query, const T* key,
                              const T* value, const float* logsumexp, const T* dout,
                              const float* d, T* dkey, T* dvalue) {
  const Strides st(hp, kBc);
  BwdShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc, true);
  const BlockIndex at = block_index(p.kv_len, kBc, p.num_kv_heads, 1);
  const int64_t b = at.b, kv_head = at.head, j0 = at.row0;
  const int64_t group = p.num_heads / p.num_kv_heads;

  load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp);
  load_rows(sh.v, st.ld_t, value, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp);
  zero(sh.acc0, st.ld_o, kBc, hp);
  zero(sh.acc1, st.ld_o, kBc, hp);
  for (int64_t n = kv_head * group; n < (kv_head + 1) * group; ++n) {
    const HeadView h = head_view(p, b, n);
    const Range rows = query_range(p, h, j0, j0 + kBc);
    for (int64_t t0 = rows.begin / kBr * kBr; t0 < rows.end; t0 += kBr) {
      __syncthreads();  // the previous tile's readers of q, dout, p, ds are done
      load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
      load_rows(sh.dout, st.ld_t, dout, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
      load_row_stats(p, b, n, t0, kBr, logsumexp, d, sh.row_lse, sh.row_d);
      __syncthreads();
      block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp);
      block_gemm<false, true, false>(sh.dp, st.ld_s, sh.dout, st.ld_t, sh.v, st.ld_t, kBr, kBc,
                                     hp);
      __syncthreads();
      probabilities_and_dscores<T, kBr, kBc>(p, h, st, sh, t0, j0, nullptr);
      __syncthreads();
      block_gemm<true, false, true>(sh.acc1, st.ld_o, sh.p, st.ld_p, sh.dout, st.ld_t, kBc, hp,
                                    kBr);
      block_gemm<true, false, true>(sh.acc0, st.ld_o, sh.ds, st.ld_p, sh.q, st.ld_t, kBc, hp,
                                    kBr);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBc * hp; i += kThreads) {
    const int r = i / hp, c = i % hp;
    const int64_t j = j0 + r;
    if (j >= p.kv_len || c >= p.head_dim) continue;
    const int64_t at = ((b * p.kv_len + j) * p.num_kv_heads + kv_head) * p.head_dim + c;
    dkey[at] = from_float<T>(p.scale * sh.acc0[r * st.ld_o + c]);
    dvalue[at] = from_float<T>(sh.acc1[r * st.ld_o + c]);
  }
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_kernel(AttentionParams p, int hp, const T* query, const T* key,
                            const T* value, const float* logsumexp, const T* dout,
                            const float* d, T* dquery, float* dbias) {
  const Strides st(hp, kBc);
  BwdShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc, false);
  const BlockIndex at = block_index(p.q_len, kBr, p.num_heads, p.num_heads / p.num_kv_heads);
  const int64_t b = at.b, n = at.head, kv_head = at.kv_head, t0 = at.row0;
  const HeadView h = head_view(p, b, n);

  load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  load_rows(sh.dout, st.ld_t, dout, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  load_row_stats(p, b, n, t0, kBr, logsumexp, d, sh.row_lse, sh.row_d);
  zero(sh.acc0, st.ld_o, kBr, hp);
  const Range keys = key_range(p, h, t0, t0 + kBr);
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    __syncthreads();  // the previous tile's readers of k and ds are done
    load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp);
    load_rows(sh.v, st.ld_t, value, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc,
              hp);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp);
    block_gemm<false, true, false>(sh.dp, st.ld_s, sh.dout, st.ld_t, sh.v, st.ld_t, kBr, kBc, hp);
    __syncthreads();
    probabilities_and_dscores<T, kBr, kBc>(p, h, st, sh, t0, j0, dbias);
    __syncthreads();
    block_gemm<false, false, true>(sh.acc0, st.ld_o, sh.ds, st.ld_p, sh.k, st.ld_t, kBr, hp, kBc);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBr * hp; i += kThreads) {
    const int r = i / hp, c = i % hp;
    const int64_t t = t0 + r;
    if (t >= p.q_len || c >= p.head_dim) continue;
    dquery[((b * p.q_len + t) * p.num_heads + n) * p.head_dim + c] =
        from_float<T>(p.scale * sh.acc0[r * st.ld_o + c]);
  }
}

// -- launches --------------------------------------------------------------------------

int padded_head_dim(int64_t head_dim) {
  return head_dim <= 0 ? 16 : static_cast<int>((head_dim + 15) / 16 * 16);
}

template <typename T>
size_t fwd_shared_bytes(int hp, int br, int bc) {
  return FwdShared<T>(nullptr, Strides(hp, bc), br, bc).bytes;
}

template <typename T>
size_t bwd_shared_bytes(int hp, int br, int bc) {
  const Strides st(hp, bc);
  const size_t key_side = BwdShared<T>(nullptr, st, br, bc, true).bytes;
  const size_t query_side = BwdShared<T>(nullptr, st, br, bc, false).bytes;
  return key_side > query_side ? key_side : query_side;
}

int64_t blocks(int64_t len, int64_t tile, int64_t heads) { return (len + tile - 1) / tile * heads; }

bool fits_grid(int64_t blocks) { return blocks > 0 && blocks <= 0x7fffffff; }

template <typename T, int kBr, int kBc>
cudaError_t launch_fwd(cudaStream_t stream, const AttentionParams& p, int hp, const T* q,
                       const T* k, const T* v, T* out, float* lse) {
  const int64_t grid = blocks(p.q_len, kBr, p.batch * p.num_heads);
  if (!fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_fwd_kernel<T, kBr, kBc>,
                                      dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                                      fwd_shared_bytes<T>(hp, kBr, kBc), stream, p, hp, q, k, v,
                                      out, lse);
}

template <typename T, int kBr, int kBc>
cudaError_t launch_bwd(cudaStream_t stream, const AttentionParams& p, int hp, const T* q,
                       const T* k, const T* v, const float* lse, const T* dout, const float* d,
                       T* dq, T* dk, T* dv, float* dbias) {
  const size_t shared = bwd_shared_bytes<T>(hp, kBr, kBc);
  if (p.kv_len > 0) {
    const int64_t grid = blocks(p.kv_len, kBc, p.batch * p.num_kv_heads);
    if (!fits_grid(grid)) return cudaErrorInvalidValue;
    const cudaError_t status = launch_kernel_dynamic_shared(
        attention_bwd_dkdv_kernel<T, kBr, kBc>, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
        shared, stream, p, hp, q, k, v, lse, dout, d, dk, dv);
    if (status != cudaSuccess) return status;
  }
  const int64_t grid = blocks(p.q_len, kBr, p.batch * p.num_heads);
  if (!fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_bwd_dq_kernel<T, kBr, kBc>,
                                      dim3(static_cast<unsigned>(grid)), dim3(kThreads), shared,
                                      stream, p, hp, q, k, v, lse, dout, d, dq, dbias);
}

}  // namespace

size_t attention_bwd_workspace_bytes(const AttentionParams& p) {
  return static_cast<size_t>(p.batch * p.num_heads * p.q_len) * sizeof(float);
}

template <typename T>
cudaError_t attention_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                          const T* key, const T* value, T* out, float* logsumexp) {
  if (p.head_dim > kAttentionMaxHeadDim || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
  if (p.batch * p.num_heads * p.q_len == 0) return cudaSuccess;
  const int hp = padded_head_dim(p.head_dim);
  if (fwd_shared_bytes<T>(hp, 64, 64) <= kSharedBudget) {
    return launch_fwd<T, 64, 64>(stream, p, hp, query, key, value, out, logsumexp);
  }
  return launch_fwd<T, 32, 32>(stream, p, hp, query, key, value, out, logsumexp);
}

template <typename T>
cudaError_t attention_bwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                          const T* key, const T* value, const T* out, const float* logsumexp,
                          const T* dout, const float* dlogsumexp, T* dquery, T* dkey, T* dvalue,
                          float* dbias, void* workspace) {
  if (p.head_dim > kAttentionMaxHeadDim || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
  if (dbias != nullptr) {
    int64_t elements = 1;
    const int64_t full[4] = {p.batch, p.num_heads, p.q_len, p.kv_len};
    for (int axis = 0; axis < 4; ++axis) elements *= p.bias_strides[axis] != 0 ? full[axis] : 1;
    const cudaError_t status = cudaMemsetAsync(dbias, 0, elements * sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  const int64_t key_rows = p.batch * p.kv_len * p.num_kv_heads * p.head_dim;
  if (p.batch * p.num_heads * p.q_len == 0) {
    // No query attends: the key gradients are zero.
    if (key_rows == 0) return cudaSuccess;
    cudaError_t status = cudaMemsetAsync(dkey, 0, key_rows * sizeof(T), stream);
    if (status == cudaSuccess) status = cudaMemsetAsync(dvalue, 0, key_rows * sizeof(T), stream);
    return status;
  }
  float* d = static_cast<float*>(workspace);
  const int64_t rows = p.batch * p.q_len * p.num_heads;
  const int64_t row_blocks = (rows + kThreads / kRowLanes - 1) / (kThreads / kRowLanes);
  const cudaError_t status = launch_kernel(
      attention_bwd_rows_kernel<T>,
      dim3(static_cast<unsigned>(row_blocks < 65536 ? row_blocks : 65536)), dim3(kThreads),
      stream, p, out, dout, dlogsumexp, d);
  if (status != cudaSuccess) return status;
  const int hp = padded_head_dim(p.head_dim);
  if (bwd_shared_bytes<T>(hp, 64, 64) <= kSharedBudget) {
    return launch_bwd<T, 64, 64>(stream, p, hp, query, key, value, logsumexp, dout, d, dquery,
                                 dkey, dvalue, dbias);
  }
  // 32x32 tiles fit every head dim up to kAttentionMaxHeadDim in 2-byte types;
  // float32 needs 16x16 above 176.
  if constexpr (sizeof(T) == 4) {
    if (bwd_shared_bytes<T>(hp, 32, 32) > kSharedBudget) {
      return launch_bwd<T, 16, 16>(stream, p, hp, query, key, value, logsumexp, dout, d, dquery,
                                   dkey, dvalue, dbias);
    }
  }
  return launch_bwd<T, 32, 32>(stream, p, hp, query, key, value, logsumexp, dout, d, dquery,
                               dkey, dvalue, dbias);
}

#define JAXOPS_CUDA_ATTENTION_DEFINE(T)                                                   \
  template cudaError_t attention_fwd<T>(cudaStream_t, const AttentionParams&, const T*,   \
                                        const T*, const T*, T*, float*);                  \
  template cudaError_t attention_bwd<T>(cudaStream_t, const AttentionParams&, const T*,   \
                                        const T*, const T*, const T*, const float*,       \
                                        const T*, const float*, T*, T*, T*, float*, void*);

JAXOPS_CUDA_ATTENTION_DEFINE(float)
JAXOPS_CUDA_ATTENTION_DEFINE(__half)
JAXOPS_CUDA_ATTENTION_DEFINE(__nv_bfloat16)

#undef JAXOPS_CUDA_ATTENTION_DEFINE

}  // namespace jaxops::cuda
