// What the CPU and CUDA handlers of attention share, so the two platforms bind
// the same signatures and accept exactly the same calls: the FFI bindings (each
// takes the platform's binding prefix: nothing for the CPU, the stream for
// CUDA), the validation of every buffer and attribute, and the broadcast
// strides of the bias and mask. Optional operands (bias, mask, sequence
// lengths, the logsumexp cotangent) are zero-size buffers when absent.
//
// The decoded call is the kernels' own parameter struct (params/attention.h),
// filled once here for both platforms. query_offset is an operand (a traced
// offset does not recompile): the struct holds its buffer, whose value the
// kernel reads (on CUDA it is device memory), so only its type and shape are
// checked here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "params/attention.h"
#include "params/attention_decode.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/matmul_precision.h"

namespace jaxops::attention_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

using ::jaxops::matmul_precision::kAllowTf32;
using ::jaxops::params::AttentionParams;

// -- the targets' contract ------------------------------------------------------------

inline constexpr contract::Attribute<float> kScale{"scale"};
inline constexpr contract::Attribute<bool> kIsCausal{"is_causal"};
inline constexpr contract::Attribute<int64_t> kWindowLeft{"window_left"};    // -1: unbounded
inline constexpr contract::Attribute<int64_t> kWindowRight{"window_right"};  // -1: unbounded
inline constexpr contract::Attribute<bool> kWithDbias{"with_dbias"};
inline constexpr contract::Attribute<float> kLogitsSoftCap{"logits_soft_cap"};  // 0: none

// The backward's workspace: on CUDA the float32 rows D = rowsum(dout * out) -
// dlogsumexp [B, N, T]; the CPU handler sizes its scratch by its thread count
// and allocates it itself, so its workspace result is empty.
inline int64_t bwd_workspace_bytes(const AttentionParams& p, contract::Platform platform) {
  if (platform == contract::Platform::kCpu) return 0;
  return p.batch * p.num_heads * p.q_len * static_cast<int64_t>(sizeof(float));
}

// The workspace for q [B, T, N, H] (operand 0), in bytes.
inline contract::Workspace bwd_workspace(const contract::WorkspaceQuery& call) {
  const auto& q = call.operand(0);
  AttentionParams p;
  p.batch = q.at(0);
  p.q_len = q.at(1);
  p.num_heads = q.at(2);
  return {{bwd_workspace_bytes(p, call.platform)}, "uint8"};
}

// The forward's workspace: on CUDA the float32 partial states of the decode
// kernels' split-K (params/attention_decode.h) when the call has few query
// rows per kv head and the plan splits its keys; otherwise, and on the CPU
// (whose decode splits within its own scratch), empty.
inline int64_t fwd_workspace_bytes(const AttentionParams& p, contract::Platform platform) {
  if (platform == contract::Platform::kCpu) return 0;
  return params::attention_fwd_workspace_bytes(p.batch, p.q_len, p.kv_len, p.num_heads,
                                               p.num_kv_heads, p.head_dim,
                                               params::value_head_dim(p), p.bias != nullptr,
                                               p.mask != nullptr);
}

// The workspace for q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], bias and
// mask (operands 0-4; an absent bias or mask is [0]), in bytes.
inline contract::Workspace fwd_workspace(const contract::WorkspaceQuery& call) {
  const auto& q = call.operand(0);
  const auto& k = call.operand(1);
  const auto& v = call.operand(2);
  const auto present = [](const std::vector<int64_t>& shape) {
    return !(shape.size() == 1 && shape[0] == 0);
  };
  if (call.platform == contract::Platform::kCpu) return {{0}, "uint8"};
  return {{params::attention_fwd_workspace_bytes(q.at(0), q.at(1), k.at(1), q.at(2), k.at(2),
                                                 q.at(3), v.at(3), present(call.operand(3)),
                                                 present(call.operand(4)))},
          "uint8"};
}

inline constexpr auto kAttentionFwd = contract::target_with_workspace(
    "jaxops_attention_fwd", fwd_workspace, kScale, kIsCausal, kWindowLeft, kWindowRight,
    kLogitsSoftCap, kAllowTf32);
