// CPU FFI handlers of attention: decode and validate every buffer, then call
// cpu/attention. Optional operands (bias, mask, sequence lengths, the
// logsumexp cotangent) are zero-size buffers when absent.
#include <cmath>
#include <memory>
#include <new>
#include <string>

#include "cpu/attention.h"
#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

std::string str(int64_t v) { return std::to_string(v); }

// A rank-4 operand broadcastable to [B, N, T, S]: each extent 1 or the full one.
// Strides are those of its contiguous layout, 0 along extent-1 axes.
ffi::Error broadcast_strides(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                             const int64_t full[4], int64_t strides[4]) {
  auto dims = x.dimensions();
  bool ok = dims.size() == 4;
  for (size_t d = 0; ok && d < 4; ++d) ok = dims[d] == 1 || dims[d] == full[d];
  if (!ok) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) +
                           ", expected rank 4 broadcastable to [" + str(full[0]) + ", " +
                           str(full[1]) + ", " + str(full[2]) + ", " + str(full[3]) + "]");
  }
  int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    strides[d] = dims[d] == 1 ? 0 : stride;
    stride *= dims[d];
  }
  return ffi::Error::Success();
}

ffi::Error check_lengths(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                         int64_t batch) {
  if (x.element_count() == 0 && batch != 0) return ffi::Error::Success();  // absent
  if (x.element_type() != ffi::DataType::S32 || x.dimensions().size() != 1 ||
      x.dimensions()[0] != batch) {
    return invalid(op, std::string(name) + " must be int32 of shape [" + str(batch) + "], got " +
                           dims_string(x.dimensions()));
  }
  return ffi::Error::Success();
}

template <typename A, typename B>
ffi::Error check_same(const std::string& op, const char* a_name, const A& a, const char* b_name,
                      const B& b) {
  JAXOPS_RETURN_IF_ERROR(same_dims(op, a_name, a, b_name, b));
  return same_dtype(op, a_name, a, b_name, b);
}

ffi::Error check_stats(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                       const cpu::AttentionParams& p, bool optional) {
  if (optional && x.element_count() == 0 && p.batch * p.num_heads * p.q_len != 0) {
    return ffi::Error::Success();
  }
  auto dims = x.dimensions();
  if (x.element_type() != ffi::DataType::F32 || dims.size() != 3 || dims[0] != p.batch ||
      dims[1] != p.num_heads || dims[2] != p.q_len) {
    return invalid(op, std::string(name) + " must be float32 of shape [" + str(p.batch) + ", " +
                           str(p.num_heads) + ", " + str(p.q_len) + "], got " +
                           dims_string(dims));
  }
  return ffi::Error::Success();
}

// Shapes, masks and attributes shared by the forward and the backward.
ffi::Error decode_params(const std::string& op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                         const ffi::AnyBuffer& v, const ffi::AnyBuffer& bias,
                         const ffi::AnyBuffer& mask, const ffi::AnyBuffer& q_lengths,
                         const ffi::AnyBuffer& kv_lengths, const ffi::AnyBuffer& query_offset,
                         float scale, bool is_causal, int64_t window_left,
                         int64_t window_right, cpu::AttentionParams* p) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4) return invalid(op, "query must be [B, T, N, H], got " + dims_string(qd));
  if (kd.size() != 4 || kd[0] != qd[0] || kd[3] != qd[3]) {
    return invalid(op, "key must be [B, S, K, H] with query's B and H, got " + dims_string(kd) +
                           " for query " + dims_string(qd));
  }
  JAXOPS_RETURN_IF_ERROR(check_same(op, "key", k, "value", v));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "query", q, "key", k));
  p->batch = qd[0];
  p->q_len = qd[1];
  p->num_heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->num_kv_heads = kd[2];
  const int64_t full[4] = {p->batch, p->num_heads, p->q_len, p->kv_len};
  if (bias.element_count() != 0) {
    if (bias.element_type() != ffi::DataType::F32) return invalid(op, "bias must be float32");
    JAXOPS_RETURN_IF_ERROR(broadcast_strides(op, "bias", bias, full, p->bias_strides));
    p->bias = data<const float>(bias);
  }
  if (mask.element_count() != 0) {
    if (mask.element_type() != ffi::DataType::PRED) return invalid(op, "mask must be bool");
    JAXOPS_RETURN_IF_ERROR(broadcast_strides(op, "mask", mask, full, p->mask_strides));
    p->mask = data<const uint8_t>(mask);
  }
  JAXOPS_RETURN_IF_ERROR(check_lengths(op, "query_seq_lengths", q_lengths, p->batch));
  JAXOPS_RETURN_IF_ERROR(check_lengths(op, "key_value_seq_lengths", kv_lengths, p->batch));
  p->q_seq_lengths = data_or_null<const int32_t>(q_lengths);
  p->kv_seq_lengths = data_or_null<const int32_t>(kv_lengths);
  if (query_offset.element_type() != ffi::DataType::S32 || query_offset.element_count() != 1) {
    return invalid(op, "query_offset must be an int32 scalar");
  }
  p->query_offset = *data<const int32_t>(query_offset);
  p->scale = scale;
  p->is_causal = is_causal;
  p->window_left = window_left;
  p->window_right = window_right;
  if (const char* error = cpu::attention_params_error(*p)) return invalid(op, error);
  return ffi::Error::Success();
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

