// Attention over a paged KV cache and the cache's update on CUDA (see
// paged_attention.h for the contract, params/paged_attention.h for the
// operation).
//
// Attention is decode-oriented: a block owns one kv head of one sequence, and
// a tile of the T * (N / K) query rows of that head's group (row = t * group +
// head in the group), so each key/value row it gathers from the pages serves
// every query head of the group. It walks the keys its rows can see (causal
// against the cache, the window) in tiles of kKeyTile rows, gathered through
// block_tables with the header's clamping and dequantized (int8 pages) into
// float32 shared memory: logits (one thread per (row, key)), an online softmax
// update (one thread per row) and O += P V (one thread per (row, element)).
// For decode and short chunks (one row tile) the keys are also split across
// blocks (split-K): each writes its unnormalised output, max and sum to the
// workspace and paged_attention_merge_kernel combines them. Chunked prefill
// takes one block per row tile and reads K/V once per tile: correct, not
// tuned.
//
// The update writes one token's rows per warp (unless a later token names the
// same slot: the last one wins): a copy for float pages, the symmetric per-row
// int8 quantization (a warp max) for int8 pages.
#include "cuda/paged_attention.h"

#include <cstdint>
#include <type_traits>

#include <math_constants.h>

#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using attention_tiles::group_max;
using attention_tiles::SharedCarver;
using params::paged_kv_len;
using params::paged_page_id;
using params::paged_query_len;
using params::paged_slot_valid;

constexpr int kThreads = 128;
constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kKeyTile = static_cast<int>(params::kPagedKeyTile);
// A grid's x extent (and so every index the kernels keep in 32 bits).
constexpr int64_t kMaxBlocks = int64_t{1} << 31;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The page element as float32 before its row's scale.
template <typename T>
__device__ __forceinline__ float page_element(T v) {
  return to_float(v);
}
__device__ __forceinline__ float page_element(int8_t v) { return static_cast<float>(v); }

// A block's shared memory: float32 query rows, their unnormalised outputs, one
// key (then value) tile padded against bank conflicts, the tile's logits (then
// probabilities), the rows' softmax state and the tile's gathered key rows.
struct PagedShared {
  float* q;          // [rows][H]
  float* o;          // [rows][H]
  float* kv;         // [kKeyTile][H + 1]
  float* s;          // [rows][kKeyTile]
  float* row_max;    // [rows]
  float* row_sum;    // [rows]
  float* row_alpha;  // [rows] this tile's rescaling of the row's output
  int64_t* key_row;  // [kKeyTile] (page * page_size + offset) * K + kv head
  float* key_scale;  // [kKeyTile] 1 for float pages
  float* value_scale;
  size_t bytes;
  __host__ __device__ PagedShared(unsigned char* base, int64_t rows, int64_t head_dim) {
    SharedCarver c(base);
    q = c.take<float>(rows * head_dim);
    o = c.take<float>(rows * head_dim);
    kv = c.take<float>(kKeyTile * (head_dim + 1));
    s = c.take<float>(rows * kKeyTile);
    row_max = c.take<float>(rows);
    row_sum = c.take<float>(rows);
    row_alpha = c.take<float>(rows);
    key_row = c.take<int64_t>(kKeyTile);
    key_scale = c.take<float>(kKeyTile);
    value_scale = c.take<float>(kKeyTile);
    bytes = c.used();
  }
};

// Where a block's rows sit: query row t and head n of tile row r.
struct TileRows {
  int b, kv_head, group, row0, rows;
  __device__ int t(int r) const { return (row0 + r) / group; }
  __device__ int head(int r) const { return kv_head * group + (row0 + r) % group; }
};

// The gathered key rows (the first `keys` of the tile) of pages into sh.kv as
// float32 times their scales, zeros past them.
template <typename KV>
__device__ __forceinline__ void load_key_tile(const PagedShared& sh, const KV* pages,
                                              const float* scales, int h_dim, int keys) {
  for (int i = threadIdx.x; i < kKeyTile * h_dim; i += kThreads) {
    const int j = i / h_dim, h = i % h_dim;
    float x = 0.0f;
    if (j < keys) x = page_element(pages[sh.key_row[j] * h_dim + h]) * scales[j];
    sh.kv[j * (h_dim + 1) + h] = x;
  }
}

__device__ __forceinline__ float masked_logit(const PagedAttentionParams& p, float dot,
                                              int64_t key, int64_t position) {
  if (key > position || (p.window_left >= 0 && key < position - p.window_left)) {
    return -CUDART_INF_F;
  }
  const float x = dot * p.scale;
  return p.logits_soft_cap > 0.0f ? p.logits_soft_cap * tanhf(x / p.logits_soft_cap) : x;
}

