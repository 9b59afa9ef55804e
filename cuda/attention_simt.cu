// Attention in full float32 on the CUDA cores (see attention.h for the
// contract): the kernels of float32 calls that may not take TF32 (the
// "highest" precision, docs/precision.md) or that run on a GPU without TF32
// tensor cores (below sm_80); attention_kernels.h says when. The tensor-core
// kernels (attention_forward.cu, attention_backward.cu, attention_jvp.cu)
// follow the same algorithm with their products in registers; here every
// product is a block_gemm between shared-memory tiles (attention_tiles.cuh),
// and the softmax reads its scores from shared memory.
//
// Forward: a block owns a tile of kBr query rows of one (batch, head) and walks
// the key/value tiles (kBc rows) that its rows can see, skipping tiles that the
// causal limit, the window or the key length mask entirely. Per tile: S = Q K^T
// into shared memory, the masked logits, an online-softmax update of the row
// max and sum, then O += P V with O in shared memory.
//
// Backward, after the rows D (attention.cu), no atomics on dq/dk/dv:
//   dk/dv: a block owns kBc key rows of one (batch, kv head) and walks the
//          query tiles of every query head of its group (GQA sums in the block),
//          recomputing P from the saved logsumexp: dV += P^T dO, dS = P (dP - D)
//          with dP = dO V^T, dK += dS^T Q.
//   dq:    a block owns kBr query rows and walks their key tiles again:
//          dQ += dS K; dbias (when asked) is dS, added atomically into the
//          bias-shaped result, which sums the broadcast axes.
//
// Forward mode: the forward's tile loop with the tangent of every product
// carried along. With the logits s_ij, their tangents
//   ds_ij = scale (dq_i.k_j + q_i.dk_j) + dbias_ij
// and e_ij = exp(s_ij - m_i) of the online softmax (running max m_i, sum l_i),
// it accumulates, all rescaled with the running max as the output is,
//   O_i = sum_j e_ij v_j
//   A_i = sum_j e_ij (ds_ij - c_i) v_j + e_ij dv_j
//   M_i = sum_j e_ij (ds_ij - c_i)
// and ends with out = O / l, dlogsumexp = M / l + c, dout = A / l - (M / l) out.
// The shift c_i, the e-weighted mean of ds over the tile that last raised the
// row's maximum, keeps A and M small where ds has a large common part along the
// row, and keeps e dv from being absorbed where ds is huge at a one-hot key; a
// raising tile moves the earlier A and M to the new shift (attention_jvp.cu).
// Tangents sit next to their primals in the tiles, so each tangent sum is one
// product: [dQ | Q] [K | dK]^T over 2 hp columns (over hp when one of dq, dk is
// absent), then [e (ds - c) | e] [V ; dV] over 2 kBc keys, O += e V using its
// right half. An absent tangent (null) shrinks these products and is never
// loaded.
#include <cstdint>

#include <math_constants.h>

