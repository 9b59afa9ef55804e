// Attention over a paged KV cache and the cache's update on CUDA (see
// paged_attention.h for the contract, params/paged_attention.h for the
// operation).
//
// Attention runs the decode kernels of kv_decode.cuh (FlashDecoding: a block
// per kv head, tile of its GQA group's T * G query rows and key split of a
// sequence, every key and value row read once for the group, split-K merged
// by log-sum-exp) with the pages as the row source: key j of a sequence is
// read where its block table puts it, through params/paged_attention.h's
// clamping, with no gathered copy; int8 rows are dequantised in registers.
// Chunked prefill takes one tile per 16 rows, each reading the keys its rows
// see: correct, not tuned. A value head dim of its own (MLA's 192/128), values
// in the key rows (absorbed MLA: 576/512, one cache read once for both
// products) and heads above 256 take the MLA kernel of kv_decode.cuh, whose
// warps split a tile's output columns rather than its keys
// (params/paged_attention_plan.h says which).
//
// The update writes one token's rows per warp (unless a later token names the
// same slot: the last one wins): a copy for float pages, the symmetric per-row
// int8 quantization (a warp max) for int8 pages; only the key row where the
// values are in the keys.
#include "cuda/paged_attention.h"

#include <cstdint>
#include <type_traits>

#include <math_constants.h>

#include "cuda/float_convert.cuh"
#include "cuda/kv_decode.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using kv_decode::SequenceMask;
using params::paged_kv_len;
using params::paged_query_len;
using params::paged_slot_valid;

constexpr int kThreads = 128;
constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
// A grid's x extent (and so every index the kernels keep in 32 bits).
constexpr int64_t kMaxBlocks = int64_t{1} << 31;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Key j of kv head kh of sequence b is in page block_tables[b, j / page_size]
// (clamped to the pool) at offset j % page_size: row (page * page_size +
// offset) * K + kh of the key pages [P, page_size, K, H] and of the value
// pages [P, page_size, K, Hv].
template <typename KV>
struct PagedRows {
  using Element = KV;
  static constexpr bool kScaled = std::is_same<KV, int8_t>::value;
  const KV* key;
  const KV* value;
  const float* key_scales;
  const float* value_scales;
  PagedAttentionParams p;

  // The queries are the last q_valid tokens of the sequence's kv_valid.
  __device__ SequenceMask sequence(int b) const {
    const int kv = static_cast<int>(paged_kv_len(p, b));
    const int q = static_cast<int>(paged_query_len(p, b));
    return {kv - q, q, kv};
  }
  // 32-bit division: keys are below M * page_size < 2^31.
  __device__ int64_t row(int b, int kh, int j) const {
    const int page_size = static_cast<int>(p.page_size);
    const int index = j / page_size;
    const int64_t id = p.block_tables[static_cast<int64_t>(b) * p.max_pages_per_seq + index];
    const int64_t page = id < 0 ? 0 : (id >= p.num_pages ? p.num_pages - 1 : id);
    return (page * page_size + (j - index * page_size)) * p.num_kv_heads + kh;
  }
};

template <typename Rows, typename Q, typename Unit, int kOut, int kRows>
__global__ void __launch_bounds__(kv_decode::kThreads, kv_decode::kMinBlocksPerSm)
    paged_attention_kernel(kv_decode::DecodeLaunch L, Rows rows, const Q* query, Q* out,
                           float* logsumexp, float* partial) {
  kv_decode::decode_block<Rows, Q, Unit, kOut, kRows>(L, rows, query, out, logsumexp, partial);
}

template <typename Q>
__global__ void __launch_bounds__(kv_decode::kThreads)
    paged_attention_merge_kernel(kv_decode::DecodeLaunch L, const float* partial, Q* out,
                                 float* logsumexp) {
  kv_decode::decode_merge_row<kv_decode::kMaxOut>(L, partial, out, logsumexp);
}

