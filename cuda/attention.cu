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
// Tiles, products and masking: attention_tiles.cuh (shared with the
// forward-mode kernel, attention_jvp.cu).
#include "cuda/attention.h"

#include <cstdint>

#include <math_constants.h>

#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using namespace attention_tiles;

// -- shared-memory layouts -------------------------------------------------------------

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
  constexpr int kRowThreads = row_threads<kBr>();

  load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  zero(sh.o, st.ld_o, kBr, hp);
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    sh.row_max[r] = -CUDART_INF_F;
    sh.row_sum[r] = 0.0f;
  }
  const Range keys = key_range(p, h, t0, t0 + kBr);
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    __syncthreads();  // the previous tile's readers of k, v and p are done
    load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp,
              keys.begin, keys.end);
    load_rows(sh.v, st.ld_t, value, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc,
              hp, keys.begin, keys.end);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp,
                                   p.allow_tf32);
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
    block_gemm<false, false, true>(sh.o, st.ld_o, sh.p, st.ld_p, sh.v, st.ld_t, kBr, hp, kBc,
                                   p.allow_tf32);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBr * hp; i += kThreads) {
    const int r = i / hp, c = i % hp;
    const int64_t t = t0 + r;
    if (t >= p.q_len || c >= p.head_dim) continue;
    const float sum = sh.row_sum[r];
    out[((b * p.q_len + t) * p.num_heads + n) * p.head_dim + c] =
        from_float<T>(sum != 0.0f ? sh.o[r * st.ld_o + c] / sum : 0.0f);  // NaN sum: NaN row
  }
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    const int64_t t = t0 + r;
    if (t >= p.q_len) continue;
    const float sum = sh.row_sum[r];
    logsumexp[(b * p.num_heads + n) * p.q_len + t] =
        sum != 0.0f ? sh.row_max[r] + logf(sum) : -CUDART_INF_F;
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
    // A masked key has dS = 0 even when its dP is NaN (a NaN V row the row
    // does not attend).
    const float dscore = x == -CUDART_INF_F ? 0.0f : prob * (sh.dp[r * st.ld_s + c] - sh.row_d[r]);
    sh.s[r * st.ld_s + c] = prob;
    sh.p[r * st.ld_p + c] = from_float<T>(prob);
    sh.ds[r * st.ld_p + c] = from_float<T>(dscore);
    if (dbias != nullptr && x != -CUDART_INF_F) {
      atomicAdd(dbias + broadcast_offset(p.bias_strides, h, t0 + r, j0 + c), dscore);
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

  // Keys past the batch's KV length are never read (whatever they hold).
  const int64_t kv_valid = head_view(p, b, kv_head * group).kv_valid;
  load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp, 0,
            kv_valid);
  load_rows(sh.v, st.ld_t, value, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp, 0,
            kv_valid);
  zero(sh.acc0, st.ld_o, kBc, hp);
  zero(sh.acc1, st.ld_o, kBc, hp);
  for (int64_t n = kv_head * group; n < (kv_head + 1) * group; ++n) {
    const HeadView h = head_view(p, b, n);
    const Range rows = query_range(p, h, j0, j0 + kBc);
    for (int64_t t0 = rows.begin / kBr * kBr; t0 < rows.end; t0 += kBr) {
      __syncthreads();  // the previous tile's readers of q, dout, p, ds are done
      load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp,
                rows.begin, rows.end);
      load_rows(sh.dout, st.ld_t, dout, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp,
                rows.begin, rows.end);
      load_row_stats(p, b, n, t0, kBr, logsumexp, d, sh.row_lse, sh.row_d);
      __syncthreads();
      block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp,
                                     p.allow_tf32);
      block_gemm<false, true, false>(sh.dp, st.ld_s, sh.dout, st.ld_t, sh.v, st.ld_t, kBr, kBc,
                                     hp, p.allow_tf32);
      __syncthreads();
      probabilities_and_dscores<T, kBr, kBc>(p, h, st, sh, t0, j0, nullptr);
      __syncthreads();
      block_gemm<true, false, true>(sh.acc1, st.ld_o, sh.p, st.ld_p, sh.dout, st.ld_t, kBc, hp,
                                    kBr, p.allow_tf32);
      block_gemm<true, false, true>(sh.acc0, st.ld_o, sh.ds, st.ld_p, sh.q, st.ld_t, kBc, hp,
                                    kBr, p.allow_tf32);
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
    load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp,
              keys.begin, keys.end);
    load_rows(sh.v, st.ld_t, value, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc,
              hp, keys.begin, keys.end);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp,
                                   p.allow_tf32);
    block_gemm<false, true, false>(sh.dp, st.ld_s, sh.dout, st.ld_t, sh.v, st.ld_t, kBr, kBc, hp,
                                   p.allow_tf32);
    __syncthreads();
    probabilities_and_dscores<T, kBr, kBc>(p, h, st, sh, t0, j0, dbias);
    __syncthreads();
    block_gemm<false, false, true>(sh.acc0, st.ld_o, sh.ds, st.ld_p, sh.k, st.ld_t, kBr, hp, kBc,
                                   p.allow_tf32);
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
  if (p.head_dim > kCudaAttentionMaxHeadDim || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
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
  if (p.head_dim > kCudaAttentionMaxHeadDim || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
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
  // 32x32 tiles fit every head dim up to kCudaAttentionMaxHeadDim in 2-byte types;
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
