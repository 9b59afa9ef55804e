// What the CPU and CUDA handlers of the paged KV cache share (issue 14:
// jaxops.paged_attention and jaxops.paged_kv_update), so both platforms bind
// the same signatures and accept exactly the same calls: the targets'
// contract, the validation of every buffer (decoded into the kernels'
// parameter structs, params/paged_attention.h), the dispatch on the (query,
// page) dtype pair, and the FFI bindings (`prefix`: nothing for the CPU, the
// stream for CUDA).
//
// Optional operands are the zero-size placeholder [0] when absent: query_lens
// (every sequence then has T query rows), the float32 scales, which are
// present exactly when the pages are int8, and paged_attention's value pages
// and value scales when the values are the first value_head_dim features of
// the key rows (absorbed MLA: values_in_keys). The value head dim Hv is an
// attribute (the workspace is sized from it before any buffer exists); the
// value pages, when present, and the output carry it as their last dim.
//
// paged_kv_update writes its pages in place: results 0..3 alias operands
// 0, 1, 5, 6 (kPagedKvUpdateAliases). XLA hands a handler the operand's own
// buffer as the result (copying the operand first when it is still live), but
// a handler must not rely on it: when the result buffer is another one it
// copies the operand into it before writing the slots.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "params/paged_attention.h"
#include "params/paged_attention_plan.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/matmul_precision.h"

namespace jaxops::paged_attention_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

using ::jaxops::params::PagedAttentionParams;
using ::jaxops::params::PagedKvUpdateParams;

// -- the targets' contract ------------------------------------------------------------

inline constexpr contract::Attribute<float> kScale{"scale"};
inline constexpr contract::Attribute<float> kLogitsSoftCap{"logits_soft_cap"};  // 0: none
inline constexpr contract::Attribute<int64_t> kWindowLeft{"window_left"};      // -1: unbounded
inline constexpr contract::Attribute<int64_t> kValueHeadDim{"value_head_dim"};  // Hv

// The attention's workspace: on CUDA the float32 partial outputs and softmax
// states of its split-K (params/paged_attention_plan.h), which depend on the
// shapes alone (never on the traced kv_lens) and are empty when the plan does
// not split; the CPU kernel splits within its own threads' scratch, so its
// workspace result is empty ([0] bytes).
inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p,
                                               contract::Platform platform) {
  if (platform == contract::Platform::kCpu) return 0;
  return params::paged_attention_workspace_bytes(p);
}

// The workspace for query [B, T, N, H], key_pages [P, page_size, K, H] and
// block_tables [B, M] (operands 0, 1 and 3) and the value head dim, in bytes.
inline contract::Workspace paged_attention_workspace(const contract::WorkspaceQuery& call) {
  const auto& q = call.operand(0);
  const auto& pages = call.operand(1);
  const auto& tables = call.operand(3);
  if (q.size() != 4 || pages.size() != 4 || tables.size() != 2) {
    throw std::invalid_argument("paged_attention workspace: query and key_pages must have rank "
                                "4 and block_tables rank 2");
  }
  PagedAttentionParams p;
  p.batch = q[0];
  p.q_len = q[1];
  p.num_heads = q[2];
  p.head_dim = q[3];
  p.num_pages = pages[0];
  p.page_size = pages[1];
  p.num_kv_heads = pages[2];
  p.max_pages_per_seq = tables[1];
  p.value_head_dim = call.attribute(kValueHeadDim);
  return {{paged_attention_workspace_bytes(p, call.platform)}, "uint8"};
}

inline constexpr auto kPagedAttentionFwd = contract::target_with_workspace(
    "jaxops_paged_attention_fwd", paged_attention_workspace, kScale, kLogitsSoftCap,
    kWindowLeft, kValueHeadDim, matmul_precision::kAllowTf32);
inline constexpr auto kPagedKvUpdate = contract::target("jaxops_paged_kv_update");

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kPagedAttentionFwd), describe(kPagedKvUpdate)};
}