// MLA layouts: a value head dim of its own, values in the key rows, heads
// wider than the decode kernel's.
template <typename Rows, typename Q, typename Unit, bool kValuesInKeys>
__global__ void __launch_bounds__(kv_decode::kThreads, kv_decode::kMinBlocksPerSm)
    paged_attention_mla_kernel(kv_decode::MlaLaunch L, Rows rows, const Q* query, Q* out,
                               float* logsumexp, float* partial) {
  kv_decode::mla_decode_block<Rows, Q, Unit, kValuesInKeys>(L, rows, query, out, logsumexp,
                                                            partial);
}

template <typename Q>
__global__ void __launch_bounds__(kv_decode::kThreads)
    paged_attention_mla_merge_kernel(kv_decode::MlaLaunch L, const float* partial, Q* out,
                                     float* logsumexp) {
  kv_decode::decode_merge_row<kv_decode::kMlaMergeOut>(L, partial, out, logsumexp);
}

struct PagedAttentionKernels {
  template <typename Rows, typename Q, typename Unit, int kOut, int kRows>
  static auto decode() {
    return paged_attention_kernel<Rows, Q, Unit, kOut, kRows>;
  }
  template <typename Q>
  static auto merge() {
    return paged_attention_merge_kernel<Q>;
  }
  template <typename Rows, typename Q, typename Unit, bool kValuesInKeys>
  static auto mla() {
    return paged_attention_mla_kernel<Rows, Q, Unit, kValuesInKeys>;
  }
  template <typename Q>
  static auto mla_merge() {
    return paged_attention_mla_merge_kernel<Q>;
  }
};

// -- the cache update ------------------------------------------------------------------

// A float page row: a copy.
template <typename T>
__device__ __forceinline__ void write_page_row(const T* src, T* dst, float* /*scale*/, int lane,
                                               int64_t h_dim) {
  for (int64_t h = lane; h < h_dim; h += kWarpSize) dst[h] = src[h];
}

// x != x: portable to the CPU harness, and kept as written (no fast math).
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

// max|x| over a warp's lanes, NaN when any lane's is (fmaxf would skip it).
__device__ __forceinline__ float warp_abs_max(float amax) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullWarp, amax, offset);
    if (other > amax || is_nan(other)) amax = other;
  }
  return amax;
}

// An int8 page row, bit for bit jaxops.reference.quantize_int8_rows: scale =
// max|x| / 127 (0 for an all-zero row) and q = round(x / scale) in
// [-127, 127] (rintf: to nearest even, as jnp.round). A NaN in the row makes
// the scale NaN and the row zeros; an infinity makes the scale inf, the finite
// elements 0 and the infinite ones inf / inf = NaN, written as 0 (XLA's
// conversion of NaN to an integer).
template <typename In>
__device__ __forceinline__ void write_page_row(const In* src, int8_t* dst, float* scale, int lane,
                                               int64_t h_dim) {
  float amax = 0.0f;
  for (int64_t h = lane; h < h_dim; h += kWarpSize) {
    const float a = fabsf(to_float(src[h]));
    if (a > amax || is_nan(a)) amax = a;
  }
  amax = warp_abs_max(amax);
  const float row_scale = amax / 127.0f;
  for (int64_t h = lane; h < h_dim; h += kWarpSize) {
    const float q = row_scale > 0.0f ? rintf(to_float(src[h]) / row_scale) : 0.0f;
    dst[h] = is_nan(q) ? int8_t{0} : static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f));
  }
  if (lane == 0) *scale = row_scale;
}

// True when a token after `token` names the same slot: the header's rule is
// that the last token's rows land, so this one is not written (a warp-wide
// scan of the later slots, no workspace; cheap for the decode step's few
// tokens, quadratic but coalesced for a long prefill).
__device__ __forceinline__ bool overwritten_later(const PagedKvUpdateParams& p,
                                                  const int32_t* slot_mapping, int64_t token,
                                                  int32_t slot, int lane) {
  for (int64_t first = token + 1; first < p.num_tokens; first += kWarpSize) {
    const int64_t later = first + lane;
    if (__any_sync(kFullWarp, later < p.num_tokens && slot_mapping[later] == slot)) return true;
  }
  return false;
}

