// Flash attention on the CPU: tiled, online softmax, forward, backward and
// forward mode (the tangents of the forward's results, in the same pass).
//
// Layouts (row-major, contiguous):
//   query, out, dout, dq   [B, T, N, H]
//   key, value, dk, dv     [B, S, K, H]     N % K == 0 (grouped-query attention)
//   logsumexp              [B, N, T]        float32, natural log
// bias (float32) and mask (one byte per element, nonzero = attend) are read
// through four element strides over [B, N, T, S]; a zero stride broadcasts.
// dbias is written through the bias strides and summed over broadcast dims.
//
// Masking. Query row t sits at absolute position p = t + *query_offset. Key j is
// attended iff all of:
//   is_causal:          j <= p
//   window_left >= 0:   j >= p - window_left
//   window_right >= 0:  j <= p + window_right
//   kv_seq_lengths:     j <  kv_seq_lengths[b]
//   q_seq_lengths:      t <  q_seq_lengths[b]
//   mask:               mask[b, n, t, j] != 0
// This is jax.nn.dot_product_attention's definition (with query_offset = 0),
// except that a row with no attended key gets output 0, logsumexp -inf and zero
// gradients (jax.nn's large-negative fill averages V there).
//
// Element types: float, Eigen::bfloat16, Eigen::half; scores, softmax statistics
// and accumulation are float32.
//
// Scratch: each entry point takes a caller-allocated workspace of the size its
// *_workspace_bytes function returns for the same parameters (including
// num_threads). No memory is allocated inside the kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include <Eigen/Core>

#include "params/attention.h"

namespace jaxops::cpu {

// The parameters (params/attention.h), shared with the CUDA kernels and the
// handlers. query_offset is read once per call, on the host.
using ::jaxops::params::AttentionParams;
// nullptr when the parameters describe a valid problem, else a description of
// the first problem found (sizes, GQA divisibility, window, thread count).
using ::jaxops::params::attention_params_error;

template <typename T>
size_t attention_fwd_workspace_bytes(const AttentionParams& p);

// out [B,T,N,H], logsumexp [B,N,T].
template <typename T>
void attention_fwd(const AttentionParams& p, const T* query, const T* key,
                   const T* value, T* out, float* logsumexp, void* workspace);

template <typename T>
size_t attention_bwd_workspace_bytes(const AttentionParams& p, bool with_dbias);

// Gradients with respect to query, key, value and (when dbias is not null)
// bias, given the cotangent dout of out and, when not null, the cotangent
// dlogsumexp [B,N,T] of logsumexp. out and logsumexp are the forward's results
// for the same inputs.
template <typename T>
void attention_bwd(const AttentionParams& p, const T* query, const T* key,
                   const T* value, const T* out, const float* logsumexp,
                   const T* dout, const float* dlogsumexp, T* dquery, T* dkey,
                   T* dvalue, float* dbias, void* workspace);

template <typename T>
size_t attention_fwd_jvp_workspace_bytes(const AttentionParams& p);

// Forward mode: out and logsumexp as attention_fwd computes them (within
// float32 rounding), and their tangents dout [B,T,N,H] and dlogsumexp [B,N,T]
// (float32) given the tangents of the inputs: dquery, dkey, dvalue laid out as
// query, key, value, and dbias (float32, read through the bias strides: only
// with a bias). A null tangent is zero. A row with no attended key gets dout 0
// and dlogsumexp 0; a masked key contributes nothing, whatever its tangents
// hold. One pass over K/V; the scratch is a few tiles per thread, never a
// [T, S] matrix.
template <typename T>
void attention_fwd_jvp(const AttentionParams& p, const T* query, const T* key, const T* value,
                       const T* dquery, const T* dkey, const T* dvalue, const float* dbias,
                       T* out, float* logsumexp, T* dout, float* dlogsumexp, void* workspace);

#define JAXOPS_ATTENTION_DECLARE(T)                                            \
  extern template size_t attention_fwd_workspace_bytes<T>(                     \
      const AttentionParams&);                                                 \
  extern template void attention_fwd<T>(const AttentionParams&, const T*,     \
                                        const T*, const T*, T*, float*,       \
                                        void*);                               \
  extern template size_t attention_bwd_workspace_bytes<T>(                     \
      const AttentionParams&, bool);                                           \
  extern template void attention_bwd<T>(                                       \
      const AttentionParams&, const T*, const T*, const T*, const T*,          \
      const float*, const T*, const float*, T*, T*, T*, float*, void*);         \
  extern template size_t attention_fwd_jvp_workspace_bytes<T>(                 \
      const AttentionParams&);                                                 \
  extern template void attention_fwd_jvp<T>(                                   \
      const AttentionParams&, const T*, const T*, const T*, const T*,          \
      const T*, const T*, const float*, T*, float*, T*, float*, void*);
JAXOPS_ATTENTION_DECLARE(float)
JAXOPS_ATTENTION_DECLARE(Eigen::bfloat16)
JAXOPS_ATTENTION_DECLARE(Eigen::half)
#undef JAXOPS_ATTENTION_DECLARE

}  // namespace jaxops::cpu
