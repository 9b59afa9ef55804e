// The tensor-core backward of attention (FlashAttention-2 on sm_80+; see
// attention.h for the contract, attention_kernels.h for when it runs). After
// D = rowsum(dO * O) - dlogsumexp (attention.cu), two kernels, every product on
// mma.sync, no atomics on dq, dk, dv (deterministic):
//
// dK/dV: a block owns 16 keys per warp of one (batch, kv head) and walks the
//   query tiles (kBr rows) of every query head of its group that may attend
//   them; per tile, with the warp's keys as the rows of every product:
//     S^T = K Q^T, dP^T = V dO^T          (K, V rows by ldmatrix, Q, dO too)
//     P^T = exp2(S^T scale log2(e) - logsumexp log2(e)), dS^T = P^T (dP^T - D)
//     dV += P^T dO, dK += dS^T Q          (P^T, dS^T as A operands in registers)
//   Q, dO and the tile's logsumexp and D stream through two stages by cp.async.
//   Where the accumulators of all of dK's and dV's columns would not fit the
//   registers, each block takes kDv of them (blockIdx.y) and recomputes S and dP.
// dQ: a block owns 16 query rows per warp and walks their key tiles again:
//   S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K; K and V stream through
//   two stages; where all of dQ's columns would not fit the registers, a block
//   takes kDq of them. dbias (when asked for) is dS, added atomically into the
//   bias-shaped result, which sums the broadcast axes (the only atomics).
// Masking as in the forward: only the tiles a warp does not see whole are
// masked per element; a masked element has P = dS = 0, whatever dP is.
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

// Tile sizes per element type and padded head dims of query/key (kHd) and
// value/out (kHdv) (docs/cuda.md has the registers and shared memory they come
// to). Where the accumulators of a whole head vector would not fit the
// registers, a block takes kDv columns of dK and dV (or kDq of dQ;
// blockIdx.y) and recomputes S and dP; with kHdv < kHd the blocks past dV's
// columns compute dK's only.
template <typename T, int kHd, int kHdv, bool kFeatures>
struct BackwardTiles {
  static constexpr bool kHalf = sizeof(T) == 2;
  static constexpr int kRowBytes = kHd * static_cast<int>(sizeof(T));
  static constexpr int kValueRowBytes = kHdv * static_cast<int>(sizeof(T));
  // dK/dV: 16 keys a warp, query tiles of kBr rows.
  static constexpr int kKeyWarps = kRowBytes <= 512 ? 4 : 2;
  // With the features, 16-bit head dim 64 takes half the queries a tile (the
  // registers of the cap and the ids would otherwise spill).
  static constexpr int kBr = kHd == 64 ? (kHalf && !kFeatures ? 64 : 32) : 16;
  static constexpr int kDv = kHd == 128 && kHalf ? 128 : 64;
  static constexpr int kColumnBlocks = kHd / kDv;
  // dQ: 16 query rows a warp, key tiles of kBc keys.
  static constexpr int kQueryWarps = kRowBytes <= 512 ? 4 : 2;
  static constexpr int kBc = kHd == 64 ? (kHalf ? 64 : 32) : kHd == 128 ? (kHalf ? 32 : 16) : 16;
  static constexpr int kDq = kHalf ? (kHd < 128 ? kHd : 128) : 64;