inline constexpr auto kAttentionBwd = contract::target_with_workspace(
    "jaxops_attention_bwd", bwd_workspace, kScale, kIsCausal, kWindowLeft, kWindowRight,
    kLogitsSoftCap, kWithDbias, kAllowTf32);
inline constexpr auto kAttentionFwdJvp = contract::target(
    "jaxops_attention_fwd_jvp", kScale, kIsCausal, kWindowLeft, kWindowRight, kLogitsSoftCap,
    kAllowTf32);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kAttentionFwd), describe(kAttentionBwd), describe(kAttentionFwdJvp)};
}

inline std::string str(int64_t v) { return std::to_string(v); }

// A rank-4 operand broadcastable to [B, N, T, S]: each extent 1 or the full one.
// Strides are those of its contiguous layout, 0 along extent-1 axes.
inline ffi::Error broadcast_strides(const std::string& op, const char* name,
                                    const ffi::AnyBuffer& x, const int64_t full[4],
                                    int64_t strides[4]) {
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

inline ffi::Error check_lengths(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                                int64_t batch) {
  if (x.element_count() == 0 && batch != 0) return ffi::Error::Success();  // absent
  if (x.element_type() != ffi::DataType::S32 || x.dimensions().size() != 1 ||
      x.dimensions()[0] != batch) {
    return invalid(op, std::string(name) + " must be int32 of shape [" + str(batch) + "], got " +
                           dims_string(x.dimensions()));
  }
  return ffi::Error::Success();
}

// int32 [B, X] segment ids, or absent ([0]).
inline ffi::Error check_segment_ids(const std::string& op, const char* name,
                                    const ffi::AnyBuffer& x, int64_t batch, int64_t len) {
  auto dims = x.dimensions();
  if (dims.size() == 1 && dims[0] == 0) return ffi::Error::Success();  // absent
  if (x.element_type() != ffi::DataType::S32 || dims.size() != 2 || dims[0] != batch ||
      dims[1] != len) {
    return invalid(op, std::string(name) + " must be int32 of shape [" + str(batch) + ", " +
                           str(len) + "], got " + dims_string(dims));
  }
  return ffi::Error::Success();
}

template <typename A, typename B>
ffi::Error check_same(const std::string& op, const char* a_name, const A& a, const char* b_name,
                      const B& b) {
  JAXOPS_RETURN_IF_ERROR(same_dims(op, a_name, a, b_name, b));
  return same_dtype(op, a_name, a, b_name, b);
}

// A float32 [B, N, T] row statistic (logsumexp), or absent when `optional`.
inline ffi::Error check_stats(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                              const AttentionParams& s, bool optional) {
  auto dims = x.dimensions();
  // Absent is the [0] placeholder; a present statistic is [B, N, T], which may
  // also hold no elements (T = 0), so the rank tells them apart.
  if (optional && dims.size() == 1 && dims[0] == 0) return ffi::Error::Success();
  if (x.element_type() != ffi::DataType::F32 || dims.size() != 3 || dims[0] != s.batch ||
      dims[1] != s.num_heads || dims[2] != s.q_len) {
    return invalid(op, std::string(name) + " must be float32 of shape [" + str(s.batch) + ", " +
                           str(s.num_heads) + ", " + str(s.q_len) + "], got " +
                           dims_string(dims));
  }
  return ffi::Error::Success();
}

// Shapes, masks and attributes shared by the forward and the backward, decoded
// into the kernels' parameters and checked against the rules every backend shares.
inline ffi::Error decode_shape(const std::string& op, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                               const ffi::AnyBuffer& q_lengths, const ffi::AnyBuffer& kv_lengths,
                               const ffi::AnyBuffer& q_segments,
                               const ffi::AnyBuffer& kv_segments,
                               const ffi::AnyBuffer& query_offset, float scale, bool is_causal,
                               int64_t window_left, int64_t window_right, float logits_soft_cap,
                               bool allow_tf32, AttentionParams* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4) return invalid(op, "query must be [B, T, N, H], got " + dims_string(qd));
  if (kd.size() != 4 || kd[0] != qd[0] || kd[3] != qd[3]) {
    return invalid(op, "key must be [B, S, K, H] with query's B and H, got " + dims_string(kd) +
                           " for query " + dims_string(qd));
  }
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return invalid(op, "value must be [B, S, K, Hv] with key's B, S and K, got " +
                           dims_string(vd) + " for key " + dims_string(kd));
  }
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "key", k, "value", v));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "query", q, "key", k));
  s->batch = qd[0];
  s->q_len = qd[1];
  s->num_heads = qd[2];
  s->head_dim = qd[3];
  s->value_head_dim = vd[3];
  s->kv_len = kd[1];
  s->num_kv_heads = kd[2];
  const int64_t full[4] = {s->batch, s->num_heads, s->q_len, s->kv_len};
  if (bias.element_count() != 0) {
    if (bias.element_type() != ffi::DataType::F32) return invalid(op, "bias must be float32");
    JAXOPS_RETURN_IF_ERROR(broadcast_strides(op, "bias", bias, full, s->bias_strides));
    s->bias = data<const float>(bias);
  }
  if (mask.element_count() != 0) {
    if (mask.element_type() != ffi::DataType::PRED) return invalid(op, "mask must be bool");
    JAXOPS_RETURN_IF_ERROR(broadcast_strides(op, "mask", mask, full, s->mask_strides));
    s->mask = data<const uint8_t>(mask);
  }
  JAXOPS_RETURN_IF_ERROR(check_lengths(op, "query_seq_lengths", q_lengths, s->batch));
  JAXOPS_RETURN_IF_ERROR(check_lengths(op, "key_value_seq_lengths", kv_lengths, s->batch));
  s->q_seq_lengths = data_or_null<const int32_t>(q_lengths);
  s->kv_seq_lengths = data_or_null<const int32_t>(kv_lengths);
  JAXOPS_RETURN_IF_ERROR(
      check_segment_ids(op, "query_segment_ids", q_segments, s->batch, s->q_len));
  JAXOPS_RETURN_IF_ERROR(
      check_segment_ids(op, "key_value_segment_ids", kv_segments, s->batch, s->kv_len));
  // Zero-size ids of a present operand (B, T or S = 0) are never read.
  const bool q_ids = q_segments.dimensions().size() == 2;
  const bool kv_ids = kv_segments.dimensions().size() == 2;
  if (q_ids != kv_ids) return invalid(op, "give both segment ids or neither");
  if (q_ids) {
    static const int32_t kNoIds = 0;
    s->q_segment_ids = q_segments.element_count() ? data<const int32_t>(q_segments) : &kNoIds;
    s->kv_segment_ids = kv_segments.element_count() ? data<const int32_t>(kv_segments) : &kNoIds;
  }
  if (query_offset.element_type() != ffi::DataType::S32 || query_offset.element_count() != 1) {
    return invalid(op, "query_offset must be an int32 scalar");
  }
  s->query_offset = data<const int32_t>(query_offset);
  s->scale = scale;
  s->is_causal = is_causal;
  s->window_left = window_left;
  s->window_right = window_right;
  s->logits_soft_cap = logits_soft_cap;
  s->allow_tf32 = allow_tf32;
  if (const char* error = params::attention_params_error(*s)) return invalid(op, error);
  return ffi::Error::Success();
}