#include "cuda/attention.h"
#include "cuda/attention_kernels.h"
#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda::attention_kernels {
namespace {

using namespace attention_tiles;

// block_gemm's allow_tf32: these kernels compute in full float32.
constexpr bool kFullFloat32 = false;

// -- shared-memory layouts -------------------------------------------------------------

template <typename T>
struct FwdShared {
  T* q;             // [kBr][ld_t]
  T* k;             // [kBc][ld_t]
  T* v;             // [kBc][ld_tv]
  float* s;         // [kBr][ld_s] logits
  T* p;             // [kBr][ld_p] probabilities
  float* o;         // [kBr][ld_ov] unnormalised output
  float* row_max;   // [kBr]
  float* row_sum;   // [kBr]
  size_t bytes;
  __host__ __device__ FwdShared(unsigned char* base, const Strides& st, int br, int bc) {
    SharedCarver c(base);
    q = c.take<T>(int64_t{br} * st.ld_t);
    k = c.take<T>(int64_t{bc} * st.ld_t);
    v = c.take<T>(int64_t{bc} * st.ld_tv);
    s = c.take<float>(int64_t{br} * st.ld_s);
    p = c.take<T>(int64_t{br} * st.ld_p);
    o = c.take<float>(int64_t{br} * st.ld_ov);
    row_max = c.take<float>(br);
    row_sum = c.take<float>(br);
    bytes = c.used();
  }
};

// Both backward kernels: the query-side and key-side tiles, P and dS.
template <typename T>
struct BwdShared {
  T* q;          // [kBr][ld_t]
  T* dout;       // [kBr][ld_tv]
  T* k;          // [kBc][ld_t]
  T* v;          // [kBc][ld_tv]
  float* s;      // [kBr][ld_s] logits, then P
  float* dp;     // [kBr][ld_s] dO V^T
  T* p;          // [kBr][ld_p]
  T* ds;         // [kBr][ld_p]
  float* acc0;   // dk/dv: dK [kBc][ld_o]; dq: dQ [kBr][ld_o]
  float* acc1;   // dk/dv: dV [kBc][ld_ov]; dq: unused
  float* row_lse;
  float* row_d;
  size_t bytes;
  __host__ __device__ BwdShared(unsigned char* base, const Strides& st, int br, int bc,
                                bool key_side) {
    SharedCarver c(base);
    q = c.take<T>(int64_t{br} * st.ld_t);
    dout = c.take<T>(int64_t{br} * st.ld_tv);
    k = c.take<T>(int64_t{bc} * st.ld_t);
    v = c.take<T>(int64_t{bc} * st.ld_tv);
    s = c.take<float>(int64_t{br} * st.ld_s);
    dp = c.take<float>(int64_t{br} * st.ld_s);
    p = c.take<T>(int64_t{br} * st.ld_p);
    ds = c.take<T>(int64_t{br} * st.ld_p);
    acc0 = c.take<float>(int64_t{key_side ? bc : br} * st.ld_o);
    acc1 = key_side ? c.take<float>(int64_t{bc} * st.ld_ov) : nullptr;
    row_lse = c.take<float>(br);
    row_d = c.take<float>(br);
    bytes = c.used();
  }
};

// -- forward ---------------------------------------------------------------------------

// With segment ids, whether the block's rows (ids `rows`) share a document
// with any of keys [begin, end) (or its keys with those query rows): every
// thread computes the same answer from the same ids, so a tile that shares
// none is skipped by the whole block before it is loaded.
__device__ __forceinline__ bool tile_meets(const Segments& ids, const IdRange& rows,
                                           const int32_t* other, int64_t begin, int64_t end) {
  return !ids.on() || rows.meets(warp_id_range(other, begin, end));
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_kernel(AttentionParams p, int hp, int hvp, const T* query, const T* key,
                         const T* value, T* out, float* logsumexp) {
  const Strides st(hp, hvp, kBc);
  FwdShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc);
  const BlockIndex at = block_index(p.q_len, kBr, p.num_heads, p.num_heads / p.num_kv_heads);
  const int64_t b = at.b, n = at.head, kv_head = at.kv_head, t0 = at.row0;
  const HeadView h = head_view(p, b, n);
  constexpr int kRowThreads = row_threads<kBr>();
  const int64_t hdv = attention_tiles::value_head_dim(p);
  const Segments ids = segments_of(p, b);
  const SoftCap cap = soft_cap(p, 1.0f);
  const IdRange row_ids = ids.on() ? warp_id_range(ids.q, t0, min64(t0 + kBr, h.q_valid))
                                   : IdRange{0, 0};

  load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  zero(sh.o, st.ld_ov, kBr, hvp);
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    sh.row_max[r] = -CUDART_INF_F;
    sh.row_sum[r] = 0.0f;
  }
  const Range keys = key_range(p, h, t0, t0 + kBr);
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    if (!tile_meets(ids, row_ids, ids.kv, max64(j0, keys.begin), min64(j0 + kBc, keys.end))) {
      continue;
    }
    __syncthreads();  // the previous tile's readers of k, v and p are done
    load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp,
              keys.begin, keys.end);
    load_rows(sh.v, st.ld_tv, value, b, p.kv_len, p.num_kv_heads, kv_head, hdv, j0, kBc, hvp,
              keys.begin, keys.end);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp,
                                   kFullFloat32);
    __syncthreads();
    for (int i = threadIdx.x; i < kBr * kBc; i += kThreads) {
      const int r = i / kBc, c = i % kBc;
      float& x = sh.s[r * st.ld_s + c];
      x = logit(p, h, ids, cap, t0 + r, j0 + c, x);
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
      for (int c = sub; c < hvp; c += kRowThreads) sh.o[r * st.ld_ov + c] *= alpha;
      __syncwarp();  // the row's threads have read row_max[r]
      if (sub == 0) {
        sh.row_max[r] = new_max;
        sh.row_sum[r] = sh.row_sum[r] * alpha + sum;
      }
    }
    __syncthreads();
    block_gemm<false, false, true>(sh.o, st.ld_ov, sh.p, st.ld_p, sh.v, st.ld_tv, kBr, hvp, kBc,
                                   kFullFloat32);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBr * hvp; i += kThreads) {
    const int r = i / hvp, c = i % hvp;
    const int64_t t = t0 + r;
    if (t >= p.q_len || c >= hdv) continue;
    const float sum = sh.row_sum[r];
    out[((b * p.q_len + t) * p.num_heads + n) * hdv + c] =
        from_float<T>(sum != 0.0f ? sh.o[r * st.ld_ov + c] / sum : 0.0f);  // NaN sum: NaN row
  }
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    const int64_t t = t0 + r;
    if (t >= p.q_len) continue;
    const float sum = sh.row_sum[r];
    logsumexp[(b * p.num_heads + n) * p.q_len + t] =
        sum != 0.0f ? sh.row_max[r] + logf(sum) : -CUDART_INF_F;
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
// dbias, dS is added to it. With a soft cap, sh.ds takes dS by the uncapped
// logit (times the cap's slope: dQ and dK), dbias dS by the capped one.
template <typename T, int kBr, int kBc>
__device__ __forceinline__ void probabilities_and_dscores(const AttentionParams& p, const HeadView& h,
                                          const Segments& ids, const SoftCap& cap,
                                          const Strides& st, BwdShared<T>& sh, int64_t t0,
                                          int64_t j0, float* dbias) {
  for (int i = threadIdx.x; i < kBr * kBc; i += kThreads) {
    const int r = i / kBc, c = i % kBc;
    float slope = 1.0f;
    const float x = logit(p, h, ids, cap, t0 + r, j0 + c, sh.s[r * st.ld_s + c], &slope);
    const float lse = sh.row_lse[r];
    const float prob = x == -CUDART_INF_F || lse == -CUDART_INF_F ? 0.0f : __expf(x - lse);
    // A masked key has dS = 0 even when its dP is NaN (a NaN V row the row
    // does not attend).
    const float dscore = x == -CUDART_INF_F ? 0.0f : prob * (sh.dp[r * st.ld_s + c] - sh.row_d[r]);
    sh.s[r * st.ld_s + c] = prob;
    sh.p[r * st.ld_p + c] = from_float<T>(prob);
    sh.ds[r * st.ld_p + c] = from_float<T>(dscore * slope);
    if (dbias != nullptr && x != -CUDART_INF_F) {
      atomicAdd(dbias + broadcast_offset(p.bias_strides, h, t0 + r, j0 + c), dscore);
    }
  }
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dkdv_kernel(AttentionParams p, int hp, int hvp, const T* query, const T* key,
                              const T* value, const float* logsumexp, const T* dout,
                              const float* d, T* dkey, T* dvalue) {
  const Strides st(hp, hvp, kBc);
  BwdShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc, true);
  const BlockIndex at = block_index(p.kv_len, kBc, p.num_kv_heads, 1);
  const int64_t b = at.b, kv_head = at.head, j0 = at.row0;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t hdv = attention_tiles::value_head_dim(p);
  const Segments ids = segments_of(p, b);
  const SoftCap cap = soft_cap(p, 1.0f);

  // Keys past the batch's KV length are never read (whatever they hold).
  const int64_t kv_valid = head_view(p, b, kv_head * group).kv_valid;
  const IdRange key_ids = ids.on() ? warp_id_range(ids.kv, j0, min64(j0 + kBc, kv_valid))
                                   : IdRange{0, 0};
  load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp, 0,
            kv_valid);
  load_rows(sh.v, st.ld_tv, value, b, p.kv_len, p.num_kv_heads, kv_head, hdv, j0, kBc, hvp, 0,
            kv_valid);
  zero(sh.acc0, st.ld_o, kBc, hp);
  zero(sh.acc1, st.ld_ov, kBc, hvp);
  for (int64_t n = kv_head * group; n < (kv_head + 1) * group; ++n) {
    const HeadView h = head_view(p, b, n);
    const Range rows = query_range(p, h, j0, j0 + kBc);
    for (int64_t t0 = rows.begin / kBr * kBr; t0 < rows.end; t0 += kBr) {
      if (!tile_meets(ids, key_ids, ids.q, max64(t0, rows.begin), min64(t0 + kBr, rows.end))) {
        continue;
      }
      __syncthreads();  // the previous tile's readers of q, dout, p, ds are done
      load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp,
                rows.begin, rows.end);
      load_rows(sh.dout, st.ld_tv, dout, b, p.q_len, p.num_heads, n, hdv, t0, kBr, hvp,
                rows.begin, rows.end);
      load_row_stats(p, b, n, t0, kBr, logsumexp, d, sh.row_lse, sh.row_d);
      __syncthreads();
      block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp,
                                     kFullFloat32);
      block_gemm<false, true, false>(sh.dp, st.ld_s, sh.dout, st.ld_tv, sh.v, st.ld_tv, kBr, kBc,
                                     hvp, kFullFloat32);
      __syncthreads();
      probabilities_and_dscores<T, kBr, kBc>(p, h, ids, cap, st, sh, t0, j0, nullptr);
      __syncthreads();
      block_gemm<true, false, true>(sh.acc1, st.ld_ov, sh.p, st.ld_p, sh.dout, st.ld_tv, kBc,
                                    hvp, kBr, kFullFloat32);
      block_gemm<true, false, true>(sh.acc0, st.ld_o, sh.ds, st.ld_p, sh.q, st.ld_t, kBc, hp,
                                    kBr, kFullFloat32);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBc * hp; i += kThreads) {
    const int r = i / hp, c = i % hp;
    const int64_t j = j0 + r;
    if (j >= p.kv_len || c >= p.head_dim) continue;
    const int64_t at = ((b * p.kv_len + j) * p.num_kv_heads + kv_head) * p.head_dim + c;
    dkey[at] = from_float<T>(p.scale * sh.acc0[r * st.ld_o + c]);
  }
  for (int i = threadIdx.x; i < kBc * hvp; i += kThreads) {
    const int r = i / hvp, c = i % hvp;
    const int64_t j = j0 + r;
    if (j >= p.kv_len || c >= hdv) continue;
    const int64_t at = ((b * p.kv_len + j) * p.num_kv_heads + kv_head) * hdv + c;
    dvalue[at] = from_float<T>(sh.acc1[r * st.ld_ov + c]);
  }
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_kernel(AttentionParams p, int hp, int hvp, const T* query, const T* key,
                            const T* value, const float* logsumexp, const T* dout,
                            const float* d, T* dquery, float* dbias) {
  const Strides st(hp, hvp, kBc);
  BwdShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc, false);
  const BlockIndex at = block_index(p.q_len, kBr, p.num_heads, p.num_heads / p.num_kv_heads);
  const int64_t b = at.b, n = at.head, kv_head = at.kv_head, t0 = at.row0;
  const HeadView h = head_view(p, b, n);
  const int64_t hdv = attention_tiles::value_head_dim(p);
  const Segments ids = segments_of(p, b);
  const SoftCap cap = soft_cap(p, 1.0f);
  const IdRange row_ids = ids.on() ? warp_id_range(ids.q, t0, min64(t0 + kBr, h.q_valid))
                                   : IdRange{0, 0};

  load_rows(sh.q, st.ld_t, query, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  load_rows(sh.dout, st.ld_tv, dout, b, p.q_len, p.num_heads, n, hdv, t0, kBr, hvp);
  load_row_stats(p, b, n, t0, kBr, logsumexp, d, sh.row_lse, sh.row_d);
  zero(sh.acc0, st.ld_o, kBr, hp);
  const Range keys = key_range(p, h, t0, t0 + kBr);
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    if (!tile_meets(ids, row_ids, ids.kv, max64(j0, keys.begin), min64(j0 + kBc, keys.end))) {
      continue;
    }
    __syncthreads();  // the previous tile's readers of k and ds are done
    load_rows(sh.k, st.ld_t, key, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp,
              keys.begin, keys.end);
    load_rows(sh.v, st.ld_tv, value, b, p.kv_len, p.num_kv_heads, kv_head, hdv, j0, kBc, hvp,
              keys.begin, keys.end);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, sh.q, st.ld_t, sh.k, st.ld_t, kBr, kBc, hp,
                                   kFullFloat32);
    block_gemm<false, true, false>(sh.dp, st.ld_s, sh.dout, st.ld_tv, sh.v, st.ld_tv, kBr, kBc,
                                   hvp, kFullFloat32);
    __syncthreads();
    probabilities_and_dscores<T, kBr, kBc>(p, h, ids, cap, st, sh, t0, j0, dbias);
    __syncthreads();
    block_gemm<false, false, true>(sh.acc0, st.ld_o, sh.ds, st.ld_p, sh.k, st.ld_t, kBr, hp, kBc,
                                   kFullFloat32);
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
size_t fwd_shared_bytes(int hp, int hvp, int br, int bc) {
  return FwdShared<T>(nullptr, Strides(hp, hvp, bc), br, bc).bytes;
}

