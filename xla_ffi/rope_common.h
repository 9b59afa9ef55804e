// What the CPU and CUDA handlers of rope share: the target's contract, the
// validation of every buffer and attribute, and the FFI binding (`prefix`:
// nothing for the CPU, the stream for CUDA).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "params/rope.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::rope_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

using ::jaxops::params::rope_workspace_dims;
using ::jaxops::params::RopeShape;

inline constexpr contract::Attribute<int64_t> kRotaryDim{"rotary_dim"};

// The cos/sin table of the rows of positions [1 or batch, seq] (operand 1).
inline contract::Workspace rope_workspace(const contract::WorkspaceQuery& call) {
  const auto& positions = call.operand(1);
  RopeShape s{};
  s.position_rows = positions.at(0);
  s.seq = positions.at(1);
  s.rotary_dim = call.attribute(kRotaryDim);
  const auto dims = rope_workspace_dims(s);
  return {{dims.begin(), dims.end()}, "float32"};
}

inline constexpr auto kRope = contract::target_with_workspace(
    "jaxops_rope", rope_workspace, contract::Attribute<double>{"theta"},
    kRotaryDim,
    contract::Attribute<bool>{"interleaved"},  // "gptj" pairs (2i, 2i + 1)
    contract::Attribute<bool>{"inverse"});     // rotate by minus the angle

inline std::vector<contract::TargetDescription> contracts() { return {describe(kRope)}; }

inline ffi::Error check_rope(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& positions,
                             const ffi::AnyBuffer& y, const ffi::Buffer<ffi::F32>& workspace,
                             double theta, int64_t rotary_dim, RopeShape* d) {
  const std::string op = kRope.name;
  auto dims = x.dimensions();
  if (dims.size() != 4) {
    return invalid(op, "x must have rank 4 [batch, seq, heads, head_dim], got shape " +
                           dims_string(dims));
  }
  *d = {dims[0], dims[1], dims[2], dims[3], rotary_dim, 0};
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > d->head_dim) {
    return invalid(op, "rotary_dim=" + std::to_string(rotary_dim) +
                           " must be even and in [2, head_dim=" + std::to_string(d->head_dim) +
                           "]");
  }
  auto pdims = positions.dimensions();
  if (pdims.size() != 2 || (pdims[0] != 1 && pdims[0] != d->batch) || pdims[1] != d->seq) {
    return invalid(op, "positions has shape " + dims_string(pdims) + ", expected [1, " +
                           std::to_string(d->seq) + "] or [" + std::to_string(d->batch) + ", " +
                           std::to_string(d->seq) + "]");
  }
  d->position_rows = pdims[0];
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "x", x, "y", y));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "x", x, "y", y));
  JAXOPS_RETURN_IF_ERROR(dims_are(op, "workspace", workspace, rope_workspace_dims(*d)));
  if (!(theta > 0.0)) return invalid(op, "theta must be > 0, got " + std::to_string(theta));
  return ffi::Error::Success();
}

template <typename Binding>
auto bind_rope(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x [batch, seq, heads, head_dim]
      .template Arg<ffi::Buffer<ffi::S32>>()               // positions [1 or batch, seq]
      .template Ret<ffi::AnyBuffer>()                      // y
      .template Ret<ffi::Buffer<ffi::F32>>();              // workspace: the cos/sin table
}

}  // namespace jaxops::rope_common
