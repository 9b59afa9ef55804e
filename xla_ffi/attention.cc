// CPU FFI handlers of attention: decode and validate every buffer, then call
// cpu/attention. Optional operands (bias, mask, sequence lengths, the
// logsumexp cotangent, the forward mode's input tangents) are zero-size
// buffers when absent.
#include <cmath>
#include <memory>
#include <new>
#include <string>

#include "cpu/attention.h"
#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "xla_ffi/attention_common.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace attention_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

// Kernel scratch, owned by the handler for the duration of the call.
struct Workspace {
  std::unique_ptr<char[]> bytes;
  ffi::Error allocate(const std::string& op, size_t size) {
    bytes.reset(new (std::nothrow) char[size]);
    if (!bytes) return ffi::Error(ffi::ErrorCode::kResourceExhausted, op + ": out of memory");
    cpu::advise_huge_pages(bytes.get(), size);
    return ffi::Error::Success();
  }
};

// What every handler does: decode the shared operands into the kernel's
// parameters, validate the rest (check(op, params) returns the error), and call
// run(tag, params, workspace) for the element type (tag: a value of it) with
// scratch of workspace_bytes(tag, params) bytes.
template <typename Check, typename WorkspaceBytes, typename Run>
ffi::Error run_attention(const std::string& op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                         const ffi::AnyBuffer& v, const ffi::AnyBuffer& bias,
                         const ffi::AnyBuffer& mask, const ffi::AnyBuffer& q_lengths,
                         const ffi::AnyBuffer& kv_lengths, const ffi::AnyBuffer& q_segments,
                         const ffi::AnyBuffer& kv_segments, const ffi::AnyBuffer& query_offset,
                         float scale, bool is_causal, int64_t window_left, int64_t window_right,
                         float logits_soft_cap, bool allow_tf32, Check&& check,
                         WorkspaceBytes&& workspace_bytes, Run&& run) {
  AttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_shape(op, q, k, v, bias, mask, q_lengths, kv_lengths, q_segments,
                                      kv_segments, query_offset, scale, is_causal, window_left,
                                      window_right, logits_soft_cap, allow_tf32, &p));
  JAXOPS_RETURN_IF_ERROR(check(op, p));
  return dispatch(op, q.element_type(), [&](auto tag) {
    Workspace ws;
    JAXOPS_RETURN_IF_ERROR(ws.allocate(op, workspace_bytes(tag, p)));
    run(tag, p, ws.bytes.get());
    return ffi::Error::Success();
  });
}

ffi::Error AttentionFwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer q_segments, ffi::AnyBuffer kv_segments,
                        ffi::AnyBuffer query_offset, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                        float scale, bool is_causal, int64_t window_left, int64_t window_right,
                        float logits_soft_cap, bool allow_tf32) {
  return run_attention(
      kAttentionFwd.name, q, k, v, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments,
      query_offset, scale, is_causal, window_left, window_right, logits_soft_cap, allow_tf32,
      [&](const std::string& op, const AttentionParams& s) {
        JAXOPS_RETURN_IF_ERROR(check_fwd(op, q, *out, *lse, s));
        // The workspace is CUDA's decode split-K scratch: [0] here, checked and unused.
        return check_fwd_workspace(op, *workspace,
                                   fwd_workspace_bytes(s, contract::Platform::kCpu));
      },
      [](auto tag, const AttentionParams& p) {
        return cpu::attention_fwd_workspace_bytes<decltype(tag)>(p);
      },
      [&](auto tag, const AttentionParams& p, void* workspace) {
        using T = decltype(tag);
        cpu::advise_huge_pages(out->untyped_data(), out->size_bytes());
        cpu::attention_fwd<T>(p, data<const T>(q), data<const T>(k), data<const T>(v),
                              data<T>(*out), data<float>(*lse), workspace);
      });
}

