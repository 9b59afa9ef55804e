// What the CPU and CUDA handlers of the router share: the targets' contract,
// the validation of every buffer and attribute, and the FFI bindings (`prefix`:
// nothing for the CPU, the stream for CUDA).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "params/routing.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::routing_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::RouterScore;
using ::jaxops::params::RouterShape;

inline constexpr contract::Attribute<int64_t> kScore{"score"};  // RouterScore
inline constexpr contract::Attribute<bool> kRenormalize{"renormalize"};

inline constexpr auto kTopkRouterFwd = contract::target(
    "jaxops_topk_router_fwd", contract::Attribute<int64_t>{"k"}, kScore, kRenormalize,
    contract::Attribute<int64_t>{"num_groups"}, contract::Attribute<int64_t>{"group_topk"});
inline constexpr auto kTopkRouterJvp =
    contract::target("jaxops_topk_router_jvp", kScore, kRenormalize);
inline constexpr auto kTopkRouterBwd =
    contract::target("jaxops_topk_router_bwd", kScore, kRenormalize);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kTopkRouterFwd), describe(kTopkRouterJvp), describe(kTopkRouterBwd)};
}

// logits [..., experts] in a kernel dtype: the shape's tokens and experts.
inline ffi::Error check_logits(const std::string& op, const ffi::AnyBuffer& logits,
                               RouterShape* s) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "logits", logits, &s->tokens, &s->experts));
  // Expert ids are int32.
  if (s->experts > INT32_MAX) return invalid(op, "logits has more than 2^31 - 1 experts");
  return ffi::Error::Success();
}

// A [..., k] buffer of one value per chosen expert: logits' leading axes, then
// k (taken from the first such buffer when `k` is 0), of dtype `dtype`.
inline ffi::Error check_per_choice(const std::string& op, const char* name,
                                   const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& logits,
                                   ffi::DataType dtype, const char* dtype_name, int64_t* k) {
  auto dims = buffer.dimensions();
  auto logit_dims = logits.dimensions();
  bool ok = dims.size() == logit_dims.size();
  for (size_t i = 0; ok && i + 1 < dims.size(); ++i) ok = dims[i] == logit_dims[i];
  if (ok && *k == 0) *k = dims.back();
  if (!ok || dims.back() != *k || *k < 1 || *k > logit_dims.back()) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) +
                           ", expected logits' leading axes " + dims_string(logit_dims) +
                           " then k in [1, experts]" + (*k ? " = " + std::to_string(*k) : ""));
  }
  if (buffer.element_type() != dtype) {
    return invalid(op, std::string(name) + " must have dtype " + dtype_name);
  }
  return ffi::Error::Success();
}

// Also the fields only the selection reads: the derivatives take the experts
// as chosen, so they see no group limit.
inline ffi::Error check_score(const std::string& op, int64_t score, bool renormalize,
                              RouterShape* s) {
  s->num_groups = 1;
  s->group_topk = 1;
  if (score != static_cast<int64_t>(RouterScore::kSoftmax) &&
      score != static_cast<int64_t>(RouterScore::kSigmoid)) {
    return invalid(op, "score must be 0 (softmax) or 1 (sigmoid), got " + std::to_string(score));
  }
  s->score = static_cast<RouterScore>(score);
  s->renormalize = renormalize;
  return ffi::Error::Success();
}

inline ffi::Error check_topk_router_fwd(const ffi::AnyBuffer& logits,
                                        const ffi::AnyBuffer& expert_bias,
                                        const ffi::AnyBuffer& weights,
                                        const ffi::AnyBuffer& experts, int64_t k, int64_t score,
                                        bool renormalize, int64_t num_groups, int64_t group_topk,
                                        RouterShape* s) {
  const std::string op = kTopkRouterFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_logits(op, logits, s));
  JAXOPS_RETURN_IF_ERROR(check_score(op, score, renormalize, s));
  if (!is_placeholder(expert_bias)) {
    const std::vector<int64_t> bias_dims{s->experts};
    JAXOPS_RETURN_IF_ERROR(dims_are(op, "expert_bias", expert_bias, bias_dims));
    if (expert_bias.element_type() != ffi::DataType::F32) {
      return invalid(op, "expert_bias must have dtype float32");
    }
  }
  if (num_groups < 1 || s->experts % num_groups != 0) {
    return invalid(op, "num_groups=" + std::to_string(num_groups) + " must divide experts=" +
                           std::to_string(s->experts));
  }
  if (group_topk < 1 || group_topk > num_groups) {
    return invalid(op, "group_topk=" + std::to_string(group_topk) + " must be in [1, num_groups=" +
                           std::to_string(num_groups) + "]");
  }
  const int64_t eligible = group_topk * (s->experts / num_groups);
  if (k < 1 || k > eligible) {
    return invalid(op, "k=" + std::to_string(k) + " must be in [1, " + std::to_string(eligible) +
                           "] (the experts of the group_topk kept groups)");
  }
  s->k = k;
  s->num_groups = num_groups;
  s->group_topk = group_topk;
  JAXOPS_RETURN_IF_ERROR(
      check_per_choice(op, "weights", weights, logits, ffi::DataType::F32, "float32", &s->k));
  return check_per_choice(op, "experts", experts, logits, ffi::DataType::S32, "int32", &s->k);
}

// The tangent and the backward take the same buffers (the logits, the chosen
// experts, a logits-shaped dlogits and a float32 per-choice dweights), one as
// input and the other as result: one check serves both targets.
inline ffi::Error check_topk_router_derivative(const std::string& op,
                                               const ffi::AnyBuffer& logits,
                                               const ffi::AnyBuffer& experts,
                                               const ffi::AnyBuffer& dlogits,
                                               const ffi::AnyBuffer& dweights, int64_t score,
                                               bool renormalize, RouterShape* s) {
  *s = {};
  JAXOPS_RETURN_IF_ERROR(check_logits(op, logits, s));
  JAXOPS_RETURN_IF_ERROR(check_score(op, score, renormalize, s));
  JAXOPS_RETURN_IF_ERROR(
      check_per_choice(op, "experts", experts, logits, ffi::DataType::S32, "int32", &s->k));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "logits", logits, "dlogits", dlogits));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "logits", logits, "dlogits", dlogits));
  return check_per_choice(op, "dweights", dweights, logits, ffi::DataType::F32, "float32", &s->k);
}

template <typename Binding>
auto bind_topk_router_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits [..., experts]
      .template Arg<ffi::AnyBuffer>()                      // expert_bias [experts] f32 ([0]: none)
      .template Ret<ffi::AnyBuffer>()                      // weights [..., k] f32
      .template Ret<ffi::AnyBuffer>();                     // experts [..., k] s32
}

template <typename Binding>
auto bind_topk_router_jvp(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits
      .template Arg<ffi::AnyBuffer>()                      // experts [..., k] s32
      .template Arg<ffi::AnyBuffer>()                      // dlogits
      .template Ret<ffi::AnyBuffer>();                     // dweights [..., k] f32
}

template <typename Binding>
auto bind_topk_router_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dweights [..., k] f32
      .template Arg<ffi::AnyBuffer>()                      // logits
      .template Arg<ffi::AnyBuffer>()                      // experts [..., k] s32
      .template Ret<ffi::AnyBuffer>();                     // dlogits
}

}  // namespace jaxops::routing_common