  // dK/dV's shared memory: K, V, then two stages of Q, dO, logsumexp, D.
  static constexpr int kKeyTileBytes = 16 * kKeyWarps * kRowBytes;
  static constexpr int kValueTileBytes = 16 * kKeyWarps * kValueRowBytes;
  static constexpr int kQueryTileBytes = kBr * kRowBytes;
  static constexpr int kDoutTileBytes = kBr * kValueRowBytes;
  static constexpr int kStageBytes = kQueryTileBytes + kDoutTileBytes + 2 * kBr * 4;
  static constexpr int kKeySideBytes = kKeyTileBytes + kValueTileBytes + 2 * kStageBytes;
  // dQ's: Q, dO, then two stages of K, V.
  static constexpr int kRowTileBytes = 16 * kQueryWarps * kRowBytes;
  static constexpr int kRowDoutBytes = 16 * kQueryWarps * kValueRowBytes;
  static constexpr int kKvTileBytes = kBc * kRowBytes;
  static constexpr int kVTileBytes = kBc * kValueRowBytes;
  static constexpr int kKvStageBytes = kKvTileBytes + kVTileBytes;
  static constexpr int kQuerySideBytes = kRowTileBytes + kRowDoutBytes + 2 * kKvStageBytes;
  static_assert(kKeySideBytes <= kMaxSharedBytes && kQuerySideBytes <= kMaxSharedBytes,
                "fits sm_80's shared memory");
  static_assert(kHdv % kDv == 0 || kHdv < kDv, "dV's columns in whole blocks");
};

// logsumexp in log2 units, +inf for a row with no attended key (so that
// exp2(x - it) is 0 there).
__device__ __forceinline__ float log2_lse(float lse) {
  return lse == -CUDART_INF_F ? CUDART_INF_F : lse * kLog2e;
}

template <typename T>
__host__ __device__ inline bool all_vector_rows(const T* q, const T* k, const T* v, const T* dout,
                                                int64_t hd, int64_t hdv) {
  return vector_rows(q, hd) && vector_rows(k, hd) && vector_rows(v, hdv) &&
         vector_rows(dout, hdv);
}

// -- dK, dV ----------------------------------------------------------------------------------