// An output-shaped buffer (out, dout): [B, T, N, Hv] in the query's dtype.
inline ffi::Error check_like_out(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& q, const AttentionParams& s) {
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "query", q, name, x));
  auto dims = x.dimensions();
  if (dims.size() != 4 || dims[0] != s.batch || dims[1] != s.q_len || dims[2] != s.num_heads ||
      dims[3] != params::value_head_dim(s)) {
    return invalid(op, std::string(name) + " must be [" + str(s.batch) + ", " + str(s.q_len) +
                           ", " + str(s.num_heads) + ", " + str(params::value_head_dim(s)) +
                           "] (query's B, T, N and value's head dim), got " + dims_string(dims));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_fwd(const std::string& op, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                            const AttentionParams& s) {
  JAXOPS_RETURN_IF_ERROR(check_like_out(op, "out", out, q, s));
  return check_stats(op, "logsumexp", lse, s, false);
}

// The forward's hidden workspace result: uint8 [bytes], the platform's
// fwd_workspace_bytes (which the Python side reads from the contract).
inline ffi::Error check_fwd_workspace(const std::string& op, const ffi::AnyBuffer& workspace,
                                      int64_t bytes) {
  auto wd = workspace.dimensions();
  if (workspace.element_type() != ffi::DataType::U8 || wd.size() != 1 || wd[0] != bytes) {
    return invalid(op, "workspace must be uint8 of shape [" + str(bytes) + "], got " +
                           dims_string(wd));
  }
  return ffi::Error::Success();
}

// The backward's buffers; `workspace_bytes` is the platform's size of the
// hidden workspace result (bwd_workspace_bytes, which the Python side reads).
inline ffi::Error check_bwd(const std::string& op, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out,
                            const ffi::AnyBuffer& lse, const ffi::AnyBuffer& dout,
                            const ffi::AnyBuffer& dlse, const ffi::AnyBuffer& dq,
                            const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv,
                            const ffi::AnyBuffer& dbias, const ffi::AnyBuffer& workspace,
                            bool with_dbias, int64_t workspace_bytes, const AttentionParams& s) {
  JAXOPS_RETURN_IF_ERROR(check_like_out(op, "out", out, q, s));
  JAXOPS_RETURN_IF_ERROR(check_like_out(op, "dout", dout, q, s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "logsumexp", lse, s, false));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "dlogsumexp", dlse, s, true));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "query", q, "dquery", dq));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "key", k, "dkey", dk));
  JAXOPS_RETURN_IF_ERROR(check_same(op, "value", v, "dvalue", dv));
  if (with_dbias) {
    if (!s.bias) return invalid(op, "with_dbias requires a bias");
    JAXOPS_RETURN_IF_ERROR(check_same(op, "bias", bias, "dbias", dbias));
  } else if (dbias.dimensions().size() != 1 || dbias.element_count() != 0) {
    return invalid(op, "dbias must be [0] when with_dbias is false");
  }
  if (static_cast<int64_t>(workspace.size_bytes()) != workspace_bytes) {
    return invalid(op, "workspace has " + str(static_cast<int64_t>(workspace.size_bytes())) +
                           " bytes, expected " + str(workspace_bytes));
  }
  return ffi::Error::Success();
}

