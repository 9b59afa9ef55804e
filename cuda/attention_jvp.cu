// Forward-mode attention on CUDA: out, logsumexp and their tangents in one
// pass over K/V (see attention.h for the contract). The entry point
// attention_fwd_jvp and the tensor-core kernel (FlashAttention-2 on sm_80+;
// float32 without TF32 takes attention_simt.cu's kernel).
//
// The forward's tile loop (attention_forward.cu) with the tangent of every
// product on the tensor cores too. With the logits s_ij, their tangents
//   ds_ij = scale (dq_i.k_j + q_i.dk_j) + dbias_ij
// and e_ij = exp(s_ij - m_i) of the online softmax (running max m_i, sum l_i),
// each warp accumulates for its 16 rows, rescaled with the running max as the
// output is,
//   O_i = sum_j e_ij v_j                            (mma: e V)
//   A_i = sum_j e_ij (ds_ij - c_i) v_j + e_ij dv_j  (mma: e (ds - c) V, e dV)
//   M_i = sum_j e_ij (ds_ij - c_i)
// with dS = dQ K^T + Q dK^T (two products into one accumulator), and ends with
// out = O / l, dlogsumexp = M / l + c, dout = A / l - (M / l) out. The shift
// c_i, the e-weighted mean of ds over the tile that last raised the row's
// maximum, keeps A and M small where ds has a large common part along the row
// (a large mean of the keys, a bias tangent constant along keys): dout is then
// the difference of two small terms, which matters once e (ds - c) is rounded
// to bfloat16 or float16 as an A operand, and where ds is huge at a one-hot
// key (a query element of 1e30) e dv is not absorbed into e ds. A tile that
// raises the maximum moves the earlier A and M to its shift (A += (c_old -
// c_new) O, M += (c_old - c_new) l) before alpha rescales them: one FMA per
// accumulator, as the CPU kernel does. An absent tangent (null) is never loaded and its
// products are skipped. K, dK, V, dV stream through two stages by cp.async;
// Q and dQ stay in shared memory (their fragments are read at each k-step:
// the accumulators of O, A, S and dS fill the registers). Where the
// accumulators of all of O's and A's columns would not fit the registers, each
// block takes kDv of them (blockIdx.y) and recomputes S and dS.
#include "cuda/attention.h"

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/attention_fragments.cuh"
#include "cuda/attention_kernels.h"
#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace attention_kernels {
namespace {

using attention_tiles::BlockIndex;
using attention_tiles::HeadView;
using attention_tiles::Range;
using attention_tiles::TileIds;
using namespace attention_mma;

// Tile sizes per element type and padded head dims of query/key (kHd) and
// value/out (kHdv) (docs/cuda.md has the registers and shared memory they come
// to).
template <typename T, int kHd, int kHdv, bool kFeatures>
struct JvpTiles {
  static constexpr bool kHalf = sizeof(T) == 2;
  static constexpr int kRowBytes = kHd * static_cast<int>(sizeof(T));
  static constexpr int kValueRowBytes = kHdv * static_cast<int>(sizeof(T));
  static constexpr int kWarps = kRowBytes <= 512 ? 4 : 1;
  static constexpr int kRows = 16 * kWarps;
  static constexpr int kBc = kHd == 64 ? (kHalf ? 64 : 32) : 16;
  // The columns of O and A a block computes (the others recompute S and dS).
  static constexpr int kDv = kHalf ? (kHdv < 128 ? kHdv : 128) : 32;
  static constexpr int kRowTileBytes = kRows * kRowBytes;
  static constexpr int kKeyTileBytes = kBc * kRowBytes;
  static constexpr int kValueTileBytes = kBc * kValueRowBytes;
  static constexpr int kStageBytes = 2 * kKeyTileBytes + 2 * kValueTileBytes;
  // Q, dQ, then two stages of K, dK, V, dV.
  static constexpr int kSharedBytes = 2 * kRowTileBytes + 2 * kStageBytes;
  static_assert(kSharedBytes <= kMaxSharedBytes, "fits sm_80's shared memory");
};

template <typename T, int kHd, int kHdv, bool kFeatures>
__global__ void __launch_bounds__(32 * JvpTiles<T, kHd, kHdv, kFeatures>::kWarps, 1)
    attention_fwd_jvp_mma_kernel(AttentionParams p, attention_tiles::SoftCap call_cap,
                                 JvpTensors<T> x) {
  using Tiles = JvpTiles<T, kHd, kHdv, kFeatures>;
  // Without the features the cap is off at compile time (as are the ids).
  const attention_tiles::SoftCap cap =
      kFeatures ? call_cap : attention_tiles::SoftCap{0.0f, 0.0f};
  using Tile = SwizzledTile<T, kHd>;
  using ValueTile = SwizzledTile<T, kHdv>;
  constexpr int kThreads = 32 * Tiles::kWarps;
  constexpr int kRows = Tiles::kRows, kBc = Tiles::kBc, kDv = Tiles::kDv;
  constexpr int kSteps = kHd / Operand<T>::kK;
  unsigned char* const shared = dynamic_shared_memory<unsigned char>();
  const Tile q_tile{shared}, dq_tile{shared + Tiles::kRowTileBytes};
  // Stage s holds K, dK, V, dV in this order.
  unsigned char* const stages = shared + 2 * Tiles::kRowTileBytes;
  const auto key_tile = [&](int s, int which) {
    return Tile{stages + s * Tiles::kStageBytes + which * Tiles::kKeyTileBytes};
  };
  const auto value_tile = [&](int s, int which) {
    return ValueTile{stages + s * Tiles::kStageBytes + 2 * Tiles::kKeyTileBytes +
                     which * Tiles::kValueTileBytes};
  };

  const BlockIndex at =
      attention_tiles::block_index(p.q_len, kRows, p.num_heads, p.num_heads / p.num_kv_heads);
  const HeadView h = attention_tiles::head_view(p, at.b, at.head);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int d0 = static_cast<int>(blockIdx.y) * kDv;
  const int64_t t0 = at.row0, tw = t0 + 16 * warp;
  const int64_t hd = p.head_dim, hdv = kFeatures ? attention_tiles::value_head_dim(p) : p.head_dim;
  const int64_t q_stride = p.num_heads * hd, kv_stride = p.num_kv_heads * hd;
  const int64_t v_stride = p.num_kv_heads * hdv;
  const int64_t q_first = (at.b * p.q_len * p.num_heads + at.head) * hd;
  const int64_t kv_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hd;
  const int64_t v_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hdv;
  // Which tangent products run (the same for the whole block).
  const bool has_dq = x.dquery != nullptr, has_dk = x.dkey != nullptr;
  const bool has_dv = x.dvalue != nullptr;
  const bool logit_tangents = has_dq || has_dk || x.dbias != nullptr;
  const auto vectors_or_absent = [](const T* input, int64_t d) {
    return input == nullptr || vector_rows(input, d);
  };
  const bool vectors = vector_rows(x.query, hd) && vectors_or_absent(x.dquery, hd) &&
                       vectors_or_absent(x.key, hd) && vectors_or_absent(x.dkey, hd) &&
                       vectors_or_absent(x.value, hdv) && vectors_or_absent(x.dvalue, hdv);

  const Range keys = attention_tiles::key_range(p, h, t0, t0 + kRows);
  const Range warp_keys = attention_tiles::key_range(p, h, tw, tw + 16);
  const int64_t first = keys.begin / kBc * kBc;
  const int tiles = keys.begin < keys.end ? static_cast<int>((keys.end - first + kBc - 1) / kBc) : 0;
  // Segment ids: the forward's whole-tile skipping.
  const attention_tiles::Segments ids = kFeatures ? attention_tiles::segments_of(p, at.b)
                                                  : attention_tiles::Segments{nullptr, nullptr};

  attention_tiles::IdRange block_ids{0, 0}, warp_ids{0, 0};
  if (ids.on()) {
    block_ids = attention_tiles::warp_id_range(ids.q, t0,
                                               attention_tiles::min64(t0 + kRows, h.q_valid));
    warp_ids = attention_tiles::warp_id_range(ids.q, tw,
                                              attention_tiles::min64(tw + 16, h.q_valid));
  }
  const auto next_tile = [&](int i, TileIds* seen) {
    *seen = {true, true};
    if (!ids.on()) return i;
    return attention_tiles::next_meeting_tile(ids.kv, first, kBc, keys.begin, keys.end, i, tiles,
                                              block_ids, warp_ids, seen);
  };
  const auto load_keys = [&](int i, int s) {
    const int64_t j0 = first + int64_t{i} * kBc;
    // Keys no row of the block attends are zeros.
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const T* const input = which == 0 ? x.key : x.dkey;
      if (input == nullptr) continue;
      load_tile<kThreads, kBc>(key_tile(s, which),
                               TileSource<T>{input + kv_first, kv_stride, keys.begin, keys.end,
                                             static_cast<int>(hd), vectors},
                               j0);
    }
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const T* const input = which == 0 ? x.value : x.dvalue;
      if (input == nullptr) continue;
      load_tile<kThreads, kBc>(value_tile(s, which),
                               TileSource<T>{input + v_first, v_stride, keys.begin, keys.end,
                                             static_cast<int>(hdv), vectors},
                               j0);
    }
  };
  load_tile<kThreads, kRows>(
      q_tile, TileSource<T>{x.query + q_first, q_stride, 0, p.q_len, static_cast<int>(hd), vectors},
      t0);
  if (has_dq) {
    load_tile<kThreads, kRows>(
        dq_tile,
        TileSource<T>{x.dquery + q_first, q_stride, 0, p.q_len, static_cast<int>(hd), vectors}, t0);
  }
  TileIds seen;
  int i = next_tile(0, &seen);
  if (i < tiles) load_keys(i, 0);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();

  // The keys each of the lane's rows (g, g + 8) may attend.
  const attention_tiles::Limits keys_g = attention_tiles::keys_of_row(p, h, tw + g);
  const attention_tiles::Limits keys_g8 = attention_tiles::keys_of_row(p, h, tw + g + 8);
  float o[kDv / 8][4] = {}, a_acc[kDv / 8][4] = {};
  // Per row (g, g + 8): running max (log2 units), and this lane's parts of
  // the running sums l and M; the shift c (the same in the row's 4 lanes).
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.0f, 0.0f};
  float row_dsum[2] = {0.0f, 0.0f}, shift[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale * kLog2e;
  for (int s = 0; i < tiles; s ^= 1) {
    const int64_t j0 = first + int64_t{i} * kBc;
    TileIds next_seen;
    const int next = next_tile(i + 1, &next_seen);
    if (next < tiles) load_keys(next, s ^ 1);
    mma::cp_async_commit();
    if (j0 < warp_keys.end && j0 + kBc > warp_keys.begin && seen.meets) {
      float e[kBc / 8][4] = {}, ds[kBc / 8][4] = {};
      mma_abt<T, kSteps>(e, q_tile, 16 * warp, key_tile(s, 0), 0);
      if (has_dq) mma_abt<T, kSteps>(ds, dq_tile, 16 * warp, key_tile(s, 0), 0);
      if (has_dk) mma_abt<T, kSteps>(ds, q_tile, 16 * warp, key_tile(s, 1), 0);
      const bool whole = seen.uniform &&
                         attention_tiles::tile_fully_visible(p, h, tw, tw + 16, j0, j0 + kBc);
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int64_t row = tw + g + 8 * (c >> 1), col = j0 + 8 * j + 2 * t + (c & 1);
          float slope = 1.0f;
          float logit;
          if (whole) {
            logit = e[j][c] * scale_log2;
            if (cap.on()) logit = attention_tiles::capped(cap, logit, &slope);
          } else {
            logit = attention_tiles::visible_logit(
                p, h, ids, !seen.uniform, cap, row, col,
                attention_tiles::within(c >> 1 ? keys_g8 : keys_g, col), e[j][c], scale_log2,
                &slope);
          }
          // A masked key contributes nothing, whatever the bias tangent holds
          // there; the cap's slope multiplies the products' tangent only.
          float tangent = 0.0f;
          if (logit != -CUDART_INF_F) {
            tangent = p.scale * ds[j][c] * slope;
            if (x.dbias != nullptr) {
              tangent += x.dbias[attention_tiles::broadcast_offset(p.bias_strides, h, row, col)];
            }
          }
          e[j][c] = logit;
          ds[j][c] = tangent;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float tile_max = row_tile_max(e, r, row_max[r]);
        const float base = tile_max == -CUDART_INF_F ? 0.0f : tile_max;
        const float alpha = exp2_approx(row_max[r] - base);
        // This tile raised the row's maximum: the shift becomes its mean
        // tangent, and the earlier accumulators (if any) move to it below.
        const bool raised = tile_max > row_max[r];
        const bool earlier = raised && row_max[r] != -CUDART_INF_F;
        row_max[r] = tile_max;
        float move = 0.0f;
        float sum = 0.0f, weighted = 0.0f;
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int c = 2 * r; c < 2 * r + 2; ++c) {
            e[j][c] = exp2_approx(e[j][c] - base);
            sum += e[j][c];
            weighted += e[j][c] * ds[j][c];
          }
        }
        const float earlier_sum = row_sum[r];
        row_sum[r] = earlier_sum * alpha + sum;
        if (logit_tangents) {
          // Every lane of the quad takes the same branch (raised is the row's).
          const float tile_sum = quad_sum(sum), tile_weighted = quad_sum(weighted);
          if (raised) {
            const float new_shift = tile_weighted / tile_sum;
            // A and M hold e (ds - c_old): A += (c_old - c_new) O, M += (c_old - c_new) l.
            if (earlier) move = shift[r] - new_shift;
            shift[r] = new_shift;
          }
          float dsum = 0.0f;
#pragma unroll
          for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
            for (int c = 2 * r; c < 2 * r + 2; ++c) {
              ds[j][c] = e[j][c] * (ds[j][c] - shift[r]);
              dsum += ds[j][c];
            }
          }
          row_dsum[r] = (row_dsum[r] + move * earlier_sum) * alpha + dsum;
        }
