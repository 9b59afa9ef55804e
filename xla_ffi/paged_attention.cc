// CPU FFI handlers of the paged KV cache: validate and decode
// (xla_ffi/paged_attention_common.h), then call cpu/paged_attention.
#include <cstring>
#include <string>

#include "cpu/float_convert.h"
#include "cpu/paged_attention.h"
#include "xla_ffi/paged_attention_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace paged_attention_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType q_dtype, ffi::DataType page_dtype,
                    Fn&& fn) {
  return dispatch_paged<float, cpu::bfloat16, cpu::float16, int8_t>(op, q_dtype, page_dtype,
                                                                     std::forward<Fn>(fn));
}

ffi::Error PagedAttentionFwd(ffi::AnyBuffer query, ffi::AnyBuffer key_pages,
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
  // The workspace is CUDA's split-K scratch: [0] here, checked and unused.
  JAXOPS_RETURN_IF_ERROR(decode_paged_attention(query, key_pages, value_pages, block_tables,
                                                kv_lens, query_lens, key_scales, value_scales,
                                                *out, *logsumexp, *workspace,
                                                contract::Platform::kCpu, scale,
                                                logits_soft_cap, window_left, value_head_dim, &p));
  return dispatch(op, query.element_type(), key_pages.element_type(), [&](auto q_tag, auto kv_tag) {
    using Q = decltype(q_tag);
    using KV = decltype(kv_tag);
    cpu::paged_attention_fwd<Q, KV>(p, data<const Q>(query), data<const KV>(key_pages),
                                    data<const KV>(value_pages), data<Q>(*out),
                                    data<float>(*logsumexp));
    return ffi::Error::Success();
  });
}

// The result holds the operand's contents before the slots are written: it is
// the operand's own buffer when XLA aliased them, else a copy is made.
void start_from(const ffi::AnyBuffer& operand, ffi::AnyBuffer& result) {
  if (result.untyped_data() != operand.untyped_data() && operand.size_bytes() != 0) {
    std::memcpy(result.untyped_data(), operand.untyped_data(), operand.size_bytes());
  }
}

ffi::Error PagedKvUpdate(ffi::AnyBuffer key_pages, ffi::AnyBuffer value_pages, ffi::AnyBuffer key,
                         ffi::AnyBuffer value, ffi::AnyBuffer slot_mapping,
                         ffi::AnyBuffer key_scales, ffi::AnyBuffer value_scales,
                         ffi::Result<ffi::AnyBuffer> key_pages_out,
                         ffi::Result<ffi::AnyBuffer> value_pages_out,
                         ffi::Result<ffi::AnyBuffer> key_scales_out,
                         ffi::Result<ffi::AnyBuffer> value_scales_out) {
  const std::string op = kPagedKvUpdate.name;
  PagedKvUpdateParams p;
  JAXOPS_RETURN_IF_ERROR(decode_paged_kv_update(key_pages, value_pages, key, value, slot_mapping,
                                                key_scales, value_scales, *key_pages_out,
                                                *value_pages_out, *key_scales_out,
                                                *value_scales_out, &p));
  start_from(key_pages, *key_pages_out);
  start_from(value_pages, *value_pages_out);
  start_from(key_scales, *key_scales_out);
  start_from(value_scales, *value_scales_out);
  return dispatch(op, key.element_type(), key_pages.element_type(), [&](auto src_tag, auto page_tag) {
    using Src = decltype(src_tag);
    using Page = decltype(page_tag);
    cpu::paged_kv_update<Src, Page>(
        p, data<const Src>(key), data<const Src>(value), data<const int32_t>(slot_mapping),
        data<Page>(*key_pages_out), data<Page>(*value_pages_out),
        data_or_null<float>(*key_scales_out), data_or_null<float>(*value_scales_out));
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kPagedAttentionFwd, kPagedAttentionFwdCpu, PagedAttentionFwd,
                  bind_paged_attention_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kPagedKvUpdate, kPagedKvUpdateCpu, PagedKvUpdate,
                  bind_paged_kv_update(ffi::Ffi::Bind()));

}  // namespace jaxops