template <typename T, int kHd, int kHdv, bool kFeatures>
__global__ void __launch_bounds__(32 * BackwardTiles<T, kHd, kHdv, kFeatures>::kKeyWarps, 1)
    attention_bwd_dkdv_mma_kernel(AttentionParams p, attention_tiles::SoftCap call_cap,
                                  const T* query, const T* key, const T* value,
                                  const float* logsumexp, const T* dout, const float* d, T* dkey,
                                  T* dvalue) {
  using Tiles = BackwardTiles<T, kHd, kHdv, kFeatures>;
  // Without the features the cap is off at compile time (as are the ids).
  const attention_tiles::SoftCap cap =
      kFeatures ? call_cap : attention_tiles::SoftCap{0.0f, 0.0f};
  using Tile = SwizzledTile<T, kHd>;
  using ValueTile = SwizzledTile<T, kHdv>;
  constexpr int kThreads = 32 * Tiles::kKeyWarps;
  constexpr int kKeys = 16 * Tiles::kKeyWarps;
  constexpr int kBr = Tiles::kBr, kDv = Tiles::kDv;
  constexpr int kSteps = kHd / Operand<T>::kK;
  constexpr int kValueSteps = kHdv / Operand<T>::kK;
  unsigned char* const shared = dynamic_shared_memory<unsigned char>();
  const Tile k_tile{shared};
  const ValueTile v_tile{shared + Tiles::kKeyTileBytes};
  unsigned char* const stages = shared + Tiles::kKeyTileBytes + Tiles::kValueTileBytes;
  const auto q_tile = [&](int s) { return Tile{stages + s * Tiles::kStageBytes}; };
  const auto dout_tile = [&](int s) {
    return ValueTile{stages + s * Tiles::kStageBytes + Tiles::kQueryTileBytes};
  };
  const auto row_lse = [&](int s) {
    return reinterpret_cast<float*>(stages + s * Tiles::kStageBytes + Tiles::kQueryTileBytes +
                                    Tiles::kDoutTileBytes);
  };
  const auto row_d = [&](int s) { return row_lse(s) + kBr; };

  const BlockIndex at = attention_tiles::block_index(p.kv_len, kKeys, p.num_kv_heads, 1);
  const int64_t b = at.b, kv_head = at.head, j0 = at.row0;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int d0 = static_cast<int>(blockIdx.y) * kDv;
  // The column block's share of dK and of dV (block-uniform).
  const bool dk_columns = d0 < kHd, dv_columns = d0 < kHdv;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int64_t jw = j0 + 16 * warp;
  const int64_t hd = p.head_dim, hdv = kFeatures ? attention_tiles::value_head_dim(p) : p.head_dim;
  const int64_t q_stride = p.num_heads * hd, kv_stride = p.num_kv_heads * hd;
  const int64_t dout_stride = p.num_heads * hdv, v_stride = p.num_kv_heads * hdv;
  const int64_t kv_first = (b * p.kv_len * p.num_kv_heads + kv_head) * hd;
  const int64_t v_first = (b * p.kv_len * p.num_kv_heads + kv_head) * hdv;
  const bool vectors = all_vector_rows(query, key, value, dout, hd, hdv);

  // The rows of logits every head of the group shares (masks and biases aside).
  const HeadView h0 = attention_tiles::head_view(p, b, kv_head * group);
  const Range rows = attention_tiles::query_range(p, h0, j0, j0 + kKeys);
  const int64_t first = rows.begin / kBr * kBr;
  const int64_t tiles_per_head = rows.begin < rows.end ? (rows.end - first + kBr - 1) / kBr : 0;
  const int64_t tiles = tiles_per_head * group;
  const Range warp_rows = attention_tiles::query_range(p, h0, jw, jw + 16);
  // With segment ids, the query tiles that share no document with the block's
  // keys are skipped whole (the same tiles for every head of the group).
  const attention_tiles::Segments ids = kFeatures ? attention_tiles::segments_of(p, b)
                                                  : attention_tiles::Segments{nullptr, nullptr};
  attention_tiles::IdRange block_ids{0, 0}, warp_ids{0, 0};
  if (ids.on()) {
    block_ids = attention_tiles::warp_id_range(ids.kv, j0,
                                               attention_tiles::min64(j0 + kKeys, h0.kv_valid));
    warp_ids = attention_tiles::warp_id_range(ids.kv, jw,
                                              attention_tiles::min64(jw + 16, h0.kv_valid));
  }
  // The first tile from (head, k) on that the block attends (advancing them),
  // and the warp's view of it; false past the last.
  const auto next_tile = [&](int64_t* head, int64_t* k, TileIds* seen) {
    *seen = {true, true};
    if (*k >= tiles_per_head) {
      ++*head;
      *k = 0;
    }
    if (*head >= group) return false;
    if (!ids.on()) return true;
    // Every head of the group has the same query tiles: the search wraps once.
    const int found = attention_tiles::next_meeting_tile(
        ids.q, first, kBr, rows.begin, rows.end, static_cast<int>(*k),
        static_cast<int>(tiles_per_head), block_ids, warp_ids, seen);
    if (found < tiles_per_head) {
      *k = found;
      return true;
    }
    if (++*head >= group) return false;
    *k = attention_tiles::next_meeting_tile(ids.q, first, kBr, rows.begin, rows.end, 0,
                                            static_cast<int>(tiles_per_head), block_ids, warp_ids,
                                            seen);
    return *k < tiles_per_head;
  };

  // Keys past the batch's key length are never read (whatever they hold).
  load_tile<kThreads, kKeys>(
      k_tile, TileSource<T>{key + kv_first, kv_stride, 0, h0.kv_valid, static_cast<int>(hd), vectors},
      j0);
  load_tile<kThreads, kKeys>(
      v_tile,
      TileSource<T>{value + v_first, v_stride, 0, h0.kv_valid, static_cast<int>(hdv), vectors}, j0);
  // Query tile k of query head `head` of the group into stage s.
  const auto load_queries = [&](int s, int64_t head, int64_t k) {
    const int64_t n = kv_head * group + head, t0 = first + k * kBr;
    const int64_t q_first = (b * p.q_len * p.num_heads + n) * hd;
    const int64_t dout_first = (b * p.q_len * p.num_heads + n) * hdv;
    load_tile<kThreads, kBr>(
        q_tile(s),
        TileSource<T>{query + q_first, q_stride, rows.begin, rows.end, static_cast<int>(hd), vectors},
        t0);
    load_tile<kThreads, kBr>(
        dout_tile(s),
        TileSource<T>{dout + dout_first, dout_stride, rows.begin, rows.end, static_cast<int>(hdv),
                      vectors},
        t0);
    for (int r = threadIdx.x; r < kBr; r += kThreads) {
      const int64_t row = t0 + r;
      const int64_t stat = (b * p.num_heads + n) * p.q_len + row;
      row_lse(s)[r] = row < p.q_len ? log2_lse(logsumexp[stat]) : CUDART_INF_F;
      row_d(s)[r] = row < p.q_len ? d[stat] : 0.0f;
    }
  };
  int64_t head = 0, k = 0;
  TileIds seen;
  bool more = tiles > 0 && next_tile(&head, &k, &seen);
  if (more) load_queries(0, head, k);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();

  // The query rows that may attend each of the lane's keys (g, g + 8).
  const attention_tiles::Limits rows_g = attention_tiles::rows_of_key(p, h0, jw + g);
  const attention_tiles::Limits rows_g8 = attention_tiles::rows_of_key(p, h0, jw + g + 8);
  float dk[kDv / 8][4] = {}, dv[kDv / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;
  // The tiles in order: head by head of the group, each head's query tiles.
  for (int s = 0; more; s ^= 1) {
    const int64_t n = kv_head * group + head, t0 = first + k * kBr;
    int64_t next_head = head, next_k = k + 1;
    TileIds next_seen;
    const bool next_more = next_tile(&next_head, &next_k, &next_seen);
    if (next_more) load_queries(s ^ 1, next_head, next_k);
    mma::cp_async_commit();
    if (t0 < warp_rows.end && t0 + kBr > warp_rows.begin && seen.meets) {
      const HeadView h = attention_tiles::head_view(p, b, n);
      float sc[kBr / 8][4] = {}, dp[kBr / 8][4] = {};
      mma_abt<T, kSteps>(sc, k_tile, 16 * warp, q_tile(s), 0);
      mma_abt<T, kValueSteps>(dp, v_tile, 16 * warp, dout_tile(s), 0);
      const bool whole = seen.uniform &&
                         attention_tiles::tile_fully_visible(p, h, t0, t0 + kBr, jw, jw + 16);
      const float* lse = row_lse(s);
      const float* dd = row_d(s);
#pragma unroll
      for (int j = 0; j < kBr / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 8 * j + 2 * t + (e & 1);  // query row within the tile
          float slope = 1.0f;
          float x;
          if (whole) {
            x = sc[j][e] * scale_log2;
            if (cap.on()) x = attention_tiles::capped(cap, x, &slope);
          } else {
            x = attention_tiles::visible_logit(
                p, h, ids, !seen.uniform, cap, t0 + r, jw + g + 8 * (e >> 1),
                attention_tiles::within(e >> 1 ? rows_g8 : rows_g, t0 + r), sc[j][e], scale_log2,
                &slope);
          }
          const float prob = exp2_approx(x - lse[r]);
          sc[j][e] = prob;
          // dS by the uncapped logit: the cap's slope (dK is scale times it).
          dp[j][e] = x == -CUDART_INF_F ? 0.0f : prob * (dp[j][e] - dd[r]) * slope;
        }
      }
      if (dv_columns) mma_pb<T>(dv, sc, dout_tile(s), 0, d0);
      if (dk_columns) mma_pb<T>(dk, dp, q_tile(s), 0, d0);
    }
    mma::cp_async_wait<0>();
    __syncthreads();  // the next tile is in, and every warp is done with stage s
    head = next_head;
    k = next_k;
    seen = next_seen;
    more = next_more;
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = jw + g + 8 * r;
    if (j >= p.kv_len) continue;
#pragma unroll
    for (int c = 0; c < kDv / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = d0 + 8 * c + 2 * t + e;
        if (col < hd) {
          dkey[kv_first + j * kv_stride + col] = from_float<T>(p.scale * dk[c][2 * r + e]);
        }
        if (col < hdv) dvalue[v_first + j * v_stride + col] = from_float<T>(dv[c][2 * r + e]);
      }
    }
  }
}

