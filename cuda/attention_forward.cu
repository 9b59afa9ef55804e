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
using attention_tiles::TileIds;
using namespace attention_mma;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kRows = 16 * kWarps;  // query rows of a block

// Tile sizes per element type and padded head dims of query/key (kHd) and
// value/out (kHdv) (docs/cuda.md has the registers and shared memory they come
// to): K and V tiles of kBc keys (two stages of each); Q fragments in
// registers up to 256 bytes of head vector; kDv columns of O per block (the
// others recompute S).
template <typename T, int kHd, int kHdv, bool kFeatures>
struct ForwardTiles {
  static constexpr bool kHalf = sizeof(T) == 2;
  static constexpr int kRowBytes = kHd * static_cast<int>(sizeof(T));
  static constexpr int kValueRowBytes = kHdv * static_cast<int>(sizeof(T));
  // With the features, 16-bit head dim 128 takes half the keys a tile (the
  // registers of the cap and the ids would otherwise spill).
  static constexpr int kBc = kHd == 64    ? 64
                             : kHd == 128 ? (kHalf && !kFeatures ? 64 : 32)
                                          : (kHalf ? 32 : 16);
  static constexpr bool kQInRegisters = kRowBytes <= 256;
  static constexpr int kDv = kHalf ? (kHdv < 128 ? kHdv : 128) : 64;
  static constexpr int kKeyTileBytes = kBc * kRowBytes;
  static constexpr int kValueTileBytes = kBc * kValueRowBytes;
  static constexpr int kStageBytes = kKeyTileBytes + kValueTileBytes;
  // Stage s: K, then V. Q, while it is loaded into registers, takes stage 1
  // (free until the first tile's loop); otherwise it follows the stages.
  static constexpr int kQOffset = kQInRegisters ? kStageBytes : 2 * kStageBytes;
  static constexpr int kSharedBytes = 2 * kStageBytes + (kQInRegisters ? 0 : kRows * kRowBytes);
  static_assert(!kQInRegisters || kRows * kRowBytes <= kStageBytes, "Q fits stage 1");
  static_assert(kSharedBytes <= kMaxSharedBytes, "fits sm_80's shared memory");
};

template <typename T, int kHd, int kHdv, bool kFeatures>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_mma_kernel(AttentionParams p, attention_tiles::SoftCap call_cap, const T* query,
                             const T* key, const T* value, T* out, float* logsumexp) {
  using Tiles = ForwardTiles<T, kHd, kHdv, kFeatures>;
  // Without the features the cap is off at compile time (as are the ids).
  const attention_tiles::SoftCap cap =
      kFeatures ? call_cap : attention_tiles::SoftCap{0.0f, 0.0f};
  using Tile = SwizzledTile<T, kHd>;
  using ValueTile = SwizzledTile<T, kHdv>;
  constexpr int kBc = Tiles::kBc;
  constexpr int kSteps = kHd / Operand<T>::kK;
  unsigned char* const shared = dynamic_shared_memory<unsigned char>();
  const auto k_tile = [&](int stage) { return Tile{shared + stage * Tiles::kStageBytes}; };
  const auto v_tile = [&](int stage) {
    return ValueTile{shared + stage * Tiles::kStageBytes + Tiles::kKeyTileBytes};
  };
  const Tile q_tile{shared + Tiles::kQOffset};

  const BlockIndex at =
      attention_tiles::block_index(p.q_len, kRows, p.num_heads, p.num_heads / p.num_kv_heads);
  const HeadView h = attention_tiles::head_view(p, at.b, at.head);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int64_t t0 = at.row0, tw = t0 + 16 * warp;
  const int d0 = static_cast<int>(blockIdx.y) * Tiles::kDv;
  const int64_t hd = p.head_dim, hdv = kFeatures ? attention_tiles::value_head_dim(p) : p.head_dim;
  const int64_t q_stride = p.num_heads * hd, kv_stride = p.num_kv_heads * hd;
  const int64_t out_stride = p.num_heads * hdv, v_stride = p.num_kv_heads * hdv;
  const int64_t q_first = (at.b * p.q_len * p.num_heads + at.head) * hd;
  const int64_t kv_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hd;
  const int64_t v_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hdv;
  const bool vectors = vector_rows(query, hd) && vector_rows(key, hd) && vector_rows(value, hdv);

  const Range keys = attention_tiles::key_range(p, h, t0, t0 + kRows);
  const Range warp_keys = attention_tiles::key_range(p, h, tw, tw + 16);
  const int64_t first = keys.begin / kBc * kBc;
  const int tiles = keys.begin < keys.end ? static_cast<int>((keys.end - first + kBc - 1) / kBc) : 0;
  // With segment ids, the key tiles that no row of the block shares a
  // document with are skipped whole (never loaded): the ids' ranges of the
  // block's and each warp's valid rows, against each tile's (every warp
  // computes the block's decisions alike, from the same ids).
  const attention_tiles::Segments ids = kFeatures ? attention_tiles::segments_of(p, at.b)
                                                  : attention_tiles::Segments{nullptr, nullptr};

  // The first tile from i on that the block attends, and the warp's view of it.
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
  // Keys no row of the block attends are zeros (a NaN there must not meet a
  // zero probability).
  const TileSource<T> k_rows{key + kv_first, kv_stride, keys.begin, keys.end, static_cast<int>(hd),
                             vectors};
  const TileSource<T> v_rows{value + v_first, v_stride, keys.begin, keys.end,
                             static_cast<int>(hdv), vectors};
  const auto load_keys = [&](int i, int stage) {
    load_tile<kThreads, kBc>(k_tile(stage), k_rows, first + int64_t{i} * kBc);
    load_tile<kThreads, kBc>(v_tile(stage), v_rows, first + int64_t{i} * kBc);
  };

  load_tile<kThreads, kRows>(
      q_tile, TileSource<T>{query + q_first, q_stride, 0, p.q_len, static_cast<int>(hd), vectors},
      t0);
  TileIds seen;
  int i = next_tile(0, &seen);
  if (i < tiles) load_keys(i, 0);
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
  for (int stage = 0; i < tiles; stage ^= 1) {
    const int64_t j0 = first + int64_t{i} * kBc;
    TileIds next_seen;
    const int next = next_tile(i + 1, &next_seen);
    if (next < tiles) load_keys(next, stage ^ 1);
    mma::cp_async_commit();
    if (j0 < warp_keys.end && j0 + kBc > warp_keys.begin && seen.meets) {
      float s[kBc / 8][4] = {};
      if constexpr (Tiles::kQInRegisters) {
        mma_abt<T>(s, q_registers, k_tile(stage), 0);
      } else {
        mma_abt<T, kSteps>(s, q_tile, 16 * warp, k_tile(stage), 0);
      }
      if (seen.uniform && attention_tiles::tile_fully_visible(p, h, tw, tw + 16, j0, j0 + kBc)) {
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[j][e] *= scale_log2;
            if (cap.on()) s[j][e] = attention_tiles::capped(cap, s[j][e]);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t col = j0 + 8 * j + 2 * t + (e & 1);
            s[j][e] = attention_tiles::visible_logit(
                p, h, ids, !seen.uniform, cap, tw + g + 8 * (e >> 1), col,
                attention_tiles::within(e >> 1 ? keys_g8 : keys_g, col), s[j][e], scale_log2);
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
      mma_pb<T>(o, s, v_tile(stage), 0, d0);
    }
    mma::cp_async_wait<0>();
    __syncthreads();  // the next tile is in, and every warp is done with this stage
    i = next;
    seen = next_seen;
  }

  T* const out_rows = out + (at.b * p.q_len * p.num_heads + at.head) * hdv;
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
        if (col < hdv) out_rows[row * out_stride + col] = from_float<T>(o[d][2 * r + e] * inverse);
      }
    }
    if (t == 0 && blockIdx.y == 0) {
      logsumexp[(at.b * p.num_heads + at.head) * p.q_len + row] =
          sum != 0.0f ? row_max[r] * kLn2 + logf(sum) : -CUDART_INF_F;
    }
  }
}

