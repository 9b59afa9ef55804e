// Forward-mode flash attention on CUDA: out, logsumexp and their tangents in
// one pass over K/V (see attention.h for the contract).
//
// The forward kernel's design (attention.cu) with the tangent of every product
// carried along. A block owns kBr query rows of one (batch, head) and walks
// their key tiles. With the logits s_ij, their tangents
//   ds_ij = scale (dq_i.k_j + q_i.dk_j) + dbias_ij
// and e_ij = exp(s_ij - m_i) of the online softmax (running max m_i, sum l_i),
// it accumulates, all rescaled with the running max as the output is,
//   O_i = sum_j e_ij v_j
//   A_i = sum_j e_ij (ds_ij - c_i) v_j + e_ij dv_j
//   M_i = sum_j e_ij (ds_ij - c_i)
// and ends with out = O / l, dlogsumexp = M / l + c, dout = A / l - (M / l) out
// (= sum_j p_ij (ds_ij - dlogsumexp) v_j + p_ij dv_j). The shift c_i, the
// e-weighted mean of ds over the row's first attended tile, keeps A and M
// small where ds has a large common part along the row (a large mean of the
// keys, a bias tangent constant along keys): dout is then the difference of
// two small terms, not of two large ones, which matters once e (ds - c) is
// rounded to bfloat16/float16 for the tensor cores.
//
// Tangents sit next to their primals in the tiles, so each tangent sum is one
// product: [dQ | Q] is one tile with dQ in the first hp columns, [K | dK]
// another, and dS = [dQ | Q] [K | dK]^T is a single product over 2 hp columns
// (over hp when one of dq, dk is absent); then V and dV replace K and dK,
// stacked, and with [e (ds - c) | e] one tile, A += [e (ds - c) | e] [V ; dV]
// is a single product over 2 kBc keys and O += e V uses its right half. An
// absent tangent (null) shrinks these products and is never loaded; with no
// tangent of the logits the ds tile is neither computed nor read. One buffer
// holds K | dK and then V ; dV; even so the tangents take more shared memory
// than the forward, and 64x64 tiles fit head dims up to 48 in float32 and 96
// in bfloat16/float16 (the forward's: 112 and 192); 32x32 above, and 16x16
// for float32 above 176.
#include "cuda/attention.h"

#include <cstdint>

#include <math_constants.h>

#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using namespace attention_tiles;

// The operands and results of one call; null tangents are zero.
template <typename T>
struct JvpTensors {
  const T* query;
  const T* key;
  const T* value;
  const T* dquery;
  const T* dkey;
  const T* dvalue;
  const float* dbias;
  T* out;
  float* logsumexp;
  T* dout;
  float* dlogsumexp;
};

// Leading dimensions beyond the forward's: the side-by-side pairs over the
// head dim ([dQ | Q], [K | dK]) and over the keys ([e (ds - c) | e]).
struct JvpStrides : Strides {
  int ld_pair;   // T [rows][2 hp + 8]
  int ld_probs;  // T [kBr][2 kBc + 8]
  __host__ __device__ JvpStrides(int hp_, int bc)
      : Strides(hp_, bc), ld_pair(2 * hp_ + 8), ld_probs(2 * bc + 8) {}
};

template <typename T>
struct JvpShared {
  T* queries;        // [kBr][ld_pair]: dQ in columns [0, hp), Q in [hp, 2 hp)
  T* keys;           // [kBc][ld_pair] K | dK, then [2 kBc][ld_t] V over dV
  float* s;          // [kBr][ld_s] logits, then e
  float* ds;         // [kBr][ld_s] logit tangents
  T* probs;          // [kBr][ld_probs]: e (ds - c) in columns [0, kBc), e in [kBc, 2 kBc)
  float* o;          // [kBr][ld_o] O
  float* a;          // [kBr][ld_o] A
  float* row_max;    // [kBr] m
  float* row_sum;    // [kBr] l
  float* row_dsum;   // [kBr] M
  float* row_shift;  // [kBr] c
  size_t bytes;
  __host__ __device__ JvpShared(unsigned char* base, const JvpStrides& st, int br, int bc) {
    SharedCarver c(base);
    queries = c.take<T>(int64_t{br} * st.ld_pair);
    // 2 kBc rows of ld_t hold the stacked V, dV and cover kBc rows of ld_pair.
    keys = c.take<T>(int64_t{2 * bc} * st.ld_t);
    s = c.take<float>(int64_t{br} * st.ld_s);
    ds = c.take<float>(int64_t{br} * st.ld_s);
    probs = c.take<T>(int64_t{br} * st.ld_probs);
    o = c.take<float>(int64_t{br} * st.ld_o);
    a = c.take<float>(int64_t{br} * st.ld_o);
    float** const row_statistics[] = {&row_max, &row_sum, &row_dsum, &row_shift};
    for (float** row : row_statistics) *row = c.take<float>(br);
    bytes = c.used();
  }
};

