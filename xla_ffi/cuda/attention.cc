// CUDA FFI handlers of attention: the CPU handlers' targets, bindings and
// validation (xla_ffi/attention_common.h), then a launch of cuda/attention on
// the stream XLA hands over. The backward's scratch is the primitive's hidden
// workspace result (sized by the contract, bwd_workspace), an XLA buffer that
// outlives the asynchronous kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/attention.h"
#include "cuda/attention_decode.h"
#include "xla_ffi/attention_common.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace attention_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

// The shared decoding (xla_ffi/attention_common.h) plus the CUDA kernels' own
// limit: their tiles hold whole head vectors (query/key and value) in shared
// memory.
ffi::Error decode_params(const std::string& op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                         const ffi::AnyBuffer& v, const ffi::AnyBuffer& bias,
                         const ffi::AnyBuffer& mask, const ffi::AnyBuffer& q_lengths,
                         const ffi::AnyBuffer& kv_lengths, const ffi::AnyBuffer& q_segments,
                         const ffi::AnyBuffer& kv_segments, const ffi::AnyBuffer& query_offset,
                         float scale, bool is_causal, int64_t window_left,
                         int64_t window_right, float logits_soft_cap, bool allow_tf32,
                         AttentionParams* p) {
  JAXOPS_RETURN_IF_ERROR(decode_shape(op, q, k, v, bias, mask, q_lengths, kv_lengths, q_segments,
                                      kv_segments, query_offset, scale, is_causal, window_left,
                                      window_right, logits_soft_cap, allow_tf32, p));
  if (p->head_dim > params::kCudaAttentionMaxHeadDim) {
    return invalid(op, "the CUDA kernel supports head_dim <= " +
                           str(params::kCudaAttentionMaxHeadDim) + ", got " + str(p->head_dim));
  }
  if (params::value_head_dim(*p) > params::kCudaAttentionMaxHeadDim) {
    return invalid(op, "the CUDA kernel supports a value head dim <= " +
                           str(params::kCudaAttentionMaxHeadDim) + ", got " +
                           str(params::value_head_dim(*p)));
  }
  return ffi::Error::Success();
}

ffi::Error AttentionFwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer q_segments, ffi::AnyBuffer kv_segments,
                        ffi::AnyBuffer query_offset, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                        float scale, bool is_causal, int64_t window_left, int64_t window_right,
                        float logits_soft_cap, bool allow_tf32) {
  const std::string op = kAttentionFwd.name;
  AttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_params(op, q, k, v, bias, mask, q_lengths, kv_lengths,
                                       q_segments, kv_segments, query_offset, scale, is_causal,
                                       window_left, window_right, logits_soft_cap, allow_tf32,
                                       &p));
  JAXOPS_RETURN_IF_ERROR(check_fwd(op, q, *out, *lse, p));
  JAXOPS_RETURN_IF_ERROR(
      check_fwd_workspace(op, *workspace, fwd_workspace_bytes(p, contract::Platform::kCuda)));
  // Few query rows per kv head (decoding): the split-K decode kernels, whose
  // partial states the contract sized the workspace for (they take the soft
  // cap; a value head dim of its own takes the MLA decode kernel; segment ids
  // take the tiled kernels, leaving that workspace unused).
  const bool decode =
      params::attention_decode_applies(p.q_len, p.num_heads, p.num_kv_heads, p.head_dim,
                                       params::value_head_dim(p), p.bias != nullptr,
                                       p.mask != nullptr) &&
      p.q_segment_ids == nullptr;
  return dispatch(op, q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if (decode) {
      return launch_status(op, cuda::attention_decode_fwd<T>(
                                   stream, p, data<const T>(q), data<const T>(k),
                                   data<const T>(v), data<T>(*out), data<float>(*lse),
                                   data_or_null<void>(*workspace)));
    }
    return launch_status(op, cuda::attention_fwd<T>(stream, p, data<const T>(q),
                                                    data<const T>(k), data<const T>(v),
                                                    data<T>(*out), data<float>(*lse)));
  });
}