template <typename T>
size_t bwd_shared_bytes(int hp, int hvp, int br, int bc) {
  const Strides st(hp, hvp, bc);
  const size_t key_side = BwdShared<T>(nullptr, st, br, bc, true).bytes;
  const size_t query_side = BwdShared<T>(nullptr, st, br, bc, false).bytes;
  return key_side > query_side ? key_side : query_side;
}

template <typename T, int kBr, int kBc>
cudaError_t launch_fwd(cudaStream_t stream, const AttentionParams& p, int hp, int hvp, const T* q,
                       const T* k, const T* v, T* out, float* lse) {
  const int64_t grid = blocks(p.q_len, kBr, p.batch * p.num_heads);
  if (!fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_fwd_kernel<T, kBr, kBc>,
                                      dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                                      fwd_shared_bytes<T>(hp, hvp, kBr, kBc), stream, p, hp, hvp,
                                      q, k, v, out, lse);
}

template <typename T, int kBr, int kBc>
cudaError_t launch_bwd(cudaStream_t stream, const AttentionParams& p, int hp, int hvp,
                       const T* q, const T* k, const T* v, const float* lse, const T* dout,
                       const float* d, T* dq, T* dk, T* dv, float* dbias) {
  const size_t shared = bwd_shared_bytes<T>(hp, hvp, kBr, kBc);
  if (p.kv_len > 0) {
    const int64_t grid = blocks(p.kv_len, kBc, p.batch * p.num_kv_heads);
    if (!fits_grid(grid)) return cudaErrorInvalidValue;
    const cudaError_t status = launch_kernel_dynamic_shared(
        attention_bwd_dkdv_kernel<T, kBr, kBc>, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
        shared, stream, p, hp, hvp, q, k, v, lse, dout, d, dk, dv);
    if (status != cudaSuccess) return status;
  }
  const int64_t grid = blocks(p.q_len, kBr, p.batch * p.num_heads);
  if (!fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_bwd_dq_kernel<T, kBr, kBc>,
                                      dim3(static_cast<unsigned>(grid)), dim3(kThreads), shared,
                                      stream, p, hp, hvp, q, k, v, lse, dout, d, dq, dbias);
}