// -- dQ ----------------------------------------------------------------------------------------

template <typename T, int kHd, int kHdv, bool kFeatures>
__global__ void __launch_bounds__(32 * BackwardTiles<T, kHd, kHdv, kFeatures>::kQueryWarps, 1)
    attention_bwd_dq_mma_kernel(AttentionParams p, attention_tiles::SoftCap call_cap,
                                const T* query, const T* key, const T* value,
                                const float* logsumexp, const T* dout, const float* d, T* dquery,
                                float* dbias) {
  using Tiles = BackwardTiles<T, kHd, kHdv, kFeatures>;
  // Without the features the cap is off at compile time (as are the ids).
  const attention_tiles::SoftCap cap =
      kFeatures ? call_cap : attention_tiles::SoftCap{0.0f, 0.0f};
  using Tile = SwizzledTile<T, kHd>;
  using ValueTile = SwizzledTile<T, kHdv>;
  constexpr int kThreads = 32 * Tiles::kQueryWarps;
  constexpr int kRows = 16 * Tiles::kQueryWarps;
  constexpr int kBc = Tiles::kBc;
  constexpr int kSteps = kHd / Operand<T>::kK;
  constexpr int kValueSteps = kHdv / Operand<T>::kK;
  unsigned char* const shared = dynamic_shared_memory<unsigned char>();
  const Tile q_tile{shared};
  const ValueTile dout_tile{shared + Tiles::kRowTileBytes};
  unsigned char* const stages = shared + Tiles::kRowTileBytes + Tiles::kRowDoutBytes;
  const auto k_tile = [&](int s) { return Tile{stages + s * Tiles::kKvStageBytes}; };
  const auto v_tile = [&](int s) {
    return ValueTile{stages + s * Tiles::kKvStageBytes + Tiles::kKvTileBytes};
  };

  const BlockIndex at =
      attention_tiles::block_index(p.q_len, kRows, p.num_heads, p.num_heads / p.num_kv_heads);
  const HeadView h = attention_tiles::head_view(p, at.b, at.head);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int64_t t0 = at.row0, tw = t0 + 16 * warp;
  const int d0 = static_cast<int>(blockIdx.y) * Tiles::kDq;
  const int64_t hd = p.head_dim, hdv = kFeatures ? attention_tiles::value_head_dim(p) : p.head_dim;
  const int64_t q_stride = p.num_heads * hd, kv_stride = p.num_kv_heads * hd;
  const int64_t dout_stride = p.num_heads * hdv, v_stride = p.num_kv_heads * hdv;
  const int64_t q_first = (at.b * p.q_len * p.num_heads + at.head) * hd;
  const int64_t dout_first = (at.b * p.q_len * p.num_heads + at.head) * hdv;
  const int64_t kv_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hd;
  const int64_t v_first = (at.b * p.kv_len * p.num_kv_heads + at.kv_head) * hdv;
  const bool vectors = all_vector_rows(query, key, value, dout, hd, hdv);
  // The blocks of the other column chunks recompute dS: one adds it to dbias.
  float* const dbias_sum = blockIdx.y == 0 ? dbias : nullptr;

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
  const TileSource<T> k_rows{key + kv_first, kv_stride, keys.begin, keys.end, static_cast<int>(hd),
                             vectors};
  const TileSource<T> v_rows{value + v_first, v_stride, keys.begin, keys.end,
                             static_cast<int>(hdv), vectors};
  const auto load_keys = [&](int i, int s) {
    load_tile<kThreads, kBc>(k_tile(s), k_rows, first + int64_t{i} * kBc);
    load_tile<kThreads, kBc>(v_tile(s), v_rows, first + int64_t{i} * kBc);
  };
  const TileSource<T> q_rows{query + q_first, q_stride, 0, p.q_len, static_cast<int>(hd), vectors};
  const TileSource<T> dout_rows{dout + dout_first, dout_stride, 0, p.q_len, static_cast<int>(hdv),
                                vectors};
  load_tile<kThreads, kRows>(q_tile, q_rows, t0);
  load_tile<kThreads, kRows>(dout_tile, dout_rows, t0);
  TileIds seen;
  int i = next_tile(0, &seen);
  if (i < tiles) load_keys(i, 0);
  mma::cp_async_commit();
  // The warp's rows' logsumexp (log2 units) and D.
  float lse[2], dd[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = tw + g + 8 * r;
    const int64_t stat = (at.b * p.num_heads + at.head) * p.q_len + row;
    lse[r] = row < p.q_len ? log2_lse(logsumexp[stat]) : CUDART_INF_F;
    dd[r] = row < p.q_len ? d[stat] : 0.0f;
  }
  mma::cp_async_wait<0>();
  __syncthreads();

  // The keys each of the lane's rows (g, g + 8) may attend.
  const attention_tiles::Limits keys_g = attention_tiles::keys_of_row(p, h, tw + g);
  const attention_tiles::Limits keys_g8 = attention_tiles::keys_of_row(p, h, tw + g + 8);
  float dq[Tiles::kDq / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;
  for (int s = 0; i < tiles; s ^= 1) {
    const int64_t j0 = first + int64_t{i} * kBc;
    TileIds next_seen;
    const int next = next_tile(i + 1, &next_seen);
    if (next < tiles) load_keys(next, s ^ 1);
    mma::cp_async_commit();
    if (j0 < warp_keys.end && j0 + kBc > warp_keys.begin && seen.meets) {
      float sc[kBc / 8][4] = {}, ds[kBc / 8][4] = {};
      mma_abt<T, kSteps>(sc, q_tile, 16 * warp, k_tile(s), 0);
      mma_abt<T, kValueSteps>(ds, dout_tile, 16 * warp, v_tile(s), 0);
      const bool whole = seen.uniform &&
                         attention_tiles::tile_fully_visible(p, h, tw, tw + 16, j0, j0 + kBc);
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int64_t row = tw + g + 8 * r, col = j0 + 8 * j + 2 * t + (e & 1);
          float slope = 1.0f;
          float x;
          if (whole) {
            x = sc[j][e] * scale_log2;
            if (cap.on()) x = attention_tiles::capped(cap, x, &slope);
          } else {
            x = attention_tiles::visible_logit(
                p, h, ids, !seen.uniform, cap, row, col,
                attention_tiles::within(r ? keys_g8 : keys_g, col), sc[j][e], scale_log2, &slope);
          }
          const float prob = exp2_approx(x - lse[r]);
          const float dscore = x == -CUDART_INF_F ? 0.0f : prob * (ds[j][e] - dd[r]);
          // dbias takes dS by the capped logit, dQ by the uncapped one.
          ds[j][e] = dscore * slope;
          if (dbias_sum != nullptr && x != -CUDART_INF_F) {
            atomicAdd(dbias_sum + attention_tiles::broadcast_offset(p.bias_strides, h, row, col),
                      dscore);
          }
        }
      }
      mma_pb<T>(dq, ds, k_tile(s), 0, d0);
    }
    mma::cp_async_wait<0>();
    __syncthreads();
    i = next;
    seen = next_seen;
  }

  T* const dq_rows = dquery + q_first;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = tw + g + 8 * r;
    if (row >= p.q_len) continue;