ffi::Error AttentionBwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer q_segments, ffi::AnyBuffer kv_segments,
                        ffi::AnyBuffer query_offset, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                        float scale, bool is_causal, int64_t window_left, int64_t window_right,
                        float logits_soft_cap, bool with_dbias, bool allow_tf32) {
  const std::string op = kAttentionBwd.name;
  AttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_params(op, q, k, v, bias, mask, q_lengths, kv_lengths,
                                       q_segments, kv_segments, query_offset, scale, is_causal,
                                       window_left, window_right, logits_soft_cap, allow_tf32,
                                       &p));
  const int64_t workspace_bytes = bwd_workspace_bytes(p, contract::Platform::kCuda);
  JAXOPS_RETURN_IF_ERROR(check_bwd(op, q, k, v, bias, out, lse, dout, dlse, *dq, *dk, *dv,
                                   *dbias, *workspace, with_dbias, workspace_bytes, p));
  // The contract sizes the workspace the Python side allocates; the kernel
  // says what it uses. They are one formula today: this keeps them so.
  if (static_cast<int64_t>(cuda::attention_bwd_workspace_bytes(p)) > workspace_bytes) {
    return ffi::Error::Internal(op + ": the contract's workspace is smaller than the kernel's");
  }
  return dispatch(op, q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::attention_bwd<T>(stream, p, data<const T>(q), data<const T>(k),
                                   data<const T>(v), data<const T>(out), data<const float>(lse),
                                   data<const T>(dout), data_or_null<const float>(dlse),
                                   data<T>(*dq), data<T>(*dk), data<T>(*dv),
                                   with_dbias ? data<float>(*dbias) : nullptr,
                                   workspace->untyped_data()));
  });
}

ffi::Error AttentionFwdJvp(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                           ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                           ffi::AnyBuffer q_segments, ffi::AnyBuffer kv_segments,
                           ffi::AnyBuffer query_offset, ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                           ffi::AnyBuffer dv, ffi::AnyBuffer dbias,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                           ffi::Result<ffi::AnyBuffer> dout, ffi::Result<ffi::AnyBuffer> dlse,
                           float scale, bool is_causal, int64_t window_left,
                           int64_t window_right, float logits_soft_cap, bool allow_tf32) {
  const std::string op = kAttentionFwdJvp.name;
  AttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_params(op, q, k, v, bias, mask, q_lengths, kv_lengths,
                                       q_segments, kv_segments, query_offset, scale, is_causal,
                                       window_left, window_right, logits_soft_cap, allow_tf32,
                                       &p));
  JAXOPS_RETURN_IF_ERROR(
      check_fwd_jvp(op, q, k, v, bias, dq, dk, dv, dbias, *out, *lse, *dout, *dlse, p));
  // An absent tangent ([0]) is null, and so is a present one with no elements
  // (an empty head dim), whose products are zero.
  return dispatch(op, q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(
        op, cuda::attention_fwd_jvp<T>(
                stream, p, data<const T>(q), data<const T>(k), data<const T>(v),
                data_or_null<const T>(dq), data_or_null<const T>(dk), data_or_null<const T>(dv),
                data_or_null<const float>(dbias), data<T>(*out), data<float>(*lse),
                data<T>(*dout), data<float>(*dlse)));
  });
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
JAXOPS_FFI_TARGET(kAttentionFwd, kAttentionFwdCuda, AttentionFwd,
                  bind_attention_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kAttentionBwd, kAttentionBwdCuda, AttentionBwd,
                  bind_attention_bwd(cuda_binding()));
JAXOPS_FFI_TARGET(kAttentionFwdJvp, kAttentionFwdJvpCuda, AttentionFwdJvp,
                  bind_attention_fwd_jvp(cuda_binding()));

}  // namespace jaxops
