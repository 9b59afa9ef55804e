// The tensor-core forward of attention (FlashAttention-2 on sm_80+; see
// attention.h for the contract, attention_kernels.h for when it runs).
//
// A block owns 64 query rows of one (batch, head); each of its 4 warps owns 16
// of them, and keeps their Q fragments in registers for the whole key loop
// (from shared memory at every k-step where they would not fit: head dim 256,
// and float32 above 64). The block walks the key tiles its rows can see
// (kBc keys each), skipping the tiles that the causal limit, the window or the
// key length mask entirely; per tile, each warp:
//   S = Q K^T        mma.sync, K from shared memory by ldmatrix;
//   logits           in log2 units (scale * log2(e) folded in); only the
//                    tiles a warp's rows do not see whole are masked per
//                    element (causal and window edges, lengths, masks, biases);
//   online softmax   row max by two shuffles in each quad, exp2, the row sum
//                    kept per lane and reduced once at the end, O rescaled;
//   O += P V         P rounded to T in registers as the A operand (the
//                    accumulator layout is the A layout), V by ldmatrix.trans.
// K and V stream through two stages of shared memory by cp.async: tile i + 1
// loads while tile i is multiplied; one barrier per tile. Where the
// accumulators of all of O's columns would not fit the registers (head dim
// 256, and float32 above 64), a block takes kDv of them (blockIdx.y) and
// recomputes S.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/attention.h"
#include "cuda/attention_fragments.cuh"
#include "cuda/attention_kernels.h"
#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda::attention_kernels {
namespace {

using attention_tiles::BlockIndex;
using attention_tiles::HeadView;
using attention_tiles::Range;
using namespace attention_mma;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kRows = 16 * kWarps;  // query rows of a block

// Tile sizes per element type and padded head dim (docs/cuda.md has the
// registers and shared memory they come to): K and V tiles of kBc keys (two
// stages of each); Q fragments in registers up to 256 bytes of head vector;
// kDv columns of O per block (the others recompute S).
template <typename T, int kHd>
struct ForwardTiles {
  static constexpr bool kHalf = sizeof(T) == 2;
  static constexpr int kRowBytes = kHd * static_cast<int>(sizeof(T));
  static constexpr int kBc = kHd == 64 ? 64 : kHd == 128 ? (kHalf ? 64 : 32) : (kHalf ? 32 : 16);
  static constexpr bool kQInRegisters = kRowBytes <= 256;
  static constexpr int kDv = kHalf ? (kHd < 128 ? kHd : 128) : 64;
  static constexpr int kTileBytes = kBc * kRowBytes;
  // Stage s: K at 2 s tiles, V after it. Q, while it is loaded into
  // registers, takes stage 1 (free until the first tile's loop); otherwise it
  // follows the stages.
  static constexpr int kQOffset = kQInRegisters ? 2 * kTileBytes : 4 * kTileBytes;
  static constexpr int kSharedBytes = 4 * kTileBytes + (kQInRegisters ? 0 : kRows * kRowBytes);
  static_assert(!kQInRegisters || kRows * kRowBytes <= 2 * kTileBytes, "Q fits stage 1");
  static_assert(kSharedBytes <= kMaxSharedBytes, "fits sm_80's shared memory");
};

template <typename T, int kHd>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_mma_kernel(AttentionParams p, const T* query, const T* key, const T* value,
                             T* out, float* logsumexp) {
  using Tiles = ForwardTiles<T, kHd>;
  using Tile = SwizzledTile<T, kHd>;
  constexpr int kBc = Tiles::kBc;
  constexpr int kSteps = kHd / Operand<T>::kK;
  unsigned char* const shared = dynamic_shared_memory<unsigned char>();
  const auto k_tile = [&](int stage) { return Tile{shared + 2 * stage * Tiles::kTileBytes}; };
  const auto v_tile = [&](int stage) { return Tile{shared + (2 * stage + 1) * Tiles::kTileBytes}; };
  const Tile q_tile{shared + Tiles::kQOffset};

  const BlockIndex at =
      attention_tiles::block_index(p.q_len, kRows, p.num_heads, p.num_heads / p.num_kv_heads);
  const HeadView h = attention_tiles::head_view(p, at.b, at.head);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int64_t t0 = at.row0, tw = t0 + 16 * warp;
  const int d0 = static_cast<int>(blockIdx.y) * Tiles::kDv;
  const int64_t hd = p.head_dim;
  const int64_t q_stride = p.num_heads * hd, kv_stride = p.num_kv_heads * hd;
  const int64_t q_first = (at.b * p.q_len * p.num_heads + at.head) * hd;
  const int64_t kv_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hd;
  const bool vectors = vector_rows(query, hd) && vector_rows(key, hd) && vector_rows(value, hd);

  const Range keys = attention_tiles::key_range(p, h, t0, t0 + kRows);
  const Range warp_keys = attention_tiles::key_range(p, h, tw, tw + 16);
  const int64_t first = keys.begin / kBc * kBc;
  const int tiles = keys.begin < keys.end ? static_cast<int>((keys.end - first + kBc - 1) / kBc) : 0;
  // Keys no row of the block attends are zeros (a NaN there must not meet a
  // zero probability).
  const TileSource<T> k_rows{key + kv_first, kv_stride, keys.begin, keys.end, static_cast<int>(hd),
                             vectors};
  const TileSource<T> v_rows{value + kv_first, kv_stride, keys.begin, keys.end,
                             static_cast<int>(hd), vectors};
  const auto load_keys = [&](int i) {
    load_tile<kThreads, kBc>(k_tile(i & 1), k_rows, first + int64_t{i} * kBc);
    load_tile<kThreads, kBc>(v_tile(i & 1), v_rows, first + int64_t{i} * kBc);
  };

  load_tile<kThreads, kRows>(
      q_tile, TileSource<T>{query + q_first, q_stride, 0, p.q_len, static_cast<int>(hd), vectors},
      t0);
  if (tiles > 0) load_keys(0);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
  uint32_t q_registers[kSteps][4];
  if constexpr (Tiles::kQInRegisters) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) load_a(q_registers[ks], q_tile, 16 * warp, ks);
    __syncthreads();  // every warp holds its Q before stage 1 is loaded over it
  }

  // The keys each of the lane's rows (g, g + 8) may attend.
  const attention_tiles::Limits keys_g = attention_tiles::keys_of_row(p, h, tw + g);
  const attention_tiles::Limits keys_g8 = attention_tiles::keys_of_row(p, h, tw + g + 8);
  float o[Tiles::kDv / 8][4] = {};
  // Per row (g, g + 8): the running max of the logits in log2 units, and this
  // lane's part of the running sum of exp2(logit - max).
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale * kLog2e;
  for (int i = 0; i < tiles; ++i) {
    const int64_t j0 = first + int64_t{i} * kBc;
    if (i + 1 < tiles) load_keys(i + 1);
    mma::cp_async_commit();
    if (j0 < warp_keys.end && j0 + kBc > warp_keys.begin) {
      float s[kBc / 8][4] = {};
      if constexpr (Tiles::kQInRegisters) {
        mma_abt<T>(s, q_registers, k_tile(i & 1), 0);
      } else {
        mma_abt<T, kSteps>(s, q_tile, 16 * warp, k_tile(i & 1), 0);
      }
      if (attention_tiles::tile_fully_visible(p, h, tw, tw + 16, j0, j0 + kBc)) {
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t col = j0 + 8 * j + 2 * t + (e & 1);
            s[j][e] = kLog2e * attention_tiles::visible_logit(
                              p, h, tw + g + 8 * (e >> 1), col,
                              attention_tiles::within(e >> 1 ? keys_g8 : keys_g, col), s[j][e]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float tile_max = row_tile_max(s, r, row_max[r]);
        // A row that has seen no key yet keeps max -inf: subtract 0 then.
        const float base = tile_max == -CUDART_INF_F ? 0.0f : tile_max;
        const float alpha = exp2_approx(row_max[r] - base);
        row_max[r] = tile_max;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[j][e] = exp2_approx(s[j][e] - base);
            sum += s[j][e];
          }
        }
        row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
        for (int d = 0; d < Tiles::kDv / 8; ++d) {
          o[d][2 * r] *= alpha;
          o[d][2 * r + 1] *= alpha;
        }
      }
      mma_pb<T>(o, s, v_tile(i & 1), 0, d0);
    }
    mma::cp_async_wait<0>();
    __syncthreads();  // tile i + 1 is in, and every warp is done with stage i & 1
  }

  T* const out_rows = out + q_first;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const int64_t row = tw + g + 8 * r;
    if (row >= p.q_len) continue;
    // A row with no attended key has sum 0: output 0, logsumexp -inf (a NaN
    // sum, from NaN logits, gives a NaN row).
    const float inverse = sum != 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int d = 0; d < Tiles::kDv / 8; ++d) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = d0 + 8 * d + 2 * t + e;
        if (col < hd) out_rows[row * q_stride + col] = from_float<T>(o[d][2 * r + e] * inverse);
      }
    }
    if (t == 0 && blockIdx.y == 0) {
      logsumexp[(at.b * p.num_heads + at.head) * p.q_len + row] =
          sum != 0.0f ? row_max[r] * kLn2 + logf(sum) : -CUDART_INF_F;
    }
  }
}