#pragma unroll
        for (int d = 0; d < kDv / 8; ++d) {
#pragma unroll
          for (int c = 2 * r; c < 2 * r + 2; ++c) {
            a_acc[d][c] = (a_acc[d][c] + move * o[d][c]) * alpha;
            o[d][c] *= alpha;
          }
        }
      }
      mma_pb<T>(o, e, value_tile(s, 0), 0, d0);
      if (logit_tangents) mma_pb<T>(a_acc, ds, value_tile(s, 0), 0, d0);
      if (has_dv) mma_pb<T>(a_acc, e, value_tile(s, 1), 0, d0);
    }
    mma::cp_async_wait<0>();
    __syncthreads();  // the next tile is in, and every warp is done with stage s
    i = next;
    seen = next_seen;
  }

  const int64_t out_stride = p.num_heads * hdv;
  const int64_t out_first = (at.b * p.q_len * p.num_heads + at.head) * hdv;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = quad_sum(row_sum[r]), dsum = quad_sum(row_dsum[r]);
    const int64_t row = tw + g + 8 * r;
    if (row >= p.q_len) continue;
    // A row with no attended key has sum 0: zero tangents (a NaN sum, from
    // NaN logits, gives a NaN row).
    const float inverse = sum != 0.0f ? 1.0f / sum : 0.0f;
    const float mean = dsum * inverse;