// value_dim: the value rows' head dim, 0 when there are none to write (the
// values are in the key rows).
template <typename In, typename KV>
__global__ void __launch_bounds__(kThreads)
    paged_kv_update_kernel(PagedKvUpdateParams p, int64_t value_dim, const In* key,
                           const In* value, const int32_t* slot_mapping, KV* key_pages,
                           KV* value_pages, float* key_scales, float* value_scales) {
  // A warp per token, for all its kv heads; a warp leaves as a whole (its
  // shuffles and votes).
  const int64_t token = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (token >= p.num_tokens) return;
  const int32_t slot = slot_mapping[token];
  if (!paged_slot_valid(p, slot)) return;  // padding
  if (overwritten_later(p, slot_mapping, token, slot, lane)) return;
  for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
    const int64_t row = token * p.num_kv_heads + kv_head;
    const int64_t to = static_cast<int64_t>(slot) * p.num_kv_heads + kv_head;
    write_page_row(key + row * p.head_dim, key_pages + to * p.head_dim,
                   key_scales != nullptr ? key_scales + to : nullptr, lane, p.head_dim);
    if (value_dim > 0) {
      write_page_row(value + row * value_dim, value_pages + to * value_dim,
                     value_scales != nullptr ? value_scales + to : nullptr, lane, value_dim);
    }
  }
}

template <typename KV>
constexpr bool kQuantized = std::is_same<KV, int8_t>::value;

}  // namespace

template <typename Q, typename KV>
cudaError_t launch_paged_attention(cudaStream_t stream, const PagedAttentionParams& p,
                                   const PagedAttentionPlan& plan, const Q* query,
                                   const KV* key_pages, const KV* value_pages, Q* out,
                                   float* logsumexp, void* workspace) {
  const int64_t value_dim = params::paged_value_head_dim(p);
  if (params::paged_attention_params_error(p) != nullptr ||
      p.head_dim > kCudaPagedAttentionMaxHeadDim ||
      value_dim > kCudaPagedAttentionMaxValueHeadDim) {
    return cudaErrorInvalidValue;
  }
  if (p.batch * p.num_heads * p.q_len == 0) return cudaSuccess;
  if (kQuantized<KV> != (p.key_scales != nullptr) ||
      (kQuantized<KV> && !p.values_in_keys && p.value_scales == nullptr)) {
    return cudaErrorInvalidValue;
  }
  kv_decode::DecodeShape shape;
  shape.batch = static_cast<int>(p.batch);
  shape.q_len = static_cast<int>(p.q_len);
  shape.num_heads = static_cast<int>(p.num_heads);
  shape.num_kv_heads = static_cast<int>(p.num_kv_heads);
  shape.head_dim = static_cast<int>(p.head_dim);
  shape.capacity = static_cast<int>(p.max_pages_per_seq * p.page_size);
  shape.scale = p.scale;
  shape.soft_cap = p.logits_soft_cap;
  shape.causal = true;  // against the cache: row t sees the keys up to its position
  shape.window_left = p.window_left;
  if (params::paged_attention_takes_mla_kernel(p)) {
    const int hv = static_cast<int>(value_dim);
    if (p.values_in_keys) {
      const PagedRows<KV> rows{key_pages, key_pages, p.key_scales, p.key_scales, p};
      return kv_decode::launch_mla_decode<PagedAttentionKernels, PagedRows<KV>, Q, true>(
          stream, shape, hv, plan, rows, query, out, logsumexp, workspace);
    }
    const PagedRows<KV> rows{key_pages, value_pages, p.key_scales, p.value_scales, p};
    return kv_decode::launch_mla_decode<PagedAttentionKernels, PagedRows<KV>, Q, false>(
        stream, shape, hv, plan, rows, query, out, logsumexp, workspace);
  }
  // Value rows as wide as the key rows: when they are the key rows
  // themselves (values in keys, Hv = H), the key pages serve as value pages.
  const PagedRows<KV> rows = p.values_in_keys
                                 ? PagedRows<KV>{key_pages, key_pages, p.key_scales,
                                                 p.key_scales, p}
                                 : PagedRows<KV>{key_pages, value_pages, p.key_scales,
                                                 p.value_scales, p};
  return kv_decode::launch_decode<PagedAttentionKernels>(stream, shape, plan, rows, query, out,
                                                        logsumexp, workspace);
}