template <typename T, int kHd>
cudaError_t launch_fwd(cudaStream_t stream, const AttentionParams& p, const T* q, const T* k,
                       const T* v, T* out, float* lse) {
  const int64_t grid = attention_tiles::blocks(p.q_len, kRows, p.batch * p.num_heads);
  if (!attention_tiles::fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_fwd_mma_kernel<T, kHd>,
                                      dim3(static_cast<unsigned>(grid),
                                           kHd / ForwardTiles<T, kHd>::kDv),
                                      dim3(kThreads),
                                      ForwardTiles<T, kHd>::kSharedBytes, stream, p, q, k, v, out,
                                      lse);
}

}  // namespace

template <typename T>
cudaError_t tensor_core_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                            const T* key, const T* value, T* out, float* logsumexp) {
  if (p.head_dim <= 64) return launch_fwd<T, 64>(stream, p, query, key, value, out, logsumexp);
  if (p.head_dim <= 128) return launch_fwd<T, 128>(stream, p, query, key, value, out, logsumexp);
  return launch_fwd<T, 256>(stream, p, query, key, value, out, logsumexp);
}

template cudaError_t tensor_core_fwd<float>(cudaStream_t, const AttentionParams&, const float*,
                                            const float*, const float*, float*, float*);
template cudaError_t tensor_core_fwd<__half>(cudaStream_t, const AttentionParams&, const __half*,
                                             const __half*, const __half*, __half*, float*);
template cudaError_t tensor_core_fwd<__nv_bfloat16>(cudaStream_t, const AttentionParams&,
                                                    const __nv_bfloat16*, const __nv_bfloat16*,
                                                    const __nv_bfloat16*, __nv_bfloat16*, float*);

}  // namespace jaxops::cuda::attention_kernels