// paged_kv_update's result i aliases operand kPagedKvUpdateAliases[i] (the
// Python primitive declares the same map).
inline constexpr int kPagedKvUpdateAliases[4] = {0, 1, 5, 6};

inline std::string str(int64_t v) { return std::to_string(v); }

// -- dtypes -------------------------------------------------------------------------

inline bool is_float_dtype(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// Calls fn(Q{}, KV{}): Q the query's (or the written rows') element type, KV
// the pages' (Q itself, or Int8 for int8 pages). Every other pair is an error.
template <typename Float32, typename BFloat16, typename Float16, typename Int8, typename Fn>
ffi::Error dispatch_paged(const std::string& op, ffi::DataType q_dtype, ffi::DataType page_dtype,
                          Fn&& fn) {
  return dispatch_float<Float32, BFloat16, Float16>(op, q_dtype, [&](auto q_tag) {
    using Q = decltype(q_tag);
    if (page_dtype == ffi::DataType::S8) return fn(q_tag, Int8{});
    return fn(q_tag, Q{});
  });
}

// -- shared checks ------------------------------------------------------------------

// Pages [P, page_size, K, H] (key and value alike; value pages may have a
// head dim of their own when `value_dims_free`), float32/bfloat16/float16/int8.
inline ffi::Error check_pages(const std::string& op, const ffi::AnyBuffer& key_pages,
                              const ffi::AnyBuffer& value_pages, int64_t dims_out[4],
                              bool value_dims_free = false) {
  auto kd = key_pages.dimensions();
  if (kd.size() != 4) {
    return invalid(op, "key_pages must be [num_pages, page_size, num_kv_heads, head_dim], got " +
                           dims_string(kd));
  }
  if (value_dims_free) {
    auto vd = value_pages.dimensions();
    if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
      return invalid(op, "value_pages must be [" + str(kd[0]) + ", " + str(kd[1]) + ", " +
                             str(kd[2]) + ", value_head_dim] (the key pages' first three "
                             "dims), got " + dims_string(vd));
    }
  } else {
    JAXOPS_RETURN_IF_ERROR(same_dims(op, "key_pages", key_pages, "value_pages", value_pages));
  }
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "key_pages", key_pages, "value_pages", value_pages));
  if (!is_float_dtype(key_pages.element_type()) && key_pages.element_type() != ffi::DataType::S8) {
    return invalid(op, "key_pages must be float32, bfloat16, float16 or int8");
  }
  for (int d = 0; d < 4; ++d) dims_out[d] = kd[d];
  return ffi::Error::Success();
}

// The float32 scales [P, page_size, K]: present (rank 3) exactly when the
// pages are int8, else the [0] placeholder.
inline ffi::Error check_scales(const std::string& op, const char* name, const ffi::AnyBuffer& x,
                               bool int8_pages, const int64_t pages[4]) {
  auto dims = x.dimensions();
  if (!int8_pages) {
    if (is_placeholder(x)) return ffi::Error::Success();
    return invalid(op, std::string(name) + " must be absent ([0]) for float pages, got " +
                           dims_string(dims));
  }
  if (x.element_type() != ffi::DataType::F32 || dims.size() != 3 || dims[0] != pages[0] ||
      dims[1] != pages[1] || dims[2] != pages[2]) {
    return invalid(op, std::string(name) + " must be float32 of shape [" + str(pages[0]) + ", " +
                           str(pages[1]) + ", " + str(pages[2]) + "] for int8 pages, got " +
                           dims_string(dims));
  }
  return ffi::Error::Success();
}

// An int32 vector [n].
inline ffi::Error check_int32_vector(const std::string& op, const char* name,
                                     const ffi::AnyBuffer& x, int64_t n) {
  if (x.element_type() != ffi::DataType::S32 || x.dimensions().size() != 1 ||
      x.dimensions()[0] != n) {
    return invalid(op, std::string(name) + " must be int32 of shape [" + str(n) + "], got " +
                           dims_string(x.dimensions()));
  }
  return ffi::Error::Success();
}

// -- paged_attention ----------------------------------------------------------------