template <typename Q, typename KV>
__global__ void __launch_bounds__(kThreads)
    paged_attention_kernel(PagedAttentionParams p, PagedAttentionPlan plan, const Q* query,
                           const KV* key_pages, const KV* value_pages, Q* out,
                           float* logsumexp, float* partial) {
  // 32-bit index arithmetic below (the launcher checks that it fits): a 64-bit
  // division is a call, with a stack frame.
  int block = static_cast<int>(blockIdx.x);
  const int splits = static_cast<int>(plan.splits), row_tiles = static_cast<int>(plan.row_tiles);
  const int split = block % splits;
  block /= splits;
  const int tile = block % row_tiles;
  block /= row_tiles;
  const int num_kv_heads = static_cast<int>(p.num_kv_heads);
  const int group = static_cast<int>(p.num_heads) / num_kv_heads;
  const int rows = static_cast<int>(plan.rows_per_tile), h_dim = static_cast<int>(p.head_dim);
  const int all_rows = static_cast<int>(p.q_len) * group;
  const TileRows tr{block / num_kv_heads, block % num_kv_heads, group, tile * rows,
                    all_rows - tile * rows < rows ? all_rows - tile * rows : rows};
  const int64_t b = tr.b;
  PagedShared sh(dynamic_shared_memory<unsigned char>(), rows, h_dim);
  // Clamped lengths (params/paged_attention.h): query row t sits at position
  // first_position + t.
  const int kv_len = static_cast<int>(paged_kv_len(p, b));
  const int q_len = static_cast<int>(paged_query_len(p, b));
  const int first_position = kv_len - q_len;

  for (int i = threadIdx.x; i < rows * h_dim; i += kThreads) {
    const int r = i / h_dim, h = i % h_dim;
    sh.q[i] = r < tr.rows ? to_float(query[((b * p.q_len + tr.t(r)) * p.num_heads + tr.head(r)) *
                                               h_dim +
                                           h])
                          : 0.0f;
    sh.o[i] = 0.0f;
  }
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    sh.row_max[r] = -CUDART_INF_F;
    sh.row_sum[r] = 0.0f;
  }
  // The keys this split holds that some row of the tile sees: up to the last
  // valid row's position, from the first row's window start.
  const int keys_per_split = static_cast<int>(plan.keys_per_split);
  int begin = split * keys_per_split;
  int end = kv_len - begin > keys_per_split ? begin + keys_per_split : kv_len;
  const int t_first = tr.t(0);
  const int t_last = tr.t(tr.rows - 1) < q_len - 1 ? tr.t(tr.rows - 1) : q_len - 1;
  if (t_first >= q_len) {
    end = begin;
  } else {
    if (first_position + t_last + 1 < end) end = first_position + t_last + 1;
    const int64_t window_begin = first_position + t_first - p.window_left;
    if (p.window_left >= 0 && window_begin > begin) begin = static_cast<int>(window_begin);
  }
  const int page_size = static_cast<int>(p.page_size);

  for (int j0 = begin; j0 < end; j0 += kKeyTile) {
    __syncthreads();  // the previous tile's readers of kv, s and the key rows are done
    for (int j = threadIdx.x; j < kKeyTile; j += kThreads) {
      const int key = j0 + j;
      if (key >= end) continue;
      const int64_t page = paged_page_id(p, b, key);
      const int64_t at = (page * page_size + key % page_size) * num_kv_heads + tr.kv_head;
      sh.key_row[j] = at;
      sh.key_scale[j] = p.key_scales != nullptr ? p.key_scales[at] : 1.0f;
      sh.value_scale[j] = p.value_scales != nullptr ? p.value_scales[at] : 1.0f;
    }
    __syncthreads();
    load_key_tile(sh, key_pages, sh.key_scale, h_dim, end - j0);
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kKeyTile; i += kThreads) {
      const int r = i / kKeyTile, j = i % kKeyTile;
      const int t = tr.t(r);
      float x = -CUDART_INF_F;
      if (r < tr.rows && t < q_len && j0 + j < end) {
        const float* q_row = sh.q + r * h_dim;
        const float* k_row = sh.kv + j * (h_dim + 1);
        float dot = 0.0f;
        for (int h = 0; h < h_dim; ++h) dot += q_row[h] * k_row[h];
        x = masked_logit(p, dot, j0 + j, first_position + t);
      }
      sh.s[i] = x;
    }
    __syncthreads();  // the key tile is free: the values replace it
    load_key_tile(sh, value_pages, sh.value_scale, h_dim, end - j0);
    for (int r = threadIdx.x; r < rows; r += kThreads) {
      float* s_row = sh.s + r * kKeyTile;
      const float old_max = sh.row_max[r];
      float new_max = old_max;
      for (int j = 0; j < kKeyTile; ++j) new_max = fmaxf(new_max, s_row[j]);
      float sum = 0.0f;
      for (int j = 0; j < kKeyTile; ++j) {
        const float x = s_row[j];
        s_row[j] = x == -CUDART_INF_F ? 0.0f : __expf(x - new_max);
        sum += s_row[j];
      }
      const float alpha = old_max == -CUDART_INF_F ? 0.0f : __expf(old_max - new_max);
      sh.row_max[r] = new_max;
      sh.row_sum[r] = sh.row_sum[r] * alpha + sum;
      sh.row_alpha[r] = alpha;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * h_dim; i += kThreads) {
      const int r = i / h_dim, h = i % h_dim;
      const float* prob = sh.s + r * kKeyTile;
      float acc = sh.o[i] * sh.row_alpha[r];
      // A key the row does not see adds nothing, even a NaN value row.
      for (int j = 0; j < kKeyTile; ++j) {
        if (prob[j] != 0.0f) acc += prob[j] * sh.kv[j * (h_dim + 1) + h];
      }
      sh.o[i] = acc;
    }
  }
  __syncthreads();
  if (splits > 1) {
    // One tile holds all rows: partial row (b, kv head, split, r).
    const int64_t at = ((b * num_kv_heads + tr.kv_head) * splits + split) * rows;
    float* partial_o = partial + at * h_dim;
    float* partial_state = partial + p.batch * num_kv_heads * splits * rows * h_dim + 2 * at;
    for (int i = threadIdx.x; i < tr.rows * h_dim; i += kThreads) partial_o[i] = sh.o[i];
    for (int r = threadIdx.x; r < tr.rows; r += kThreads) {
      partial_state[2 * r] = sh.row_max[r];
      partial_state[2 * r + 1] = sh.row_sum[r];
    }
    return;
  }
  for (int i = threadIdx.x; i < tr.rows * h_dim; i += kThreads) {
    const int r = i / h_dim, h = i % h_dim;
    const float sum = sh.row_sum[r];
    out[((b * p.q_len + tr.t(r)) * p.num_heads + tr.head(r)) * h_dim + h] =
        from_float<Q>(sum != 0.0f ? sh.o[i] / sum : 0.0f);  // NaN sum: NaN row
  }
  if (logsumexp == nullptr) return;
  for (int r = threadIdx.x; r < tr.rows; r += kThreads) {
    const float sum = sh.row_sum[r];
    logsumexp[(b * p.num_heads + tr.head(r)) * p.q_len + tr.t(r)] =
        sum != 0.0f ? sh.row_max[r] + logf(sum) : -CUDART_INF_F;
  }
}