ffi::Error AttentionFwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer query_offset, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, float scale, bool is_causal,
                        int64_t window_left, int64_t window_right) {
  const std::string op = "jaxops_attention_fwd";
  cpu::AttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_params(op, q, k, v, bias, mask, q_lengths, kv_lengths,
                                       query_offset, scale, is_causal, window_left, window_right,
                                       &p));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "query", q, "out", *out));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "logsumexp", *lse, p, false));
  return dispatch(op, q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    Workspace ws;
    JAXOPS_RETURN_IF_ERROR(ws.allocate(op, cpu::attention_fwd_workspace_bytes<T>(p)));
    cpu::advise_huge_pages(out->untyped_data(), out->size_bytes());
    cpu::attention_fwd<T>(p, data<const T>(q), data<const T>(k), data<const T>(v), data<T>(*out),
                          data<float>(*lse), ws.bytes.get());
    return ffi::Error::Success();
  });
}

ffi::Error AttentionBwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer query_offset, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias, float scale, bool is_causal,
                        int64_t window_left, int64_t window_right, bool with_dbias) {
  const std::string op = "jaxops_attention_bwd";
  cpu::AttentionParams p;
  JAXOPS_RETURN_IF_ERROR(decode_params(op, q, k, v, bias, mask, q_lengths, kv_lengths,
                                       query_offset, scale, is_causal, window_left, window_right,
                                       &p));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "query", q, "out", out));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "query", q, "dout", dout));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "logsumexp", lse, p, false));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "dlogsumexp", dlse, p, true));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "query", q, "dquery", *dq));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "key", k, "dkey", *dk));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "value", v, "dvalue", *dv));
  if (with_dbias) {
    if (!p.bias) return invalid(op, "with_dbias requires a bias");
    JAXOPS_RETURN_IF_ERROR(check_same(op, "bias", bias, "dbias", *dbias));
  } else if (dbias->dimensions().size() != 1 || dbias->element_count() != 0) {
    return invalid(op, "dbias must be [0] when with_dbias is false");
  }
  return dispatch(op, q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    Workspace ws;
    JAXOPS_RETURN_IF_ERROR(ws.allocate(op, cpu::attention_bwd_workspace_bytes<T>(p, with_dbias)));
    cpu::advise_huge_pages(dq->untyped_data(), dq->size_bytes());
    cpu::advise_huge_pages(dk->untyped_data(), dk->size_bytes());
    cpu::advise_huge_pages(dv->untyped_data(), dv->size_bytes());
    cpu::attention_bwd<T>(p, data<const T>(q), data<const T>(k), data<const T>(v),
                          data<const T>(out), data<const float>(lse), data<const T>(dout),
                          data_or_null<const float>(dlse), data<T>(*dq), data<T>(*dk),
                          data<T>(*dv), with_dbias ? data<float>(*dbias) : nullptr,
                          ws.bytes.get());
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttentionFwd, AttentionFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // query [B, T, N, H]
                                  .Arg<ffi::AnyBuffer>()  // key [B, S, K, H]
                                  .Arg<ffi::AnyBuffer>()  // value [B, S, K, H]
                                  .Arg<ffi::AnyBuffer>()  // bias f32, broadcastable, or [0]
                                  .Arg<ffi::AnyBuffer>()  // mask bool, broadcastable, or [0]
                                  .Arg<ffi::AnyBuffer>()  // query_seq_lengths s32 [B] or [0]
                                  .Arg<ffi::AnyBuffer>()  // key_value_seq_lengths s32 [B] or [0]
                                  .Arg<ffi::AnyBuffer>()  // query_offset s32 []
                                  .Ret<ffi::AnyBuffer>()  // out [B, T, N, H]
                                  .Ret<ffi::AnyBuffer>()  // logsumexp f32 [B, N, T]
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttentionBwd, AttentionBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // query
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // value
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // query_seq_lengths
                                  .Arg<ffi::AnyBuffer>()  // key_value_seq_lengths
                                  .Arg<ffi::AnyBuffer>()  // query_offset
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // logsumexp
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // dlogsumexp f32 [B, N, T] or [0]
                                  .Ret<ffi::AnyBuffer>()  // dquery
                                  .Ret<ffi::AnyBuffer>()  // dkey
                                  .Ret<ffi::AnyBuffer>()  // dvalue
                                  .Ret<ffi::AnyBuffer>()  // dbias f32, bias-shaped, or [0]
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("with_dbias"));

JAXOPS_REGISTER_FFI_TARGET("jaxops_attention_fwd", kAttentionFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_attention_bwd", kAttentionBwd);

}  // namespace jaxops
