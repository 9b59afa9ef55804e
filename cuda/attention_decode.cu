// jaxops.attention's decode path on CUDA (see attention_decode.h): the
// decode kernels of kv_decode.cuh with a dense cache as the row source,
// attention_decode_kernel and attention_decode_merge_kernel, and its MLA
// kernel (attention_decode_mla_kernel, attention_decode_mla_merge_kernel) for
// a value head dim of its own.
#include "cuda/attention_decode.h"

#include <cstdint>

#include "cuda/kv_decode.cuh"

namespace jaxops::cuda {
namespace {

using kv_decode::SequenceMask;

__device__ __forceinline__ int clamp_length(const int32_t* lengths, int b, int full) {
  if (lengths == nullptr) return full;
  const int n = lengths[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

// Key j of kv head kh of sequence b is row (b * S + j) * K + kh of [B, S, K, H].
template <typename T>
struct DenseRows {
  using Element = T;
  static constexpr bool kScaled = false;
  const T* key;
  const T* value;
  const float* key_scales;
  const float* value_scales;
  int kv_len;    // S
  int q_len;     // T
  int kv_heads;  // K
  const int32_t* query_offset;
  const int32_t* q_lengths;
  const int32_t* kv_lengths;

  __device__ SequenceMask sequence(int b) const {
    return {*query_offset, clamp_length(q_lengths, b, q_len), clamp_length(kv_lengths, b, kv_len)};
  }
  __device__ int64_t row(int b, int kh, int j) const {
    return (static_cast<int64_t>(b) * kv_len + j) * kv_heads + kh;
  }
};

template <typename Rows, typename Q, typename Unit, int kOut, int kRows>
__global__ void __launch_bounds__(kv_decode::kThreads, kv_decode::kMinBlocksPerSm)
    attention_decode_kernel(kv_decode::DecodeLaunch L, Rows rows, const Q* query, Q* out,
                            float* logsumexp, float* partial) {
  kv_decode::decode_block<Rows, Q, Unit, kOut, kRows>(L, rows, query, out, logsumexp, partial);
}

template <typename Q>
__global__ void __launch_bounds__(kv_decode::kThreads)
    attention_decode_merge_kernel(kv_decode::DecodeLaunch L, const float* partial, Q* out,
                                  float* logsumexp) {
  kv_decode::decode_merge_row<kv_decode::kMaxOut>(L, partial, out, logsumexp);
}

// A value head dim of its own (MLA's 192/128) and heads above 256: the MLA
// kernel, value rows of their own (the dense cache's value tensor).
template <typename Rows, typename Q, typename Unit, bool kValuesInKeys>
__global__ void __launch_bounds__(kv_decode::kThreads, kv_decode::kMinBlocksPerSm)
    attention_decode_mla_kernel(kv_decode::MlaLaunch L, Rows rows, const Q* query, Q* out,
                                float* logsumexp, float* partial) {
  kv_decode::mla_decode_block<Rows, Q, Unit, kValuesInKeys>(L, rows, query, out, logsumexp,
                                                            partial);
}

template <typename Q>
__global__ void __launch_bounds__(kv_decode::kThreads)
    attention_decode_mla_merge_kernel(kv_decode::MlaLaunch L, const float* partial, Q* out,
                                      float* logsumexp) {
  kv_decode::decode_merge_row<kv_decode::kMlaMergeOut>(L, partial, out, logsumexp);
}

struct AttentionDecodeKernels {
  template <typename Rows, typename Q, typename Unit, int kOut, int kRows>
  static auto decode() {
    return attention_decode_kernel<Rows, Q, Unit, kOut, kRows>;
  }
  template <typename Q>
  static auto merge() {
    return attention_decode_merge_kernel<Q>;
  }
  template <typename Rows, typename Q, typename Unit, bool kValuesInKeys>
  static auto mla() {
    return attention_decode_mla_kernel<Rows, Q, Unit, kValuesInKeys>;
  }
  template <typename Q>
  static auto mla_merge() {
    return attention_decode_mla_merge_kernel<Q>;
  }
};

}  // namespace

template <typename T>
cudaError_t attention_decode_fwd(cudaStream_t stream, const params::AttentionParams& p,
                                 const T* q, const T* k, const T* v, T* out, float* logsumexp,
                                 void* workspace) {
  const int64_t value_dim = params::value_head_dim(p);
  if (params::attention_params_error(p) != nullptr ||
      !params::attention_decode_applies(p.q_len, p.num_heads, p.num_kv_heads, p.head_dim,
                                        value_dim, p.bias != nullptr, p.mask != nullptr) ||
      p.q_segment_ids != nullptr) {
    return cudaErrorInvalidValue;
  }
  kv_decode::DecodeShape shape;
  shape.batch = static_cast<int>(p.batch);
  shape.q_len = static_cast<int>(p.q_len);
  shape.num_heads = static_cast<int>(p.num_heads);
  shape.num_kv_heads = static_cast<int>(p.num_kv_heads);
  shape.head_dim = static_cast<int>(p.head_dim);
  shape.capacity = static_cast<int>(p.kv_len);
  shape.scale = p.scale;
  shape.causal = p.is_causal;
  shape.window_left = p.window_left;
  shape.window_right = p.window_right;
  shape.soft_cap = p.logits_soft_cap;
  const DenseRows<T> rows{k,
                          v,
                          nullptr,
                          nullptr,
                          static_cast<int>(p.kv_len),
                          static_cast<int>(p.q_len),
                          static_cast<int>(p.num_kv_heads),
                          p.query_offset,
                          p.q_seq_lengths,
                          p.kv_seq_lengths};
  // The contract sized the workspace for this plan (partials Hv floats a row).
  const params::DecodePlan plan = params::attention_decode_plan(
      p.batch, p.q_len, p.kv_len, p.num_heads, p.num_kv_heads, p.head_dim, value_dim);
  if (params::attention_decode_takes_mla_kernel(p.head_dim, value_dim)) {
    return kv_decode::launch_mla_decode<AttentionDecodeKernels, DenseRows<T>, T, false>(
        stream, shape, static_cast<int>(value_dim), plan, rows, q, out, logsumexp, workspace);
  }
  return kv_decode::launch_decode<AttentionDecodeKernels>(stream, shape, plan, rows, q, out,
                                                         logsumexp, workspace);
}

#define JAXOPS_CUDA_ATTENTION_DECODE_DEFINE(T)                                             \
  template cudaError_t attention_decode_fwd<T>(cudaStream_t, const params::AttentionParams&, \
                                               const T*, const T*, const T*, T*, float*, void*);
JAXOPS_CUDA_ATTENTION_DECODE_DEFINE(float)
JAXOPS_CUDA_ATTENTION_DECODE_DEFINE(__nv_bfloat16)
JAXOPS_CUDA_ATTENTION_DECODE_DEFINE(__half)
#undef JAXOPS_CUDA_ATTENTION_DECODE_DEFINE

}  // namespace jaxops::cuda