template <typename T, int kHd, int kHdv, bool kFeatures>
cudaError_t launch_fwd(cudaStream_t stream, const AttentionParams& p, const T* q, const T* k,
                       const T* v, T* out, float* lse) {
  using Tiles = ForwardTiles<T, kHd, kHdv, kFeatures>;
  const int64_t grid = attention_tiles::blocks(p.q_len, kRows, p.batch * p.num_heads);
  if (!attention_tiles::fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_fwd_mma_kernel<T, kHd, kHdv, kFeatures>,
                                      dim3(static_cast<unsigned>(grid), kHdv / Tiles::kDv),
                                      dim3(kThreads), Tiles::kSharedBytes, stream, p,
                                      attention_tiles::soft_cap(p, kLog2e), q, k, v, out, lse);
}

}  // namespace

template <typename T>
cudaError_t tensor_core_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                            const T* key, const T* value, T* out, float* logsumexp) {
  const TensorCoreDims dims = tensor_core_dims(p);
  const auto launch = [&](auto kernels) {
    return kernels(stream, p, query, key, value, out, logsumexp);
  };
  if (dims.hdv != dims.hd) return launch(launch_fwd<T, 256, 128, true>);
  if (tensor_core_features(p)) {
    if (dims.hd == 64) return launch(launch_fwd<T, 64, 64, true>);
    if (dims.hd == 128) return launch(launch_fwd<T, 128, 128, true>);
    return launch(launch_fwd<T, 256, 256, true>);
  }
  if (dims.hd == 64) return launch(launch_fwd<T, 64, 64, false>);
  if (dims.hd == 128) return launch(launch_fwd<T, 128, 128, false>);
  return launch(launch_fwd<T, 256, 256, false>);
}

template cudaError_t tensor_core_fwd<float>(cudaStream_t, const AttentionParams&, const float*,
                                            const float*, const float*, float*, float*);
template cudaError_t tensor_core_fwd<__half>(cudaStream_t, const AttentionParams&, const __half*,
                                             const __half*, const __half*, __half*, float*);
template cudaError_t tensor_core_fwd<__nv_bfloat16>(cudaStream_t, const AttentionParams&,
                                                    const __nv_bfloat16*, const __nv_bfloat16*,
                                                    const __nv_bfloat16*, __nv_bfloat16*, float*);

}  // namespace jaxops::cuda::attention_kernels