#pragma unroll
    for (int d = 0; d < kDv / 8; ++d) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = d0 + 8 * d + 2 * t + c;
        if (col >= hdv) continue;
        const float out = o[d][2 * r + c] * inverse;
        const int64_t offset = out_first + row * out_stride + col;
        x.out[offset] = from_float<T>(out);
        x.dout[offset] = from_float<T>(a_acc[d][2 * r + c] * inverse - mean * out);
      }
    }
    if (t == 0 && blockIdx.y == 0) {
      const int64_t offset = (at.b * p.num_heads + at.head) * p.q_len + row;
      x.logsumexp[offset] = sum != 0.0f ? row_max[r] * kLn2 + logf(sum) : -CUDART_INF_F;
      x.dlogsumexp[offset] = sum != 0.0f ? mean + shift[r] : 0.0f;
    }
  }
}

template <typename T, int kHd, int kHdv, bool kFeatures>
cudaError_t launch_fwd_jvp(cudaStream_t stream, const AttentionParams& p,
                           const JvpTensors<T>& x) {
  using Tiles = JvpTiles<T, kHd, kHdv, kFeatures>;
  const int64_t grid = attention_tiles::blocks(p.q_len, Tiles::kRows, p.batch * p.num_heads);
  if (!attention_tiles::fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(
      attention_fwd_jvp_mma_kernel<T, kHd, kHdv, kFeatures>,
      dim3(static_cast<unsigned>(grid), kHdv / Tiles::kDv), dim3(32 * Tiles::kWarps),
      Tiles::kSharedBytes, stream, p, attention_tiles::soft_cap(p, kLog2e), x);
}

}  // namespace

