// The sm_90a forward of attention in the FlashAttention-3 design (issue 42):
// warp specialisation, TMA loads into a shared-memory ring, wgmma products
// (see attention.h for the contract, attention_kernels.h for hopper_fwd and
// when it applies; attention_forward.cu is the FlashAttention-2 kernel whose
// masking, log2-unit online softmax and conventions this one keeps).
//
// A CTA of 384 threads owns 128 query rows of one (batch, head):
//   warpgroup 0, the producer: setmaxnreg.dec to 24 registers; one elected lane
//     loads Q once (kHd / 64 boxes of 128 rows x 64 head dims) and then streams
//     the K and V tiles of kBlockN keys the CTA's rows can see (the causal
//     limit, the window and the lengths skip whole tiles) into a 2-stage ring,
//     every box 128-byte swizzled, by cp.async.bulk.tensor on 4D tensor maps
//     {H, heads, len, B} that zero-fill what lies outside the tensor (rows past
//     T or S, head dims past H up to the padded kHd). K and V have their own
//     full/empty mbarriers, so K of the next tile can land while V of this one
//     is still being read.
//   warpgroups 1 and 2, the consumers: setmaxnreg.inc to 240; each owns 64
//     rows (one m64 wgmma row block). Per key tile j, overlapped as FA3's
//     intra-warpgroup pipeline:
//       issue S_j = Q K_j^T     (wgmma SS, both K-major, kHd / 16 k-steps)
//       issue O += P_{j-1} V_{j-1} (wgmma RS: P in registers, V MN-major)
//       wait for S_j only (wait_group 1), release K_j;
//       softmax of S_j on the accumulator fragments: logits in log2 units
//         (scale * log2 e folded in), per-element masks only where a warp's
//         rows do not see the tile whole, row max by two quad shuffles, exp2,
//         per-lane row sums;
//       wait for the P V product, release V_{j-1}, rescale O by the max's
//         change and round P_j to T in registers (the accumulator elements
//         8k .. 8k + 7 are the RS A fragment of key step k).
//     Then the last P V, O / l rounded to T in plain stores, logsumexp.
// Values of keys the CTA's rows never attend but a tile holds (before the
// window, past the lengths or the causal limit) are zeroed in shared memory
// before their P V (a NaN there must not meet a zero probability, as the FA2
// kernel's zero-filled loads guarantee): only the first and last tiles of a
// CTA have such keys.
//
// Compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL, as cuda/wgmma.cuh):
// every other device architecture of the build compiles the kernel body to a
// trap, and the dispatcher sends only sm_90 devices here. Under the CPU
// harness (tests/cuda_harness) the whole kernel runs with wgmma, TMA and
// mbarriers emulated and their hazards checked.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/attention.h"
#include "cuda/attention_fragments.cuh"
#include "cuda/attention_kernels.h"
#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"
#include "cuda/tensor_map.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