#pragma unroll
    for (int c = 0; c < Tiles::kDq / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = d0 + 8 * c + 2 * t + e;
        if (col < hd) dq_rows[row * q_stride + col] = from_float<T>(p.scale * dq[c][2 * r + e]);
      }
    }
  }
}

template <typename T, int kHd, int kHdv, bool kFeatures>
cudaError_t launch_bwd(cudaStream_t stream, const AttentionParams& p, const T* q, const T* k,
                       const T* v, const float* lse, const T* dout, const float* d, T* dq, T* dk,
                       T* dv, float* dbias) {
  using Tiles = BackwardTiles<T, kHd, kHdv, kFeatures>;
  if (p.kv_len > 0) {
    const int64_t grid =
        attention_tiles::blocks(p.kv_len, 16 * Tiles::kKeyWarps, p.batch * p.num_kv_heads);
    if (!attention_tiles::fits_grid(grid)) return cudaErrorInvalidValue;
    const cudaError_t status = launch_kernel_dynamic_shared(
        attention_bwd_dkdv_mma_kernel<T, kHd, kHdv, kFeatures>,
        dim3(static_cast<unsigned>(grid), Tiles::kColumnBlocks), dim3(32 * Tiles::kKeyWarps),
        Tiles::kKeySideBytes, stream, p, attention_tiles::soft_cap(p, kLog2e), q, k, v, lse,
        dout, d, dk, dv);
    if (status != cudaSuccess) return status;
  }
  const int64_t grid =
      attention_tiles::blocks(p.q_len, 16 * Tiles::kQueryWarps, p.batch * p.num_heads);
  if (!attention_tiles::fits_grid(grid)) return cudaErrorInvalidValue;
  return launch_kernel_dynamic_shared(attention_bwd_dq_mma_kernel<T, kHd, kHdv, kFeatures>,
                                      dim3(static_cast<unsigned>(grid), kHd / Tiles::kDq),
                                      dim3(32 * Tiles::kQueryWarps), Tiles::kQuerySideBytes,
                                      stream, p, attention_tiles::soft_cap(p, kLog2e), q, k, v,
                                      lse, dout, d, dq, dbias);
}

}  // namespace