// Every buffer and attribute of a paged_attention call, decoded into `p`
// (whose operand pointers then point into the buffers); the workspace must be
// the uint8 [paged_attention_workspace_bytes(p, platform)] the Python side
// sized from the contract.
inline ffi::Error decode_paged_attention(
    const ffi::AnyBuffer& query, const ffi::AnyBuffer& key_pages,
    const ffi::AnyBuffer& value_pages, const ffi::AnyBuffer& block_tables,
    const ffi::AnyBuffer& kv_lens, const ffi::AnyBuffer& query_lens,
    const ffi::AnyBuffer& key_scales, const ffi::AnyBuffer& value_scales,
    const ffi::AnyBuffer& out, const ffi::AnyBuffer& logsumexp,
    const ffi::AnyBuffer& workspace, contract::Platform platform, float scale,
    float logits_soft_cap, int64_t window_left, int64_t value_head_dim,
    PagedAttentionParams* p) {
  const std::string op = kPagedAttentionFwd.name;
  auto qd = query.dimensions();
  if (qd.size() != 4) {
    return invalid(op, "query must be [batch, q_len, num_heads, head_dim], got " +
                           dims_string(qd));
  }
  if (!is_float_dtype(query.element_type())) {
    return invalid(op, "query must be float32, bfloat16 or float16");
  }
  // No value pages: the values are the key rows' first value_head_dim features.
  const bool values_in_keys = is_placeholder(value_pages);
  int64_t pages[4];
  JAXOPS_RETURN_IF_ERROR(check_pages(op, key_pages, values_in_keys ? key_pages : value_pages,
                                     pages, /*value_dims_free=*/true));
  const bool int8_pages = key_pages.element_type() == ffi::DataType::S8;
  if (!int8_pages) JAXOPS_RETURN_IF_ERROR(same_dtype(op, "query", query, "key_pages", key_pages));
  if (pages[3] != qd[3]) {
    return invalid(op, "key_pages' head_dim " + str(pages[3]) + " differs from query's " +
                           str(qd[3]));
  }
  if (value_head_dim < 0 || (values_in_keys ? value_head_dim > pages[3]
                                            : value_head_dim != value_pages.dimensions()[3])) {
    return invalid(op, "value_head_dim " + str(value_head_dim) + " must be " +
                           (values_in_keys ? "in [0, head_dim " + str(pages[3]) +
                                                 "] (values read from the key pages)"
                                           : "value_pages' last dim " +
                                                 str(value_pages.dimensions()[3])));
  }
  p->batch = qd[0];
  p->q_len = qd[1];
  p->num_heads = qd[2];
  p->head_dim = qd[3];
  p->value_head_dim = value_head_dim;
  p->values_in_keys = values_in_keys;
  p->num_pages = pages[0];
  p->page_size = pages[1];
  p->num_kv_heads = pages[2];
  auto bd = block_tables.dimensions();
  if (block_tables.element_type() != ffi::DataType::S32 || bd.size() != 2 || bd[0] != p->batch) {
    return invalid(op, "block_tables must be int32 of shape [" + str(p->batch) +
                           ", max_pages_per_seq], got " + dims_string(bd));
  }
  p->max_pages_per_seq = bd[1];
  JAXOPS_RETURN_IF_ERROR(check_int32_vector(op, "kv_lens", kv_lens, p->batch));
  if (!is_placeholder(query_lens) || p->batch == 0) {
    JAXOPS_RETURN_IF_ERROR(check_int32_vector(op, "query_lens", query_lens, p->batch));
  }
  JAXOPS_RETURN_IF_ERROR(check_scales(op, "key_scales", key_scales, int8_pages, pages));
  JAXOPS_RETURN_IF_ERROR(check_scales(op, "value_scales", value_scales,
                                      int8_pages && !values_in_keys, pages));
  auto od = out.dimensions();
  if (od.size() != 4 || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] ||
      od[3] != value_head_dim) {
    return invalid(op, "out must be [" + str(qd[0]) + ", " + str(qd[1]) + ", " + str(qd[2]) +
                           ", " + str(value_head_dim) + "], got " + dims_string(od));
  }
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "query", query, "out", out));
  auto ld = logsumexp.dimensions();
  if (logsumexp.element_type() != ffi::DataType::F32 || ld.size() != 3 || ld[0] != p->batch ||
      ld[1] != p->num_heads || ld[2] != p->q_len) {
    return invalid(op, "logsumexp must be float32 of shape [" + str(p->batch) + ", " +
                           str(p->num_heads) + ", " + str(p->q_len) + "], got " +
                           dims_string(ld));
  }
  const int64_t workspace_bytes = paged_attention_workspace_bytes(*p, platform);
  auto wd = workspace.dimensions();
  if (workspace.element_type() != ffi::DataType::U8 || wd.size() != 1 || wd[0] != workspace_bytes) {
    return invalid(op, "workspace must be uint8 of shape [" + str(workspace_bytes) + "], got " +
                           dims_string(wd));
  }
  p->scale = scale;
  p->logits_soft_cap = logits_soft_cap;
  p->window_left = window_left;
  p->block_tables = data<const int32_t>(block_tables);
  p->kv_lens = data<const int32_t>(kv_lens);
  p->query_lens = is_placeholder(query_lens) ? nullptr : data<const int32_t>(query_lens);
  p->key_scales = int8_pages ? data<const float>(key_scales) : nullptr;
  p->value_scales = int8_pages && !values_in_keys ? data<const float>(value_scales) : nullptr;
  if (const char* error = params::paged_attention_params_error(*p)) return invalid(op, error);
  return ffi::Error::Success();
}