// Combines the splits' partial states of one query row (a block per row of
// every (sequence, kv head)): out = sum_s e^(m_s - M) o_s / L with M the
// largest max and L = sum_s e^(m_s - M) l_s. A split that saw no key (l_s = 0,
// o_s = 0) adds nothing; one whose logits were all NaN kept m_s = -inf (fmaxf
// ignores NaN) with a NaN l_s, and its weight (1 when every max is -inf)
// carries the NaN into the row, as the unsplit kernel's does.
template <typename Q>
__global__ void __launch_bounds__(kThreads)
    paged_attention_merge_kernel(PagedAttentionParams p, PagedAttentionPlan plan,
                                 const float* partial, Q* out, float* logsumexp) {
  const int num_kv_heads = static_cast<int>(p.num_kv_heads);
  const int group = static_cast<int>(p.num_heads) / num_kv_heads;
  const int all_rows = static_cast<int>(p.q_len) * group, rows = static_cast<int>(plan.rows_per_tile);
  const int h_dim = static_cast<int>(p.head_dim);
  const int r = static_cast<int>(blockIdx.x) % all_rows;
  const int64_t bk = static_cast<int>(blockIdx.x) / all_rows;
  const int64_t b = bk / num_kv_heads, kv_head = bk % num_kv_heads;
  const int64_t t = r / group, n = kv_head * group + r % group;
  const float* partial_o = partial + bk * plan.splits * rows * h_dim;
  const float* partial_state =
      partial + p.batch * p.num_kv_heads * plan.splits * rows * h_dim + 2 * bk * plan.splits * rows;
  float max = -CUDART_INF_F;
  for (int64_t s = 0; s < plan.splits; ++s) max = fmaxf(max, partial_state[2 * (s * rows + r)]);
  // Split s's weight e^(m_s - M); 1 at m_s = M, so also when every m_s is -inf.
  const auto weight = [&](int64_t s) {
    const float m = partial_state[2 * (s * rows + r)];
    return m == max ? 1.0f : __expf(m - max);
  };
  const auto saw_keys = [&](int64_t s) { return partial_state[2 * (s * rows + r) + 1] != 0.0f; };
  float sum = 0.0f;
  for (int64_t s = 0; s < plan.splits; ++s) {
    if (saw_keys(s)) sum += weight(s) * partial_state[2 * (s * rows + r) + 1];
  }
  for (int h = threadIdx.x; h < h_dim; h += kThreads) {
    float acc = 0.0f;
    for (int64_t s = 0; s < plan.splits; ++s) {
      if (saw_keys(s)) acc += weight(s) * partial_o[(s * rows + r) * h_dim + h];
    }
    out[((b * p.q_len + t) * p.num_heads + n) * h_dim + h] =
        from_float<Q>(sum != 0.0f ? acc / sum : 0.0f);
  }
  if (logsumexp != nullptr && threadIdx.x == 0) {
    logsumexp[(b * p.num_heads + n) * p.q_len + t] =
        sum != 0.0f ? max + logf(sum) : -CUDART_INF_F;
  }
}