template <typename T>
cudaError_t tensor_core_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const T* query,
                                const T* key, const T* value, const T* dquery, const T* dkey,
                                const T* dvalue, const float* dbias, T* out, float* logsumexp,
                                T* dout, float* dlogsumexp) {
  const JvpTensors<T> x{query, key, value, dquery, dkey, dvalue, dbias, out, logsumexp, dout,
                        dlogsumexp};
  const TensorCoreDims dims = tensor_core_dims(p);
  if (dims.hdv != dims.hd) return launch_fwd_jvp<T, 256, 128, true>(stream, p, x);
  if (tensor_core_features(p)) {
    if (dims.hd == 64) return launch_fwd_jvp<T, 64, 64, true>(stream, p, x);
    if (dims.hd == 128) return launch_fwd_jvp<T, 128, 128, true>(stream, p, x);
    return launch_fwd_jvp<T, 256, 256, true>(stream, p, x);
  }
  if (dims.hd == 64) return launch_fwd_jvp<T, 64, 64, false>(stream, p, x);
  if (dims.hd == 128) return launch_fwd_jvp<T, 128, 128, false>(stream, p, x);
  return launch_fwd_jvp<T, 256, 256, false>(stream, p, x);
}

#define JAXOPS_TENSOR_CORE_JVP_DEFINE(T)                                                       \
  template cudaError_t tensor_core_fwd_jvp<T>(cudaStream_t, const AttentionParams&, const T*,  \
                                              const T*, const T*, const T*, const T*, const T*, \
                                              const float*, T*, float*, T*, float*);