// -- paged_kv_update ----------------------------------------------------------------

// Every buffer of a paged_kv_update call, decoded into `p`. The results have
// their operands' shapes and dtypes (they are the same buffers when aliased).
inline ffi::Error decode_paged_kv_update(
    const ffi::AnyBuffer& key_pages, const ffi::AnyBuffer& value_pages, const ffi::AnyBuffer& key,
    const ffi::AnyBuffer& value, const ffi::AnyBuffer& slot_mapping,
    const ffi::AnyBuffer& key_scales, const ffi::AnyBuffer& value_scales,
    const ffi::AnyBuffer& key_pages_out, const ffi::AnyBuffer& value_pages_out,
    const ffi::AnyBuffer& key_scales_out, const ffi::AnyBuffer& value_scales_out,
    PagedKvUpdateParams* p) {
  const std::string op = kPagedKvUpdate.name;
  // No value pages (and no value rows): a cache whose values are its keys'.
  const bool values_in_keys = is_placeholder(value_pages);
  int64_t pages[4];
  JAXOPS_RETURN_IF_ERROR(check_pages(op, key_pages, values_in_keys ? key_pages : value_pages,
                                     pages, /*value_dims_free=*/true));
  const bool int8_pages = key_pages.element_type() == ffi::DataType::S8;
  auto kd = key.dimensions();
  if (kd.size() != 3 || kd[1] != pages[2] || kd[2] != pages[3]) {
    return invalid(op, "key must be [num_tokens, " + str(pages[2]) + ", " + str(pages[3]) +
                           "] (the pages' num_kv_heads and head_dim), got " + dims_string(kd));
  }
  const int64_t value_head_dim = values_in_keys ? pages[3] : value_pages.dimensions()[3];
  if (values_in_keys) {
    if (!is_placeholder(value)) {
      return invalid(op, "value must be absent ([0]) without value_pages, got " +
                             dims_string(value.dimensions()));
    }
  } else {
    auto vd = value.dimensions();
    if (vd.size() != 3 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != value_head_dim) {
      return invalid(op, "value must be [" + str(kd[0]) + ", " + str(kd[1]) + ", " +
                             str(value_head_dim) + "] (value_pages' head dim), got " +
                             dims_string(vd));
    }
    JAXOPS_RETURN_IF_ERROR(same_dtype(op, "key", key, "value", value));
  }
  if (int8_pages ? !is_float_dtype(key.element_type())
                 : key.element_type() != key_pages.element_type()) {
    return invalid(op, int8_pages ? "key must be float32, bfloat16 or float16 for int8 pages"
                                  : "key must have the dtype of key_pages");
  }
  p->num_tokens = kd[0];
  p->num_kv_heads = pages[2];
  p->head_dim = pages[3];
  p->value_head_dim = value_head_dim;
  p->values_in_keys = values_in_keys;
  p->num_pages = pages[0];
  p->page_size = pages[1];
  JAXOPS_RETURN_IF_ERROR(check_int32_vector(op, "slot_mapping", slot_mapping, p->num_tokens));
  JAXOPS_RETURN_IF_ERROR(check_scales(op, "key_scales", key_scales, int8_pages, pages));
  JAXOPS_RETURN_IF_ERROR(check_scales(op, "value_scales", value_scales,
                                      int8_pages && !values_in_keys, pages));
  const std::pair<const ffi::AnyBuffer*, const ffi::AnyBuffer*> written[] = {
      {&key_pages, &key_pages_out}, {&value_pages, &value_pages_out},
      {&key_scales, &key_scales_out}, {&value_scales, &value_scales_out}};
  const char* names[] = {"key_pages", "value_pages", "key_scales", "value_scales"};
  for (int i = 0; i < 4; ++i) {
    const std::string result = std::string(names[i]) + " result";
    JAXOPS_RETURN_IF_ERROR(same_dims(op, names[i], *written[i].first, result.c_str(),
                                     *written[i].second));
    JAXOPS_RETURN_IF_ERROR(same_dtype(op, names[i], *written[i].first, result.c_str(),
                                      *written[i].second));
  }
  if (const char* error = params::paged_kv_update_params_error(*p)) return invalid(op, error);
  return ffi::Error::Success();
}