// Leading dimensions beyond the forward's: the side-by-side pairs over the
// head dim ([dQ | Q], [K | dK]) and over the keys ([e (ds - c) | e]).
struct JvpStrides : Strides {
  int ld_pair;   // T [rows][2 hp + 8]
  int ld_probs;  // T [kBr][2 kBc + 8]
  __host__ __device__ JvpStrides(int hp_, int hvp_, int bc)
      : Strides(hp_, hvp_, bc), ld_pair(2 * hp_ + 8), ld_probs(2 * bc + 8) {}
};

template <typename T>
struct JvpShared {
  T* queries;        // [kBr][ld_pair]: dQ in columns [0, hp), Q in [hp, 2 hp)
  T* keys;           // [kBc][ld_pair] K | dK, then [2 kBc][ld_tv] V over dV
  float* s;          // [kBr][ld_s] logits, then e
  float* ds;         // [kBr][ld_s] logit tangents
  T* probs;          // [kBr][ld_probs]: e (ds - c) in columns [0, kBc), e in [kBc, 2 kBc)
  float* o;          // [kBr][ld_ov] O
  float* a;          // [kBr][ld_ov] A
  float* row_max;    // [kBr] m
  float* row_sum;    // [kBr] l
  float* row_dsum;   // [kBr] M
  float* row_shift;  // [kBr] c
  size_t bytes;
  __host__ __device__ JvpShared(unsigned char* base, const JvpStrides& st, int br, int bc) {
    SharedCarver c(base);
    queries = c.take<T>(int64_t{br} * st.ld_pair);
    // The stacked V, dV (2 kBc rows of ld_tv) or kBc rows of ld_pair (K | dK).
    const int64_t pairs = int64_t{bc} * st.ld_pair, stacked = int64_t{2 * bc} * st.ld_tv;
    keys = c.take<T>(pairs > stacked ? pairs : stacked);
    s = c.take<float>(int64_t{br} * st.ld_s);
    ds = c.take<float>(int64_t{br} * st.ld_s);
    probs = c.take<T>(int64_t{br} * st.ld_probs);
    o = c.take<float>(int64_t{br} * st.ld_ov);
    a = c.take<float>(int64_t{br} * st.ld_ov);
    float** const row_statistics[] = {&row_max, &row_sum, &row_dsum, &row_shift};
    for (float** row : row_statistics) *row = c.take<float>(br);
    bytes = c.used();
  }
};