template <typename T>
cudaError_t tensor_core_bwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                            const T* key, const T* value, const float* logsumexp, const T* dout,
                            const float* d, T* dquery, T* dkey, T* dvalue, float* dbias) {
  const TensorCoreDims dims = tensor_core_dims(p);
  const auto launch = [&](auto kernels) {
    return kernels(stream, p, query, key, value, logsumexp, dout, d, dquery, dkey, dvalue, dbias);
  };
  if (dims.hdv != dims.hd) return launch(launch_bwd<T, 256, 128, true>);
  if (tensor_core_features(p)) {
    if (dims.hd == 64) return launch(launch_bwd<T, 64, 64, true>);
    if (dims.hd == 128) return launch(launch_bwd<T, 128, 128, true>);
    return launch(launch_bwd<T, 256, 256, true>);
  }
  if (dims.hd == 64) return launch(launch_bwd<T, 64, 64, false>);
  if (dims.hd == 128) return launch(launch_bwd<T, 128, 128, false>);
  return launch(launch_bwd<T, 256, 256, false>);
}

#define JAXOPS_TENSOR_CORE_BWD_DEFINE(T)                                                     \
  template cudaError_t tensor_core_bwd<T>(cudaStream_t, const AttentionParams&, const T*,    \
                                          const T*, const T*, const float*, const T*,        \
                                          const float*, T*, T*, T*, float*);

JAXOPS_TENSOR_CORE_BWD_DEFINE(float)
JAXOPS_TENSOR_CORE_BWD_DEFINE(__half)
JAXOPS_TENSOR_CORE_BWD_DEFINE(__nv_bfloat16)

#undef JAXOPS_TENSOR_CORE_BWD_DEFINE

}  // namespace jaxops::cuda::attention_kernels