// -- bindings -----------------------------------------------------------------------

template <typename Binding>
auto bind_paged_attention_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // query [B, T, N, H]
      .template Arg<ffi::AnyBuffer>()                      // key_pages [P, page_size, K, H]
      .template Arg<ffi::AnyBuffer>()                      // value_pages [P, page_size, K, Hv] or [0]
      .template Arg<ffi::AnyBuffer>()                      // block_tables int32 [B, M]
      .template Arg<ffi::AnyBuffer>()                      // kv_lens int32 [B]
      .template Arg<ffi::AnyBuffer>()                      // query_lens int32 [B] ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // key_scales f32 [P, page_size, K] or [0]
      .template Arg<ffi::AnyBuffer>()                      // value_scales (or [0])
      .template Ret<ffi::AnyBuffer>()                      // out [B, T, N, Hv]
      .template Ret<ffi::AnyBuffer>()                      // logsumexp f32 [B, N, T]
      .template Ret<ffi::AnyBuffer>();                     // workspace (u8; [0] on the CPU)
}

template <typename Binding>
auto bind_paged_kv_update(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // key_pages [P, page_size, K, H]
      .template Arg<ffi::AnyBuffer>()                      // value_pages [P, page_size, K, Hv] or [0]
      .template Arg<ffi::AnyBuffer>()                      // key [num_tokens, K, H]
      .template Arg<ffi::AnyBuffer>()                      // value [num_tokens, K, Hv] or [0]
      .template Arg<ffi::AnyBuffer>()                      // slot_mapping int32 [num_tokens]
      .template Arg<ffi::AnyBuffer>()                      // key_scales f32 [P, page_size, K] or [0]
      .template Arg<ffi::AnyBuffer>()                      // value_scales
      .template Ret<ffi::AnyBuffer>()                      // key_pages (aliases operand 0)
      .template Ret<ffi::AnyBuffer>()                      // value_pages (operand 1)
      .template Ret<ffi::AnyBuffer>()                      // key_scales (operand 5)
      .template Ret<ffi::AnyBuffer>();                     // value_scales (operand 6)
}

}  // namespace jaxops::paged_attention_common