// scale * dot * slope + dbias for an attended (t, j) (logit x finite; slope:
// the soft cap's, which multiplies the products' tangent only), 0 for a masked
// one: a masked key contributes nothing, whatever the bias tangent holds there.
__device__ __forceinline__ float logit_tangent(const AttentionParams& p, const HeadView& h,
                                               int64_t t, int64_t j, float x, float dot,
                                               float slope, const float* dbias) {
  if (x == -CUDART_INF_F) return 0.0f;
  float dx = p.scale * dot * slope;
  if (dbias != nullptr) dx += dbias[broadcast_offset(p.bias_strides, h, t, j)];
  return dx;
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_jvp_kernel(AttentionParams p, int hp, int hvp, JvpTensors<T> tensors) {
  const JvpStrides st(hp, hvp, kBc);
  JvpShared<T> sh(dynamic_shared_memory<unsigned char>(), st, kBr, kBc);
  const BlockIndex at = block_index(p.q_len, kBr, p.num_heads, p.num_heads / p.num_kv_heads);
  const int64_t b = at.b, n = at.head, kv_head = at.kv_head, t0 = at.row0;
  const HeadView h = head_view(p, b, n);
  constexpr int kRowThreads = row_threads<kBr>();
  // Which tangent products run (the same for the whole block).
  const bool dot_tangents = tensors.dquery != nullptr || tensors.dkey != nullptr;
  const bool logit_tangents = dot_tangents || tensors.dbias != nullptr;
  const bool output_tangents = logit_tangents || tensors.dvalue != nullptr;
  // Column ranges of the [dQ | Q] [K | dK]^T and [e (ds - c) | e] [V ; dV]
  // products that hold present tangents.
  const int dot_first = tensors.dquery != nullptr ? 0 : hp;
  const int dot_last = tensors.dkey != nullptr ? 2 * hp : hp;
  const int acc_first = logit_tangents ? 0 : kBc;
  const int acc_last = tensors.dvalue != nullptr ? 2 * kBc : kBc;
  T* const q_tile = sh.queries + hp;
  T* const e_tile = sh.probs + kBc;

  const int64_t hdv = attention_tiles::value_head_dim(p);
  const Segments ids = segments_of(p, b);
  const SoftCap cap = soft_cap(p, 1.0f);
  const IdRange row_ids = ids.on() ? warp_id_range(ids.q, t0, min64(t0 + kBr, h.q_valid))
                                   : IdRange{0, 0};
  const Range keys = key_range(p, h, t0, t0 + kBr);
  // Rows of this block's query head and of its key/value head into tiles
  // (keys outside the rows' range are zeros, see load_rows).
  const auto load_query_rows = [&](T* tile, const T* x) {
    load_rows(tile, st.ld_pair, x, b, p.q_len, p.num_heads, n, p.head_dim, t0, kBr, hp);
  };
  const auto load_key_rows = [&](T* tile, int ld, const T* x, int64_t j0) {
    load_rows(tile, ld, x, b, p.kv_len, p.num_kv_heads, kv_head, p.head_dim, j0, kBc, hp,
              keys.begin, keys.end);
  };
  const auto load_value_rows = [&](T* tile, const T* x, int64_t j0) {
    load_rows(tile, st.ld_tv, x, b, p.kv_len, p.num_kv_heads, kv_head, hdv, j0, kBc, hvp,
              keys.begin, keys.end);
  };

  load_query_rows(q_tile, tensors.query);
  if (tensors.dquery != nullptr) load_query_rows(sh.queries, tensors.dquery);
  zero(sh.o, st.ld_ov, kBr, hvp);
  zero(sh.a, st.ld_ov, kBr, hvp);
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    sh.row_max[r] = -CUDART_INF_F;
    sh.row_sum[r] = 0.0f;
    sh.row_dsum[r] = 0.0f;
    sh.row_shift[r] = 0.0f;
  }
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    if (!tile_meets(ids, row_ids, ids.kv, max64(j0, keys.begin), min64(j0 + kBc, keys.end))) {
      continue;
    }
    __syncthreads();  // the previous tile's readers of keys and probs are done
    load_key_rows(sh.keys, st.ld_pair, tensors.key, j0);
    if (tensors.dkey != nullptr) load_key_rows(sh.keys + hp, st.ld_pair, tensors.dkey, j0);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, q_tile, st.ld_pair, sh.keys, st.ld_pair, kBr,
                                   kBc, hp, kFullFloat32);
    if (dot_tangents) {
      block_gemm<false, true, false>(sh.ds, st.ld_s, sh.queries + dot_first, st.ld_pair,
                                     sh.keys + dot_first, st.ld_pair, kBr, kBc,
                                     dot_last - dot_first, kFullFloat32);
    }
    __syncthreads();
    // The products are done with K and dK: V and dV take their place while
    // the logits are masked.
    load_value_rows(sh.keys, tensors.value, j0);
    if (tensors.dvalue != nullptr) load_value_rows(sh.keys + kBc * st.ld_tv, tensors.dvalue, j0);
    for (int i = threadIdx.x; i < kBr * kBc; i += kThreads) {
      const int r = i / kBc, c = i % kBc;
      float& s = sh.s[r * st.ld_s + c];
      float slope = 1.0f;
      s = logit(p, h, ids, cap, t0 + r, j0 + c, s, &slope);
      if (logit_tangents) {
        float& ds = sh.ds[r * st.ld_s + c];
        ds = logit_tangent(p, h, t0 + r, j0 + c, s, dot_tangents ? ds : 0.0f, slope,
                           tensors.dbias);
      }
    }
    __syncthreads();
    // Online softmax, kRowThreads neighbouring threads per row, with the
    // tangent terms; the row's accumulators are rescaled here too.
    {
      const int r = static_cast<int>(threadIdx.x) / kRowThreads;
      const int sub = static_cast<int>(threadIdx.x) % kRowThreads;
      float* s_row = sh.s + r * st.ld_s;
      const float* ds_row = sh.ds + r * st.ld_s;
      T* probs_row = sh.probs + r * st.ld_probs;
      float tile_max = -CUDART_INF_F;
      for (int c = sub; c < kBc; c += kRowThreads) tile_max = fmaxf(tile_max, s_row[c]);
      tile_max = group_max<kRowThreads>(tile_max);
      const float old_max = sh.row_max[r], old_sum = sh.row_sum[r];
      const float new_max = fmaxf(old_max, tile_max);
      float sum = 0.0f, weighted = 0.0f;
      for (int c = sub; c < kBc; c += kRowThreads) {
        const float s = s_row[c];
        const float e = s == -CUDART_INF_F ? 0.0f : __expf(s - new_max);
        s_row[c] = e;
        probs_row[kBc + c] = from_float<T>(e);
        sum += e;
        if (logit_tangents) weighted += e * ds_row[c];
      }
      sum = group_sum<kRowThreads>(sum);
      const float alpha = old_max == -CUDART_INF_F ? 0.0f : __expf(old_max - new_max);
      float shift = sh.row_shift[r], dsum = 0.0f, move = 0.0f;
      if (logit_tangents) {
        weighted = group_sum<kRowThreads>(weighted);
        // A tile that raises the row's maximum gives it its shift; A and M,
        // which hold e (ds - c_old), move to it: A += (c_old - c_new) O and
        // M += (c_old - c_new) l, before alpha rescales them.
        if (new_max > old_max) {
          const float new_shift = weighted / sum;
          if (old_max != -CUDART_INF_F) move = shift - new_shift;
          shift = new_shift;
        }
        for (int c = sub; c < kBc; c += kRowThreads) {
          const float centred = s_row[c] * (ds_row[c] - shift);
          probs_row[c] = from_float<T>(centred);
          dsum += centred;
        }
        dsum = group_sum<kRowThreads>(dsum);
      }
      for (int c = sub; c < hvp; c += kRowThreads) {
        sh.a[r * st.ld_ov + c] = (sh.a[r * st.ld_ov + c] + move * sh.o[r * st.ld_ov + c]) * alpha;
        sh.o[r * st.ld_ov + c] *= alpha;
      }
      __syncwarp();  // the row's threads have read its statistics
      if (sub == 0) {
        sh.row_max[r] = new_max;
        sh.row_sum[r] = old_sum * alpha + sum;
        sh.row_dsum[r] = (sh.row_dsum[r] + move * old_sum) * alpha + dsum;
        sh.row_shift[r] = shift;
      }
    }
    __syncthreads();
    block_gemm<false, false, true>(sh.o, st.ld_ov, e_tile, st.ld_probs, sh.keys, st.ld_tv, kBr,
                                   hvp, kBc, kFullFloat32);
    if (output_tangents) {
      block_gemm<false, false, true>(sh.a, st.ld_ov, sh.probs + acc_first, st.ld_probs,
                                     sh.keys + acc_first * st.ld_tv, st.ld_tv, kBr, hvp,
                                     acc_last - acc_first, kFullFloat32);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBr * hvp; i += kThreads) {
    const int r = i / hvp, c = i % hvp;
    const int64_t t = t0 + r;
    if (t >= p.q_len || c >= hdv) continue;
    const float sum = sh.row_sum[r];
    float o = 0.0f, dout = 0.0f;
    if (sum != 0.0f) {  // NaN sum: a NaN row
      o = sh.o[r * st.ld_ov + c] / sum;
      dout = sh.a[r * st.ld_ov + c] / sum - sh.row_dsum[r] / sum * o;
    }
    const int64_t offset = ((b * p.q_len + t) * p.num_heads + n) * hdv + c;
    tensors.out[offset] = from_float<T>(o);
    tensors.dout[offset] = from_float<T>(dout);
  }
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    const int64_t t = t0 + r;
    if (t >= p.q_len) continue;
    const float sum = sh.row_sum[r];
    const int64_t offset = (b * p.num_heads + n) * p.q_len + t;
    tensors.logsumexp[offset] = sum != 0.0f ? sh.row_max[r] + logf(sum) : -CUDART_INF_F;
    tensors.dlogsumexp[offset] = sum != 0.0f ? sh.row_dsum[r] / sum + sh.row_shift[r] : 0.0f;
  }
}