// scale * dot + dbias for an attended (t, j) (logit x finite), 0 for a masked
// one: a masked key contributes nothing, whatever the bias tangent holds there.
__device__ __forceinline__ float logit_tangent(const AttentionParams& p, const HeadView& h,
                                               int64_t t, int64_t j, float x, float dot,
                                               const float* dbias) {
  if (x == -CUDART_INF_F) return 0.0f;
  float dx = p.scale * dot;
  if (dbias != nullptr) dx += dbias[broadcast_offset(p.bias_strides, h, t, j)];
  return dx;
}

template <typename T, int kBr, int kBc>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_jvp_kernel(AttentionParams p, int hp, JvpTensors<T> tensors) {
  const JvpStrides st(hp, kBc);
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

  load_query_rows(q_tile, tensors.query);
  if (tensors.dquery != nullptr) load_query_rows(sh.queries, tensors.dquery);
  zero(sh.o, st.ld_o, kBr, hp);
  zero(sh.a, st.ld_o, kBr, hp);
  for (int r = threadIdx.x; r < kBr; r += kThreads) {
    sh.row_max[r] = -CUDART_INF_F;
    sh.row_sum[r] = 0.0f;
    sh.row_dsum[r] = 0.0f;
    sh.row_shift[r] = 0.0f;
  }
  for (int64_t j0 = keys.begin / kBc * kBc; j0 < keys.end; j0 += kBc) {
    __syncthreads();  // the previous tile's readers of keys and probs are done
    load_key_rows(sh.keys, st.ld_pair, tensors.key, j0);
    if (tensors.dkey != nullptr) load_key_rows(sh.keys + hp, st.ld_pair, tensors.dkey, j0);
    __syncthreads();
    block_gemm<false, true, false>(sh.s, st.ld_s, q_tile, st.ld_pair, sh.keys, st.ld_pair, kBr,
                                   kBc, hp, p.allow_tf32);
    if (dot_tangents) {
      block_gemm<false, true, false>(sh.ds, st.ld_s, sh.queries + dot_first, st.ld_pair,
                                     sh.keys + dot_first, st.ld_pair, kBr, kBc,
                                     dot_last - dot_first, p.allow_tf32);
    }
    __syncthreads();
    // The products are done with K and dK: V and dV take their place while
    // the logits are masked.
    load_key_rows(sh.keys, st.ld_t, tensors.value, j0);
    if (tensors.dvalue != nullptr) {
      load_key_rows(sh.keys + kBc * st.ld_t, st.ld_t, tensors.dvalue, j0);
    }
    for (int i = threadIdx.x; i < kBr * kBc; i += kThreads) {
      const int r = i / kBc, c = i % kBc;
      float& s = sh.s[r * st.ld_s + c];
      s = logit(p, h, t0 + r, j0 + c, s);
      if (logit_tangents) {
        float& ds = sh.ds[r * st.ld_s + c];
        ds = logit_tangent(p, h, t0 + r, j0 + c, s, dot_tangents ? ds : 0.0f, tensors.dbias);
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
      for (int c = sub; c < hp; c += kRowThreads) {
        sh.o[r * st.ld_o + c] *= alpha;
        sh.a[r * st.ld_o + c] *= alpha;
      }
      float shift = sh.row_shift[r], dsum = 0.0f;
      if (logit_tangents) {
        weighted = group_sum<kRowThreads>(weighted);
        // l is 0 until the row's first attended key and at least 1 after.
        if (old_sum == 0.0f && sum > 0.0f) shift = weighted / sum;
        for (int c = sub; c < kBc; c += kRowThreads) {
          const float centred = s_row[c] * (ds_row[c] - shift);
          probs_row[c] = from_float<T>(centred);
          dsum += centred;
        }
        dsum = group_sum<kRowThreads>(dsum);
      }
      __syncwarp();  // the row's threads have read its statistics
      if (sub == 0) {
        sh.row_max[r] = new_max;
        sh.row_sum[r] = old_sum * alpha + sum;
        sh.row_dsum[r] = sh.row_dsum[r] * alpha + dsum;
        sh.row_shift[r] = shift;
      }
    }
    __syncthreads();
    block_gemm<false, false, true>(sh.o, st.ld_o, e_tile, st.ld_probs, sh.keys, st.ld_t, kBr, hp,
                                   kBc, p.allow_tf32);
    if (output_tangents) {
      block_gemm<false, false, true>(sh.a, st.ld_o, sh.probs + acc_first, st.ld_probs,
                                     sh.keys + acc_first * st.ld_t, st.ld_t, kBr, hp,
                                     acc_last - acc_first, p.allow_tf32);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBr * hp; i += kThreads) {
    const int r = i / hp, c = i % hp;
    const int64_t t = t0 + r;
    if (t >= p.q_len || c >= p.head_dim) continue;
    const float sum = sh.row_sum[r];
    float o = 0.0f, dout = 0.0f;
    if (sum != 0.0f) {  // NaN sum: a NaN row
      o = sh.o[r * st.ld_o + c] / sum;
      dout = sh.a[r * st.ld_o + c] / sum - sh.row_dsum[r] / sum * o;
    }
    const int64_t offset = ((b * p.q_len + t) * p.num_heads + n) * p.head_dim + c;
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
size_t jvp_shared_bytes(int hp, int br, int bc) {
  return JvpShared<T>(nullptr, JvpStrides(hp, bc), br, bc).bytes;
}

template <typename T, int kBr, int kBc>
cudaError_t launch_fwd_jvp(cudaStream_t stream, const AttentionParams& p, int hp,
                           const JvpTensors<T>& tensors) {
  const int64_t grid = blocks(p.q_len, kBr, p.batch * p.num_heads);
  if (!fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_fwd_jvp_kernel<T, kBr, kBc>,
                                      dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                                      jvp_shared_bytes<T>(hp, kBr, kBc), stream, p, hp, tensors);
}

}  // namespace

template <typename T>
cudaError_t attention_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const T* query,
                              const T* key, const T* value, const T* dquery, const T* dkey,
                              const T* dvalue, const float* dbias, T* out, float* logsumexp,
                              T* dout, float* dlogsumexp) {
  if (p.head_dim > kCudaAttentionMaxHeadDim || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
  if (p.batch * p.num_heads * p.q_len == 0) return cudaSuccess;
  const JvpTensors<T> tensors{query, key, value, dquery,    dkey,
                              dvalue, dbias, out, logsumexp, dout, dlogsumexp};
  const int hp = padded_head_dim(p.head_dim);
  if (jvp_shared_bytes<T>(hp, 64, 64) <= kSharedBudget) {
    return launch_fwd_jvp<T, 64, 64>(stream, p, hp, tensors);
  }
  // 32x32 tiles fit every head dim up to kCudaAttentionMaxHeadDim in 2-byte types;
  // float32 needs 16x16 above 176.
  if constexpr (sizeof(T) == 4) {
    if (jvp_shared_bytes<T>(hp, 32, 32) > kSharedBudget) {
      return launch_fwd_jvp<T, 16, 16>(stream, p, hp, tensors);
    }
  }
  return launch_fwd_jvp<T, 32, 32>(stream, p, hp, tensors);
}

#define JAXOPS_CUDA_ATTENTION_JVP_DEFINE(T)                                                  \
  template cudaError_t attention_fwd_jvp<T>(cudaStream_t, const AttentionParams&, const T*,  \
                                            const T*, const T*, const T*, const T*, const T*, \
                                            const float*, T*, float*, T*, float*);

JAXOPS_CUDA_ATTENTION_JVP_DEFINE(float)
JAXOPS_CUDA_ATTENTION_JVP_DEFINE(__half)
JAXOPS_CUDA_ATTENTION_JVP_DEFINE(__nv_bfloat16)

#undef JAXOPS_CUDA_ATTENTION_JVP_DEFINE

}  // namespace jaxops::cuda