ffi::Error AttentionBwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer q_segments, ffi::AnyBuffer kv_segments,
                        ffi::AnyBuffer query_offset, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                        float scale, bool is_causal,
                        int64_t window_left, int64_t window_right, float logits_soft_cap,
                        bool with_dbias, bool allow_tf32) {
  return run_attention(
      kAttentionBwd.name, q, k, v, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments,
      query_offset, scale, is_causal, window_left, window_right, logits_soft_cap, allow_tf32,
      // The CPU kernel sizes its scratch by its thread count and allocates it
      // here: the hidden workspace result is empty on this platform.
      [&](const std::string& op, const AttentionParams& s) {
        return check_bwd(op, q, k, v, bias, out, lse, dout, dlse, *dq, *dk, *dv, *dbias,
                         *workspace, with_dbias,
                         bwd_workspace_bytes(s, contract::Platform::kCpu), s);
      },
      [&](auto tag, const AttentionParams& p) {
        return cpu::attention_bwd_workspace_bytes<decltype(tag)>(p, with_dbias);
      },
      [&](auto tag, const AttentionParams& p, void* scratch) {
        using T = decltype(tag);
        cpu::advise_huge_pages(dq->untyped_data(), dq->size_bytes());
        cpu::advise_huge_pages(dk->untyped_data(), dk->size_bytes());
        cpu::advise_huge_pages(dv->untyped_data(), dv->size_bytes());
        cpu::attention_bwd<T>(p, data<const T>(q), data<const T>(k), data<const T>(v),
                              data<const T>(out), data<const float>(lse), data<const T>(dout),
                              data_or_null<const float>(dlse), data<T>(*dq), data<T>(*dk),
                              data<T>(*dv), with_dbias ? data<float>(*dbias) : nullptr, scratch);
      });
}

// Forward mode: the forward's results and their tangents in one pass. An
// absent (zero) input tangent is a null pointer for the kernel, which then
// skips its products.
ffi::Error AttentionFwdJvp(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths,
                           ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segments,
                           ffi::AnyBuffer kv_segments, ffi::AnyBuffer query_offset,
                           ffi::AnyBuffer dq, ffi::AnyBuffer dk, ffi::AnyBuffer dv,
                           ffi::AnyBuffer dbias, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> dout,
                           ffi::Result<ffi::AnyBuffer> dlse, float scale, bool is_causal,
                           int64_t window_left, int64_t window_right, float logits_soft_cap,
                           bool allow_tf32) {
  return run_attention(
      kAttentionFwdJvp.name, q, k, v, bias, mask, q_lengths, kv_lengths, q_segments, kv_segments,
      query_offset, scale, is_causal, window_left, window_right, logits_soft_cap, allow_tf32,
      [&](const std::string& op, const AttentionParams& s) {
        return check_fwd_jvp(op, q, k, v, bias, dq, dk, dv, dbias, *out, *lse, *dout, *dlse, s);
      },
      [](auto tag, const AttentionParams& p) {
        return cpu::attention_fwd_jvp_workspace_bytes<decltype(tag)>(p);
      },
      [&](auto tag, const AttentionParams& p, void* workspace) {
        using T = decltype(tag);
        cpu::advise_huge_pages(out->untyped_data(), out->size_bytes());
        cpu::advise_huge_pages(dout->untyped_data(), dout->size_bytes());
        cpu::attention_fwd_jvp<T>(p, data<const T>(q), data<const T>(k), data<const T>(v),
                                  data_or_null<const T>(dq), data_or_null<const T>(dk),
                                  data_or_null<const T>(dv), data_or_null<const float>(dbias),
                                  data<T>(*out), data<float>(*lse), data<T>(*dout),
                                  data<float>(*dlse), workspace);
      });
}

}  // namespace

JAXOPS_FFI_TARGET(kAttentionFwd, kAttentionFwdCpu, AttentionFwd,
                  bind_attention_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kAttentionBwd, kAttentionBwdCpu, AttentionBwd,
                  bind_attention_bwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kAttentionFwdJvp, kAttentionFwdJvpCpu, AttentionFwdJvp,
                  bind_attention_fwd_jvp(ffi::Ffi::Bind()));

}  // namespace jaxops