#if defined(JAXOPS_CUDA_HARNESS) || !defined(__CUDA_ARCH__) || \
    (__CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define JAXOPS_HOPPER_FWD_BODY 1
#endif

namespace jaxops::cuda::attention_kernels {
namespace {

namespace wg = ::jaxops::cuda::wgmma;
namespace tma = ::jaxops::cuda::tma;
using attention_mma::exp2_approx;
using attention_mma::kFullWarp;
using attention_mma::kLn2;
using attention_mma::kLog2e;
using attention_mma::quad_max;
using attention_mma::quad_sum;
using attention_tiles::BlockIndex;
using attention_tiles::HeadView;
using attention_tiles::Range;

constexpr int kThreads = 384;          // producer + 2 consumer warpgroups
constexpr int kBlockM = 128;           // query rows of a CTA, 64 per consumer warpgroup
constexpr int kBlockN = 128;           // keys of a K/V tile
constexpr int kStages = 2;
constexpr int kColumnBlock = 64;       // head dims of one 128-byte swizzled row (16-bit T)
constexpr uint32_t kRowBytes = 128;
constexpr uint32_t kSwizzleAlignment = 1024;
#ifdef JAXOPS_HOPPER_FWD_BODY
constexpr int kConsumerThreads = 256;
constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
constexpr uint32_t kZeroBarrier = 1;   // named barrier of the consumers' V zeroing
#endif

// Shared memory, from a 1024-byte aligned base: Q (kHd / 64 column blocks of
// 128 rows x 128 bytes), K stages, V stages (kHd / 64 column blocks of kBlockN
// rows x 128 bytes each), then the mbarriers.
template <int kHd>
struct HopperTiles {
  static constexpr int kColumnBlocks = kHd / kColumnBlock;
  static constexpr uint32_t kQBlockBytes = kBlockM * kRowBytes;
  static constexpr uint32_t kKvBlockBytes = kBlockN * kRowBytes;
  static constexpr uint32_t kQBytes = kColumnBlocks * kQBlockBytes;
  static constexpr uint32_t kKvTileBytes = kColumnBlocks * kKvBlockBytes;
  static constexpr uint32_t kKOffset = kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKvTileBytes;
  static constexpr uint32_t kBarrierOffset = kVOffset + kStages * kKvTileBytes;
  // q_full, k_full[2], v_full[2], k_empty[2], v_empty[2]
  static constexpr uint32_t kBarriers = 1 + 4 * kStages;
  static constexpr uint32_t kSharedBytes = kBarrierOffset + kBarriers * 8 + kSwizzleAlignment;
  static_assert(kSharedBytes <= 227 * 1024, "fits sm_90's shared memory per block");
};

#ifdef JAXOPS_HOPPER_FWD_BODY
// The S accumulator's element i of this thread: row 16 w + l / 4 + 8 ((i / 2) % 2),
// column 8 (i / 4) + 2 (l % 4) + i % 2 (wgmma::accumulator_coord).
__device__ __forceinline__ int acc_row(int thread, int i) {
  return 16 * (thread / 32) + (thread % 32) / 4 + 8 * ((i / 2) % 2);
}
__device__ __forceinline__ int acc_col(int thread, int i) {
  return 8 * (i / 4) + 2 * (thread % 4) + i % 2;
}

#endif

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  uint16_t ua, ub;
  memcpy(&ua, &a, 2);
  memcpy(&ub, &b, 2);
  return static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
}

template <typename T, int kHd>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_fwd_kernel(const __grid_constant__ CUtensorMap q_map,
                      const __grid_constant__ CUtensorMap k_map,
                      const __grid_constant__ CUtensorMap v_map, AttentionParams p,
                      attention_tiles::SoftCap cap, T* out, float* logsumexp) {
#ifdef JAXOPS_HOPPER_FWD_BODY
  using Tiles = HopperTiles<kHd>;
  constexpr int kColumnBlocks = Tiles::kColumnBlocks;
  unsigned char* const raw = dynamic_shared_memory<unsigned char>();
  unsigned char* const smem =
      raw + (kSwizzleAlignment - reinterpret_cast<uintptr_t>(raw) % kSwizzleAlignment) %
                kSwizzleAlignment;
  uint64_t* const q_full = reinterpret_cast<uint64_t*>(smem + Tiles::kBarrierOffset);
  uint64_t* const k_full = q_full + 1;
  uint64_t* const v_full = k_full + kStages;
  uint64_t* const k_empty = v_full + kStages;
  uint64_t* const v_empty = k_empty + kStages;
  unsigned char* const q_tile = smem;
  const auto k_tile = [&](int stage) { return smem + Tiles::kKOffset + stage * Tiles::kKvTileBytes; };
  const auto v_tile = [&](int stage) { return smem + Tiles::kVOffset + stage * Tiles::kKvTileBytes; };

  const BlockIndex at =
      attention_tiles::block_index(p.q_len, kBlockM, p.num_heads, p.num_heads / p.num_kv_heads);
  const HeadView h = attention_tiles::head_view(p, at.b, at.head);
  const int64_t t0 = at.row0;
  const Range keys = attention_tiles::key_range(p, h, t0, t0 + kBlockM);
  const int64_t first = keys.begin / kBlockN * kBlockN;
  const int tiles =
      keys.begin < keys.end ? static_cast<int>((keys.end - first + kBlockN - 1) / kBlockN) : 0;
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;

  if (threadIdx.x == 0) {
    tma::init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      tma::init(&k_full[s], 1);
      tma::init(&v_full[s], 1);
      tma::init(&k_empty[s], kConsumerThreads);
      tma::init(&v_empty[s], kConsumerThreads);
    }
    tma::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // The producer.
    tma::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x < 32 && tiles > 0 && tma::elect_one()) {
      tma::prefetch_tensor_map(&q_map);
      tma::prefetch_tensor_map(&k_map);
      tma::prefetch_tensor_map(&v_map);
      const int32_t b = static_cast<int32_t>(at.b), head = static_cast<int32_t>(at.head);
      const int32_t kv_head = static_cast<int32_t>(at.kv_head);
      tma::arrive_expect_tx(q_full, Tiles::kQBytes);
      for (int c = 0; c < kColumnBlocks; ++c) {
        tma::load_4d(q_tile + c * Tiles::kQBlockBytes, &q_map, c * kColumnBlock, head,
                     static_cast<int32_t>(t0), b, q_full);
      }
      // In the order the consumers use them: K_0, then K_{j+1} before V_j (the
      // consumers issue S_{j+1} before P_j V_j).
      const auto load = [&](const CUtensorMap* map, unsigned char* tile, uint64_t* full,
                            uint64_t* empty, int j) {
        const uint32_t parity = ((static_cast<uint32_t>(j / kStages)) & 1u) ^ 1u;
        const int32_t j0 = static_cast<int32_t>(first + int64_t{j} * kBlockN);
        tma::wait_parity(empty, parity);
        tma::arrive_expect_tx(full, Tiles::kKvTileBytes);
        for (int c = 0; c < kColumnBlocks; ++c) {
          tma::load_4d(tile + c * Tiles::kKvBlockBytes, map, c * kColumnBlock, kv_head, j0, b,
                       full);
        }
      };
      for (int j = 0; j <= tiles; ++j) {
        if (j < tiles) {
          const int s = j % kStages;
          load(&k_map, k_tile(s), &k_full[s], &k_empty[s], j);
        }
        if (j > 0) {
          const int s = (j - 1) % kStages;
          load(&v_map, v_tile(s), &v_full[s], &v_empty[s], j - 1);
        }
      }
    }
    return;
  }

  // The consumers.
  tma::setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int thread = static_cast<int>(threadIdx.x) - 128 * warpgroup;  // in the warpgroup
  const int consumer_thread = static_cast<int>(threadIdx.x) - 128;     // 0..255
  const int warp = thread / 32;
  const int64_t tg = t0 + 64 * consumer;  // the warpgroup's first row
  const int64_t tw = tg + 16 * warp;      // the warp's first row
  // The keys each of the thread's two rows may attend.
  const attention_tiles::Limits limits[2] = {
      attention_tiles::keys_of_row(p, h, tg + acc_row(thread, 0)),
      attention_tiles::keys_of_row(p, h, tg + acc_row(thread, 2))};
  const attention_tiles::Segments ids = attention_tiles::segments_of(p, at.b);
  // The segment ids of the thread's rows (rows past q_len attend nothing).
  int row_ids[2] = {0, 0};
  if (ids.on()) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = tg + acc_row(thread, 2 * r);
      row_ids[r] = row < p.q_len ? ids.q[row] : 0;
    }
  }
  const float scale_log2 = p.scale * kLog2e;

  wg::Accumulator<kBlockN> s_acc;
  wg::Accumulator<kHd> o_acc;