// -- launch ----------------------------------------------------------------------------

template <typename T>
size_t jvp_shared_bytes(int hp, int hvp, int br, int bc) {
  return JvpShared<T>(nullptr, JvpStrides(hp, hvp, bc), br, bc).bytes;
}

template <typename T, int kBr, int kBc>
cudaError_t launch_fwd_jvp(cudaStream_t stream, const AttentionParams& p, int hp, int hvp,
                           const JvpTensors<T>& tensors) {
  const int64_t grid = blocks(p.q_len, kBr, p.batch * p.num_heads);
  if (!fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_fwd_jvp_kernel<T, kBr, kBc>,
                                      dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                                      jvp_shared_bytes<T>(hp, hvp, kBr, kBc), stream, p, hp, hvp,
                                      tensors);
}

}  // namespace

cudaError_t simt_fwd(cudaStream_t stream, const AttentionParams& p, const float* query,
                     const float* key, const float* value, float* out, float* logsumexp) {
  const int hp = padded_head_dim(p.head_dim);
  const int hvp = padded_head_dim(attention_tiles::value_head_dim(p));
  if (fwd_shared_bytes<float>(hp, hvp, 64, 64) <= kSharedBudget) {
    return launch_fwd<float, 64, 64>(stream, p, hp, hvp, query, key, value, out, logsumexp);
  }
  return launch_fwd<float, 32, 32>(stream, p, hp, hvp, query, key, value, out, logsumexp);
}