JAXOPS_TENSOR_CORE_JVP_DEFINE(float)
JAXOPS_TENSOR_CORE_JVP_DEFINE(__half)
JAXOPS_TENSOR_CORE_JVP_DEFINE(__nv_bfloat16)

#undef JAXOPS_TENSOR_CORE_JVP_DEFINE

}  // namespace attention_kernels

template <typename T>
cudaError_t attention_fwd_jvp(cudaStream_t stream, const AttentionParams& p, const T* query,
                              const T* key, const T* value, const T* dquery, const T* dkey,
                              const T* dvalue, const float* dbias, T* out, float* logsumexp,
                              T* dout, float* dlogsumexp) {
  if (p.head_dim > kCudaAttentionMaxHeadDim ||
      attention_tiles::value_head_dim(p) > kCudaAttentionMaxHeadDim || p.num_kv_heads <= 0) {
    return cudaErrorInvalidValue;
  }
  if (p.batch * p.num_heads * p.q_len == 0) return cudaSuccess;
  const bool tensor_cores = attention_kernels::device_has_tensor_cores();
  if (tensor_cores && (!std::is_same<T, float>::value || p.allow_tf32)) {
    return attention_kernels::tensor_core_fwd_jvp<T>(stream, p, query, key, value, dquery, dkey,
                                                     dvalue, dbias, out, logsumexp, dout,
                                                     dlogsumexp);
  }
  if constexpr (std::is_same<T, float>::value) {
    return attention_kernels::simt_fwd_jvp(stream, p, query, key, value, dquery, dkey, dvalue,
                                           dbias, out, logsumexp, dout, dlogsumexp);
  }
  return cudaErrorInvalidDeviceFunction;  // no bfloat16/float16 kernel below sm_80
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