#pragma unroll
  for (int i = 0; i < kHd / 2; ++i) o_acc[i] = 0.0f;
  uint32_t prob[kBlockN / 16][4];
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.0f, 0.0f};

  const uint32_t q_address = wg::shared_address(q_tile) + 64 * consumer * kRowBytes;
  // S = Q K^T of the tile in stage s, issued and committed (not waited for).
  const auto issue_s = [&](int s) {
    const uint32_t k_address = wg::shared_address(k_tile(s));
#pragma unroll
    for (int ks = 0; ks < kHd / 16; ++ks) {
      const uint32_t column = static_cast<uint32_t>(ks % 4) * 32u;  // k16 step in the row
      const uint64_t qd = wg::make_descriptor(
          q_address + (ks / 4) * Tiles::kQBlockBytes + column, wg::Swizzle::k128B, 16, 1024);
      const uint64_t kd = wg::make_descriptor(
          k_address + (ks / 4) * Tiles::kKvBlockBytes + column, wg::Swizzle::k128B, 16, 1024);
      wg::mma_ss<T, wg::Major::kK, wg::Major::kK>(s_acc, qd, kd, ks > 0);
    }
    wg::commit_group();
  };
  // O += P V of the tile in stage s, issued and committed.
  const auto issue_pv = [&](int s) {
    const uint32_t v_address = wg::shared_address(v_tile(s));
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t vd = wg::make_descriptor(v_address + kk * 16 * kRowBytes, wg::Swizzle::k128B,
                                              Tiles::kKvBlockBytes, 1024);
      wg::mma_rs<T, wg::Major::kMN>(o_acc, prob[kk], vd, true);
    }
    wg::commit_group();
  };
  // Zeroes the values of the keys of tile j (stage s) outside the CTA's key
  // range and below kv_len (the TMA zero-fills the rest), shared by the 256
  // consumer threads, then fences them for the async proxy and meets the other
  // consumer warpgroup (both read the whole tile). Every consumer thread calls
  // it for the same tiles.
  const auto zero_unattended_values = [&](int j, int s) {
    const int64_t j0 = first + int64_t{j} * kBlockN;
    const int lo = static_cast<int>(keys.begin - j0);  // rows [0, lo) are before the range
    const int64_t stop = attention_tiles::min64(j0 + kBlockN, p.kv_len);
    const int hi = static_cast<int>(keys.end - j0);    // rows [hi, stop - j0) after it
    const int tail = static_cast<int>(stop - j0) - hi;
    if (lo <= 0 && tail <= 0) return;
    const int head_rows = lo > 0 ? lo : 0, tail_rows = tail > 0 ? tail : 0;
    const int rows = head_rows + tail_rows;
    constexpr int kChunks = static_cast<int>(kRowBytes / 16);
    unsigned char* const tile = v_tile(s);
    for (int i = consumer_thread; i < rows * kColumnBlocks * kChunks; i += kConsumerThreads) {
      const int r = i / (kColumnBlocks * kChunks), rest = i % (kColumnBlocks * kChunks);
      const int row = r < head_rows ? r : hi + (r - head_rows);
      const int c = rest / kChunks, chunk = rest % kChunks;
      *reinterpret_cast<uint4*>(tile + c * Tiles::kKvBlockBytes + row * kRowBytes + chunk * 16) =
          uint4{0u, 0u, 0u, 0u};
    }
    tma::fence_proxy_async();
    tma::named_sync(kZeroBarrier, kConsumerThreads);
  };
  // The online softmax of S (tile j) into the probabilities in s_acc and the
  // rescale factors of the rows' earlier sums and O in alpha.
  const auto softmax = [&](int j, float (&alpha)[2]) {
    const int64_t j0 = first + int64_t{j} * kBlockN;
    if (!ids.on() && attention_tiles::tile_fully_visible(p, h, tw, tw + 16, j0, j0 + kBlockN)) {
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) {
        float x = s_acc[i] * scale_log2;
        if (cap.on()) x = attention_tiles::capped(cap, x);
        s_acc[i] = x;
      }
    } else {
      // Two int32 comparisons against the row's key limits (sequence lengths
      // stay below 2^31) and, with segment ids, the key's id against the row's.
      const int c0 = static_cast<int>(j0) + acc_col(thread, 0);
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) {
        const int r = (i / 2) % 2;
        const int col = c0 + 8 * (i / 4) + i % 2;
        bool visible = col >= limits[r].begin && col < limits[r].end;
        if (ids.on() && visible) visible = ids.kv[col] == row_ids[r];
        float x = s_acc[i] * scale_log2;
        if (cap.on()) x = attention_tiles::capped(cap, x);
        s_acc[i] = visible ? x : -CUDART_INF_F;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = row_max[r];
#pragma unroll
      for (int k = 0; k < kBlockN / 8; ++k) {
        tile_max = fmaxf(tile_max, fmaxf(s_acc[4 * k + 2 * r], s_acc[4 * k + 2 * r + 1]));
      }
      tile_max = quad_max(tile_max);
      // A row that has seen no key yet keeps max -inf: subtract 0 then.
      const float base = tile_max == -CUDART_INF_F ? 0.0f : tile_max;
      alpha[r] = exp2_approx(row_max[r] - base);
      row_max[r] = tile_max;
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kBlockN / 8; ++k) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float x = exp2_approx(s_acc[4 * k + e] - base);
          s_acc[4 * k + e] = x;
          sum += x;
        }
      }
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
  };
  const auto round_probabilities = [&]() {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        prob[kk][r] = pack_pair<T>(s_acc[8 * kk + 2 * r], s_acc[8 * kk + 2 * r + 1]);
      }
    }
  };

  if (tiles > 0) {
    tma::wait_parity(q_full, 0);
    // Tile 0: S, softmax, P (O is still zero: no rescale).
    tma::wait_parity(&k_full[0], 0);
    wg::fence();
    issue_s(0);
    wg::wait_group<0>(s_acc);
    tma::arrive(&k_empty[0]);
    float alpha[2];
    softmax(0, alpha);
    round_probabilities();
    for (int j = 1; j < tiles; ++j) {
      const int s = j % kStages, prev = (j - 1) % kStages;
      tma::wait_parity(&k_full[s], static_cast<uint32_t>(j / kStages) & 1u);
      wg::fence();
      issue_s(s);
      tma::wait_parity(&v_full[prev], static_cast<uint32_t>((j - 1) / kStages) & 1u);
      zero_unattended_values(j - 1, prev);
      wg::fence();
      issue_pv(prev);
      wg::wait_group<1>(s_acc);  // S_j is in; P_{j-1} V_{j-1} may still run
      tma::arrive(&k_empty[s]);
      softmax(j, alpha);
      wg::wait_group<0>(o_acc);
      tma::arrive(&v_empty[prev]);
#pragma unroll
      for (int i = 0; i < kHd / 2; ++i) o_acc[i] *= alpha[(i / 2) % 2];
      round_probabilities();
    }
    const int last = (tiles - 1) % kStages;
    tma::wait_parity(&v_full[last], static_cast<uint32_t>((tiles - 1) / kStages) & 1u);
    zero_unattended_values(tiles - 1, last);
    wg::fence();
    issue_pv(last);
    wg::wait_group<0>(o_acc);
    tma::arrive(&v_empty[last]);
  }

  // O / l rounded to T, and the natural-log logsumexp.
  const int64_t hd = p.head_dim;
  T* const out_rows = out + (at.b * p.q_len * p.num_heads + at.head) * hd;
  const int64_t out_stride = p.num_heads * hd;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const int64_t row = tg + acc_row(thread, 2 * r);
    if (row >= p.q_len) continue;
    // A row with no attended key has sum 0: output 0, logsumexp -inf (a NaN
    // sum, from NaN logits, gives a NaN row).
    const float inverse = sum != 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int k = 0; k < kHd / 8; ++k) {
      const int i = 4 * k + 2 * r;
      const int col = acc_col(thread, i);
      if (col < hd) {
        const uint32_t pair = pack_pair<T>(o_acc[i] * inverse, o_acc[i + 1] * inverse);
        *reinterpret_cast<uint32_t*>(out_rows + row * out_stride + col) = pair;
      }
    }
    if (thread % 4 == 0) {
      logsumexp[(at.b * p.num_heads + at.head) * p.q_len + row] =
          sum != 0.0f ? row_max[r] * kLn2 + logf(sum) : -CUDART_INF_F;
    }
  }