// A tangent operand of the forward-mode kernel: the [0] placeholder when the
// input's tangent is zero, else shaped like the input (a present tangent of an
// input with no elements keeps the input's rank, so the rank tells them apart).
template <typename Primal>
ffi::Error check_tangent(const std::string& op, const char* name, const ffi::AnyBuffer& tangent,
                         const char* primal_name, const Primal& primal) {
  auto dims = tangent.dimensions();
  if (dims.size() == 1 && dims[0] == 0 && primal.dimensions().size() != 1) {
    return ffi::Error::Success();
  }
  return check_same(op, primal_name, primal, name, tangent);
}

// The forward-mode kernel's buffers: the forward's results plus the tangents
// of out and logsumexp, from the tangents of query, key, value and bias (each
// absent when zero; the bias tangent only with a bias).
inline ffi::Error check_fwd_jvp(const std::string& op, const ffi::AnyBuffer& q,
                                const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                const ffi::AnyBuffer& bias, const ffi::AnyBuffer& dq,
                                const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv,
                                const ffi::AnyBuffer& dbias, const ffi::AnyBuffer& out,
                                const ffi::AnyBuffer& lse, const ffi::AnyBuffer& dout,
                                const ffi::AnyBuffer& dlse, const AttentionParams& s) {
  JAXOPS_RETURN_IF_ERROR(check_fwd(op, q, out, lse, s));
  JAXOPS_RETURN_IF_ERROR(check_like_out(op, "dout", dout, q, s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "dlogsumexp", dlse, s, false));
  JAXOPS_RETURN_IF_ERROR(check_tangent(op, "dquery", dq, "query", q));
  JAXOPS_RETURN_IF_ERROR(check_tangent(op, "dkey", dk, "key", k));
  JAXOPS_RETURN_IF_ERROR(check_tangent(op, "dvalue", dv, "value", v));
  if (dbias.dimensions().size() == 1 && dbias.dimensions()[0] == 0) return ffi::Error::Success();
  if (!s.bias) return invalid(op, "a bias tangent requires a bias");
  return check_same(op, "bias", bias, "dbias", dbias);
}