template <typename Q, typename KV>
cudaError_t launch_paged_attention(cudaStream_t stream, const PagedAttentionParams& p,
                                   const Q* query, const KV* key_pages, const KV* value_pages,
                                   Q* out, float* logsumexp, void* workspace) {
  const PagedAttentionPlan plan =
      workspace != nullptr ? paged_attention_plan(p) : paged_attention_plan_with_splits(p, 1);
  return launch_paged_attention(stream, p, plan, query, key_pages, value_pages, out, logsumexp,
                                workspace);
}

template <typename In, typename KV>
cudaError_t launch_paged_kv_update(cudaStream_t stream, const PagedKvUpdateParams& p,
                                   const In* key, const In* value, const int32_t* slot_mapping,
                                   KV* key_pages, KV* value_pages, float* key_scales,
                                   float* value_scales) {
  if (params::paged_kv_update_params_error(p) != nullptr) return cudaErrorInvalidValue;
  // Nothing to write, or no slot to write to.
  const int64_t value_dim = p.values_in_keys ? 0 : params::paged_value_head_dim(p);
  if (p.num_tokens == 0 || p.num_kv_heads == 0 || (p.head_dim == 0 && value_dim == 0) ||
      p.num_pages * p.page_size == 0) {
    return cudaSuccess;
  }
  if (kQuantized<KV> != (key_scales != nullptr) ||
      (!p.values_in_keys && kQuantized<KV> != (value_scales != nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = ceil_div(p.num_tokens * kWarpSize, kThreads);
  if (blocks >= kMaxBlocks) return cudaErrorInvalidValue;
  return launch_kernel(paged_kv_update_kernel<In, KV>, dim3(static_cast<unsigned>(blocks)),
                       dim3(kThreads), stream, p, value_dim, key, value, slot_mapping, key_pages,
                       value_pages, key_scales, value_scales);
}

#define JAXOPS_CUDA_PAGED_DEFINE(Q, KV)                                                       \
  template cudaError_t launch_paged_attention<Q, KV>(                                        \
      cudaStream_t, const PagedAttentionParams&, const PagedAttentionPlan&, const Q*,        \
      const KV*, const KV*, Q*, float*, void*);                                              \
  template cudaError_t launch_paged_attention<Q, KV>(cudaStream_t, const PagedAttentionParams&, \
                                                     const Q*, const KV*, const KV*, Q*,     \
                                                     float*, void*);                         \
  template cudaError_t launch_paged_kv_update<Q, KV>(cudaStream_t, const PagedKvUpdateParams&, \
                                                     const Q*, const Q*, const int32_t*, KV*, \
                                                     KV*, float*, float*);

JAXOPS_CUDA_PAGED_DEFINE(float, float)
JAXOPS_CUDA_PAGED_DEFINE(__nv_bfloat16, __nv_bfloat16)
JAXOPS_CUDA_PAGED_DEFINE(__half, __half)
JAXOPS_CUDA_PAGED_DEFINE(float, int8_t)
JAXOPS_CUDA_PAGED_DEFINE(__nv_bfloat16, int8_t)
JAXOPS_CUDA_PAGED_DEFINE(__half, int8_t)

#undef JAXOPS_CUDA_PAGED_DEFINE

}  // namespace jaxops::cuda