#else
  (void)p;
  (void)cap;
  (void)out;
  (void)logsumexp;
  __trap();
#endif
}

template <typename T>
tma::TensorDtype tensor_dtype() {
  return std::is_same<T, __half>::value ? tma::TensorDtype::kFloat16 : tma::TensorDtype::kBfloat16;
}

// The 4D map {H, heads, len, B} of a [B, len, heads, H] tensor, boxes of 64 head
// dims x `rows` rows of one head, 128-byte swizzled.
template <typename T>
bool sequence_map(CUtensorMap* map, const T* x, int64_t batch, int64_t len, int64_t heads,
                  int64_t head_dim, uint32_t rows) {
  const uint64_t e = sizeof(T);
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(len), static_cast<uint64_t>(batch)};
  const uint64_t strides[3] = {head_dim * e, heads * head_dim * e, len * heads * head_dim * e};
  const uint32_t box[4] = {static_cast<uint32_t>(kColumnBlock), 1, rows, 1};
  return tma::make_tensor_map_4d(map, tensor_dtype<T>(), x, dims, strides, box, 128).empty();
}

template <typename T, int kHd>
cudaError_t launch_hopper_fwd(cudaStream_t stream, const AttentionParams& p, const T* q,
                              const T* k, const T* v, T* out, float* lse) {
  using Tiles = HopperTiles<kHd>;
  const int64_t grid = attention_tiles::blocks(p.q_len, kBlockM, p.batch * p.num_heads);
  if (!attention_tiles::fits_grid(grid)) return cudaErrorInvalidValue;
  CUtensorMap q_map, k_map, v_map;
  if (!sequence_map(&q_map, q, p.batch, p.q_len, p.num_heads, p.head_dim, kBlockM) ||
      !sequence_map(&k_map, k, p.batch, p.kv_len, p.num_kv_heads, p.head_dim, kBlockN) ||
      !sequence_map(&v_map, v, p.batch, p.kv_len, p.num_kv_heads, p.head_dim, kBlockN)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel_dynamic_shared(hopper_fwd_kernel<T, kHd>, dim3(static_cast<unsigned>(grid)),
                                      dim3(kThreads), Tiles::kSharedBytes, stream, q_map, k_map,
                                      v_map, p, attention_tiles::soft_cap(p, kLog2e), out, lse);
}

}  // namespace

