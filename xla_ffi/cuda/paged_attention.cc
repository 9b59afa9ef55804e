// CUDA FFI handlers of the paged KV cache: the CPU handlers' targets,
// bindings and validation (xla_ffi/paged_attention_common.h), then a launch of
// cuda/paged_attention on the stream XLA hands over.
//
// jaxops_paged_attention_fwd's hidden workspace result is sized by the
// contract from the shapes (params::paged_attention_workspace_bytes,
// params/paged_attention_plan.h): when the plan splits the keys (decode and
// short chunks whose rows fit one tile, with few (sequence, kv head) blocks
// for the GPU) the kernel writes each split's partial output and softmax
// state there and a second kernel merges them; otherwise it is [0] and one
// kernel runs a block per row tile, kv head and sequence. The plan depends on
// shapes only, so the workspace is what the handler recomputes and checks.
// Value pages may have a head dim of their own, or be absent (values in the
// key rows: absorbed MLA); the plan then takes the MLA kernel
// (params/paged_attention_plan.h), its partial outputs value_head_dim wide.
#include <cstdint>
#include <string>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/paged_attention.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/paged_attention_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace paged_attention_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::launch_status;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType q_dtype, ffi::DataType page_dtype,
                    Fn&& fn) {
  return dispatch_paged<float, __nv_bfloat16, __half, int8_t>(op, q_dtype, page_dtype,
                                                               std::forward<Fn>(fn));
}

ffi::Error PagedAttentionFwd(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key_pages,
                             ffi::AnyBuffer value_pages, ffi::AnyBuffer block_tables,
                             ffi::AnyBuffer kv_lens, ffi::AnyBuffer query_lens,
                             ffi::AnyBuffer key_scales, ffi::AnyBuffer value_scales,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> logsumexp,
                             ffi::Result<ffi::AnyBuffer> workspace, float scale,
                             float logits_soft_cap, int64_t window_left,
                             int64_t value_head_dim,
                             bool /*allow_tf32: the kernel computes in full float32*/) {
  const std::string op = kPagedAttentionFwd.name;
  PagedAttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_paged_attention(query, key_pages, value_pages, block_tables,
                                                kv_lens, query_lens, key_scales, value_scales,
                                                *out, *logsumexp, *workspace,
                                                contract::Platform::kCuda, scale,
                                                logits_soft_cap, window_left, value_head_dim, &p));
  // The kernels' own limits: their tiles hold whole float32 query rows, and
  // the MLA kernel's four warps 128 output columns each.
  if (p.head_dim > cuda::kCudaPagedAttentionMaxHeadDim) {
    return invalid(op, "the CUDA kernel supports head_dim <= " +
                           str(cuda::kCudaPagedAttentionMaxHeadDim) + ", got " +
                           str(p.head_dim));
  }
  if (params::paged_value_head_dim(p) > cuda::kCudaPagedAttentionMaxValueHeadDim) {
    return invalid(op, "the CUDA kernel supports value_head_dim <= " +
                           str(cuda::kCudaPagedAttentionMaxValueHeadDim) + ", got " +
                           str(params::paged_value_head_dim(p)));
  }
  return dispatch(op, query.element_type(), key_pages.element_type(), [&](auto q_tag, auto kv_tag) {
    using Q = decltype(q_tag);
    using KV = decltype(kv_tag);
    // The plan the contract sized the workspace by (checked in decode): it
    // splits exactly when the workspace is not empty.
    const cuda::PagedAttentionPlan plan = cuda::paged_attention_plan(p);
    // Values in the keys: no value pages (a [0] placeholder); the key pages
    // hold them.
    const KV* values = p.values_in_keys ? data<const KV>(key_pages) : data<const KV>(value_pages);
    return launch_status(op, cuda::launch_paged_attention<Q, KV>(
                                 stream, p, plan, data<const Q>(query), data<const KV>(key_pages),
                                 values, data<Q>(*out), data<float>(*logsumexp),
                                 data_or_null<void>(*workspace)));
  });
}

// The result holds the operand's contents before the slots are written: it is
// the operand's own buffer when XLA aliased them, else a device copy is
// queued on the stream first.
cudaError_t start_from(cudaStream_t stream, const ffi::AnyBuffer& operand,
                       ffi::AnyBuffer& result) {
  if (result.untyped_data() == operand.untyped_data() || operand.size_bytes() == 0) {
    return cudaSuccess;
  }
  return cudaMemcpyAsync(result.untyped_data(), operand.untyped_data(), operand.size_bytes(),
                         cudaMemcpyDeviceToDevice, stream);
}

ffi::Error PagedKvUpdate(cudaStream_t stream, ffi::AnyBuffer key_pages,
                         ffi::AnyBuffer value_pages, ffi::AnyBuffer key, ffi::AnyBuffer value,
                         ffi::AnyBuffer slot_mapping, ffi::AnyBuffer key_scales,
                         ffi::AnyBuffer value_scales, ffi::Result<ffi::AnyBuffer> key_pages_out,
                         ffi::Result<ffi::AnyBuffer> value_pages_out,
                         ffi::Result<ffi::AnyBuffer> key_scales_out,
                         ffi::Result<ffi::AnyBuffer> value_scales_out) {
  const std::string op = kPagedKvUpdate.name;
  PagedKvUpdateParams p;
  JAXOPS_RETURN_IF_ERROR(decode_paged_kv_update(key_pages, value_pages, key, value, slot_mapping,
                                                key_scales, value_scales, *key_pages_out,
                                                *value_pages_out, *key_scales_out,
                                                *value_scales_out, &p));
  for (auto [from, to] : {std::pair{&key_pages, &*key_pages_out},
                          std::pair{&value_pages, &*value_pages_out},
                          std::pair{&key_scales, &*key_scales_out},
                          std::pair{&value_scales, &*value_scales_out}}) {
    const cudaError_t status = start_from(stream, *from, *to);
    if (status != cudaSuccess) return launch_status(op, status);
  }
  return dispatch(op, key.element_type(), key_pages.element_type(), [&](auto in_tag, auto kv_tag) {
    using In = decltype(in_tag);
    using KV = decltype(kv_tag);
    return launch_status(op, cuda::launch_paged_kv_update<In, KV>(
                                 stream, p, data<const In>(key), data<const In>(value),
                                 data<const int32_t>(slot_mapping), data<KV>(*key_pages_out),
                                 data<KV>(*value_pages_out), data_or_null<float>(*key_scales_out),
                                 data_or_null<float>(*value_scales_out)));
  });
}

}  // namespace

// Distinct symbol names from the CPU module's handlers: both modules can be
// loaded in one process.
JAXOPS_FFI_TARGET(kPagedAttentionFwd, kPagedAttentionFwdCuda, PagedAttentionFwd,
                  bind_paged_attention_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kPagedKvUpdate, kPagedKvUpdateCuda, PagedKvUpdate,
                  bind_paged_kv_update(cuda_binding()));

}  // namespace jaxops