cudaError_t simt_bwd(cudaStream_t stream, const AttentionParams& p, const float* query,
                     const float* key, const float* value, const float* logsumexp,
                     const float* dout, const float* d, float* dquery, float* dkey,
                     float* dvalue, float* dbias) {
  const int hp = padded_head_dim(p.head_dim);
  const int hvp = padded_head_dim(attention_tiles::value_head_dim(p));
  if (bwd_shared_bytes<float>(hp, hvp, 64, 64) <= kSharedBudget) {
    return launch_bwd<float, 64, 64>(stream, p, hp, hvp, query, key, value, logsumexp, dout, d,
                                     dquery, dkey, dvalue, dbias);
  }
  if (bwd_shared_bytes<float>(hp, hvp, 32, 32) <= kSharedBudget) {
    return launch_bwd<float, 32, 32>(stream, p, hp, hvp, query, key, value, logsumexp, dout, d,
                                     dquery, dkey, dvalue, dbias);
  }
  return launch_bwd<float, 16, 16>(stream, p, hp, hvp, query, key, value, logsumexp, dout, d,
                                   dquery, dkey, dvalue, dbias);
}

cudaError_t simt_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const float* query,
                         const float* key, const float* value, const float* dquery,
                         const float* dkey, const float* dvalue, const float* dbias, float* out,
                         float* logsumexp, float* dout, float* dlogsumexp) {
  const JvpTensors<float> tensors{query, key,   value, dquery,    dkey,
                                  dvalue, dbias, out,   logsumexp, dout, dlogsumexp};
  const int hp = padded_head_dim(p.head_dim);
  const int hvp = padded_head_dim(attention_tiles::value_head_dim(p));
  if (jvp_shared_bytes<float>(hp, hvp, 64, 64) <= kSharedBudget) {
    return launch_fwd_jvp<float, 64, 64>(stream, p, hp, hvp, tensors);
  }
  if (jvp_shared_bytes<float>(hp, hvp, 32, 32) <= kSharedBudget) {
    return launch_fwd_jvp<float, 32, 32>(stream, p, hp, hvp, tensors);
  }
  return launch_fwd_jvp<float, 16, 16>(stream, p, hp, hvp, tensors);
}

}  // namespace jaxops::cuda::attention_kernels
