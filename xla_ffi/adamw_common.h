// What the CPU and CUDA handlers of the fused AdamW step share: the target's
// contract, the binding (`prefix`: nothing for the CPU, the stream for CUDA)
// and the validation of every buffer into the leaf table the kernels take.
//
// One call updates every leaf of a model: operands are `scalars` (every
// hyper-parameter, layout params/adamw.h: an operand so that traced ones do
// not recompile), then per leaf grads, params, m, v; results per leaf out, m_out,
// v_out. A leaf's grads, params and out share a shape and dtype (float32,
// bfloat16 or float16); m and m_out (float32, bfloat16 or float16) and v, v_out
// (float32) that shape. The first `decayed_leaves` leaves get the weight
// decay, the others not (the Python side orders them so).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "params/adamw.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::adamw_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::AdamWFloat;
using ::jaxops::params::AdamWLeaf;
using ::jaxops::params::AdamWOptions;

// -- the targets' contract ------------------------------------------------------------

inline constexpr auto kAdamW = contract::target(
    "jaxops_adamw",
    contract::Attribute<bool>{"apply_updates"},      // out: the new params, else the update
    contract::Attribute<bool>{"nesterov"},           // NAdamW's first moment estimate
    contract::Attribute<int64_t>{"decayed_leaves"});  // leaves [0, this) add weight_decay * params

inline std::vector<contract::TargetDescription> contracts() { return {describe(kAdamW)}; }

// Operands and results per leaf (after the scalars operand).
inline constexpr size_t kArgsPerLeaf = 4;
inline constexpr size_t kRetsPerLeaf = 3;

inline bool adamw_float(ffi::DataType dtype, AdamWFloat* out) {
  switch (dtype) {
    case ffi::DataType::F32: *out = AdamWFloat::kFloat32; return true;
    case ffi::DataType::BF16: *out = AdamWFloat::kBFloat16; return true;
    case ffi::DataType::F16: *out = AdamWFloat::kFloat16; return true;
    default: return false;
  }
}

// Leaf i's buffers, checked: its table entry.
inline ffi::Error check_leaf(const std::string& op, size_t i, const ffi::AnyBuffer& grads,
                             const ffi::AnyBuffer& params, const ffi::AnyBuffer& m,
                             const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                             const ffi::AnyBuffer& m_out, const ffi::AnyBuffer& v_out, bool decay,
                             AdamWLeaf* leaf) {
  const std::string at = "[" + std::to_string(i) + "]";
  const std::string n_grads = "grads" + at, n_params = "params" + at, n_m = "m" + at,
                    n_v = "v" + at, n_out = "out" + at, n_m_out = "m_out" + at,
                    n_v_out = "v_out" + at;
  JAXOPS_RETURN_IF_ERROR(same_dims(op, n_params.c_str(), params, n_grads.c_str(), grads));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, n_params.c_str(), params, n_out.c_str(), out));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, n_params.c_str(), params, n_m.c_str(), m));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, n_params.c_str(), params, n_v.c_str(), v));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, n_params.c_str(), params, n_m_out.c_str(), m_out));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, n_params.c_str(), params, n_v_out.c_str(), v_out));
  if (!adamw_float(params.element_type(), &leaf->type)) {
    return invalid(op, n_params + " must be float32, bfloat16 or float16");
  }
  if (!adamw_float(m.element_type(), &leaf->moment)) {
    return invalid(op, n_m + " must be float32, bfloat16 or float16");
  }
  if (v.element_type() != ffi::DataType::F32 || v_out.element_type() != ffi::DataType::F32) {
    return invalid(op, n_v + " and " + n_v_out + " must be float32");
  }
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, n_params.c_str(), params, n_grads.c_str(), grads));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, n_params.c_str(), params, n_out.c_str(), out));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, n_m.c_str(), m, n_m_out.c_str(), m_out));
  leaf->grads = grads.untyped_data();
  leaf->params = params.untyped_data();
  leaf->m = m.untyped_data();
  leaf->v = static_cast<const float*>(v.untyped_data());
  leaf->out = out.untyped_data();
  leaf->m_out = m_out.untyped_data();
  leaf->v_out = static_cast<float*>(v_out.untyped_data());
  leaf->size = static_cast<int64_t>(params.element_count());
  leaf->decay = decay;
  return ffi::Error::Success();
}

// Every leaf's buffers, checked, as the kernels' table (leaves in call order).
inline ffi::Error collect_leaves(const ffi::Buffer<ffi::F32>& scalars, const ffi::RemainingArgs& args,
                                 const ffi::RemainingRets& rets, int64_t decayed_leaves,
                                 std::vector<AdamWLeaf>* leaves) {
  const std::string op = kAdamW.name;
  JAXOPS_RETURN_IF_ERROR(element_count_is(op, "scalars", scalars, params::kAdamWScalarCount));
  const size_t count = args.size() / kArgsPerLeaf;
  if (args.size() % kArgsPerLeaf != 0 || rets.size() != count * kRetsPerLeaf) {
    return invalid(op, "expected 4 operands (grads, params, m, v) and 3 results (out, m_out, "
                       "v_out) per leaf after scalars, got " + std::to_string(args.size()) +
                       " operands and " + std::to_string(rets.size()) + " results");
  }
  if (decayed_leaves < 0 || decayed_leaves > static_cast<int64_t>(count)) {
    return invalid(op, "decayed_leaves is " + std::to_string(decayed_leaves) + ", expected 0.." +
                           std::to_string(count));
  }
  leaves->assign(count, AdamWLeaf{});
  std::vector<ffi::AnyBuffer> in;
  std::vector<ffi::AnyBuffer> out;
  for (size_t i = 0; i < count; ++i) {
    in.clear();
    out.clear();
    for (size_t k = 0; k < kArgsPerLeaf; ++k) {
      auto arg = args.get<ffi::AnyBuffer>(i * kArgsPerLeaf + k);
      if (arg.has_error()) return arg.error();
      in.push_back(*arg);
    }
    for (size_t k = 0; k < kRetsPerLeaf; ++k) {
      auto ret = rets.get<ffi::AnyBuffer>(i * kRetsPerLeaf + k);
      if (ret.has_error()) return ret.error();
      out.push_back(**ret);
    }
    JAXOPS_RETURN_IF_ERROR(check_leaf(op, i, in[0], in[1], in[2], in[3], out[0], out[1], out[2],
                                      static_cast<int64_t>(i) < decayed_leaves, &(*leaves)[i]));
  }
  return ffi::Error::Success();
}

template <typename Binding>
auto bind_adamw(Binding prefix) {
  return std::move(prefix).template Arg<ffi::Buffer<ffi::F32>>()  // scalars (params/adamw.h)
      .RemainingArgs()   // per leaf: grads, params, m, v
      .RemainingRets();  // per leaf: out (the update or the new params), m_out, v_out
}

}  // namespace jaxops::adamw_common