bool hopper_fwd_supports(const AttentionParams& p, HopperDtype dtype) {
  if (dtype != HopperDtype::kFloat16 && dtype != HopperDtype::kBfloat16) return false;
  const int64_t hd = p.head_dim;
  if (hd <= 0 || hd > 128 || hd % 8 != 0) return false;  // 16-byte TMA strides, 2-byte types
  if (params::value_head_dim(p) != hd) return false;
  if (p.mask != nullptr || p.bias != nullptr) return false;
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) return false;
  if (p.batch <= 0 || p.q_len <= 0 || p.kv_len <= 0 || p.num_heads <= 0 ||
      p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return false;
  }
  // The tensor maps' dims (at most 2^32 each) and byte strides (below 2^40).
  constexpr int64_t kMaxDim = int64_t{1} << 32, kMaxStride = int64_t{1} << 40;
  if (p.batch > kMaxDim || p.num_heads > kMaxDim) return false;
  const int64_t longest = p.q_len > p.kv_len ? p.q_len : p.kv_len;
  const int64_t heads = p.num_heads;
  if (longest * heads * hd * 2 >= kMaxStride) return false;
  return true;
}

template <typename T>
cudaError_t hopper_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                       const T* key, const T* value, T* out, float* logsumexp) {
  const HopperDtype dtype =
      std::is_same<T, __half>::value ? HopperDtype::kFloat16 : HopperDtype::kBfloat16;
  if (!hopper_fwd_supports(p, dtype)) return cudaErrorInvalidValue;
  if (p.head_dim <= 64) return launch_hopper_fwd<T, 64>(stream, p, query, key, value, out, logsumexp);
  return launch_hopper_fwd<T, 128>(stream, p, query, key, value, out, logsumexp);
}

template cudaError_t hopper_fwd<__half>(cudaStream_t, const AttentionParams&, const __half*,
                                        const __half*, const __half*, __half*, float*);
template cudaError_t hopper_fwd<__nv_bfloat16>(cudaStream_t, const AttentionParams&,
                                               const __nv_bfloat16*, const __nv_bfloat16*,
                                               const __nv_bfloat16*, __nv_bfloat16*, float*);

}  // namespace jaxops::cuda::attention_kernels