// -- the cache update ------------------------------------------------------------------

// A float page row: a copy.
template <typename T>
__device__ __forceinline__ void write_page_row(const T* src, T* dst, float* /*scale*/, int lane,
                                               int64_t h_dim) {
  for (int64_t h = lane; h < h_dim; h += kWarpSize) dst[h] = src[h];
}

// An int8 page row: scale = max|x| / 127 (0 for an all-zero row) and
// q = round(x / scale) in [-127, 127] (rintf: to nearest even, as jnp.round;
// fminf/fmaxf also turn a NaN quotient into a bound, never an undefined cast).
template <typename In>
__device__ __forceinline__ void write_page_row(const In* src, int8_t* dst, float* scale, int lane,
                                               int64_t h_dim) {
  float amax = 0.0f;
  for (int64_t h = lane; h < h_dim; h += kWarpSize) amax = fmaxf(amax, fabsf(to_float(src[h])));
  amax = group_max<kWarpSize>(amax);
  const float row_scale = amax / 127.0f;
  for (int64_t h = lane; h < h_dim; h += kWarpSize) {
    const float q = row_scale == 0.0f ? 0.0f : rintf(to_float(src[h]) / row_scale);
    dst[h] = static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f));
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

template <typename In, typename KV>
__global__ void __launch_bounds__(kThreads)
    paged_kv_update_kernel(PagedKvUpdateParams p, const In* key, const In* value,
                           const int32_t* slot_mapping, KV* key_pages, KV* value_pages,
                           float* key_scales, float* value_scales) {
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
    write_page_row(value + row * p.head_dim, value_pages + to * p.head_dim,
                   value_scales != nullptr ? value_scales + to : nullptr, lane, p.head_dim);
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
  if (params::paged_attention_params_error(p) != nullptr ||
      p.head_dim > kCudaPagedAttentionMaxHeadDim) {
    return cudaErrorInvalidValue;
  }
  if (p.batch * p.num_heads * p.q_len == 0) return cudaSuccess;
  if (kQuantized<KV> != (p.key_scales != nullptr)) return cudaErrorInvalidValue;
  if (plan.splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  // The kernels' 32-bit indices: block counts, rows and positions.
  const int64_t blocks = p.batch * p.num_kv_heads * plan.row_tiles * plan.splits;
  const int64_t merged_rows = p.batch * p.num_heads * p.q_len;
  if (blocks >= kMaxBlocks || merged_rows >= kMaxBlocks) return cudaErrorInvalidValue;
  const size_t shared = PagedShared(nullptr, plan.rows_per_tile, p.head_dim).bytes;
  float* partial = static_cast<float*>(workspace);
  cudaError_t status = launch_kernel_dynamic_shared(
      paged_attention_kernel<Q, KV>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), shared,
      stream, p, plan, query, key_pages, value_pages, out, logsumexp, partial);
  if (status != cudaSuccess || plan.splits == 1) return status;
  return launch_kernel(paged_attention_merge_kernel<Q>, dim3(static_cast<unsigned>(merged_rows)),
                       dim3(kThreads), stream, p, plan, static_cast<const float*>(partial), out,
                       logsumexp);
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
  if (p.num_tokens == 0 || p.num_kv_heads == 0 || p.head_dim == 0 ||
      p.num_pages * p.page_size == 0) {
    return cudaSuccess;
  }
  if (kQuantized<KV> != (key_scales != nullptr && value_scales != nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = ceil_div(p.num_tokens * kWarpSize, kThreads);
  if (blocks >= kMaxBlocks) return cudaErrorInvalidValue;
  return launch_kernel(paged_kv_update_kernel<In, KV>, dim3(static_cast<unsigned>(blocks)),
                       dim3(kThreads), stream, p, key, value, slot_mapping, key_pages,
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