// -- bindings: `prefix` is ffi::Ffi::Bind(), with the stream context on CUDA ----------

// The operands every attention target starts with. (Bindings are taken by
// reference: they cannot be moved, only built on in one expression.)
template <typename Binding>
auto bind_attention_operands(Binding&& prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // query [B, T, N, H]
      .template Arg<ffi::AnyBuffer>()                      // key [B, S, K, H]
      .template Arg<ffi::AnyBuffer>()                      // value [B, S, K, Hv]
      .template Arg<ffi::AnyBuffer>()                      // bias f32, broadcastable, or [0]
      .template Arg<ffi::AnyBuffer>()                      // mask bool, broadcastable, or [0]
      .template Arg<ffi::AnyBuffer>()                      // query_seq_lengths s32 [B] or [0]
      .template Arg<ffi::AnyBuffer>()                      // key_value_seq_lengths s32 [B] or [0]
      .template Arg<ffi::AnyBuffer>()                      // query_segment_ids s32 [B, T] or [0]
      .template Arg<ffi::AnyBuffer>()                      // key_value_segment_ids s32 [B, S] or [0]
      .template Arg<ffi::AnyBuffer>();                     // query_offset s32 []
}

template <typename Binding>
auto bind_attention_fwd(Binding prefix) {
  return bind_attention_operands(std::move(prefix))
      .template Ret<ffi::AnyBuffer>()   // out [B, T, N, Hv]
      .template Ret<ffi::AnyBuffer>()   // logsumexp f32 [B, N, T]
      .template Ret<ffi::AnyBuffer>();  // workspace (u8; [0] on the CPU and unsplit)
}

template <typename Binding>
auto bind_attention_bwd(Binding prefix) {
  return bind_attention_operands(std::move(prefix))
      .template Arg<ffi::AnyBuffer>()   // out
      .template Arg<ffi::AnyBuffer>()   // logsumexp
      .template Arg<ffi::AnyBuffer>()   // dout
      .template Arg<ffi::AnyBuffer>()   // dlogsumexp f32 [B, N, T] or [0]
      .template Ret<ffi::AnyBuffer>()   // dquery
      .template Ret<ffi::AnyBuffer>()   // dkey
      .template Ret<ffi::AnyBuffer>()   // dvalue
      .template Ret<ffi::AnyBuffer>()   // dbias f32, bias-shaped, or [0]
      .template Ret<ffi::AnyBuffer>();  // workspace (u8; [0] on the CPU)
}

template <typename Binding>
auto bind_attention_fwd_jvp(Binding prefix) {
  return bind_attention_operands(std::move(prefix))
      .template Arg<ffi::AnyBuffer>()   // dquery, query-shaped, or [0] (zero)
      .template Arg<ffi::AnyBuffer>()   // dkey, key-shaped, or [0]
      .template Arg<ffi::AnyBuffer>()   // dvalue, value-shaped, or [0]
      .template Arg<ffi::AnyBuffer>()   // dbias f32, bias-shaped, or [0]
      .template Ret<ffi::AnyBuffer>()   // out [B, T, N, Hv]
      .template Ret<ffi::AnyBuffer>()   // logsumexp f32 [B, N, T]
      .template Ret<ffi::AnyBuffer>()   // dout [B, T, N, Hv]
      .template Ret<ffi::AnyBuffer>();  // dlogsumexp f32 [B, N, T]
}

}  // namespace jaxops::attention_common
