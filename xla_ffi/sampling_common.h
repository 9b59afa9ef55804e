// What the CPU and CUDA handlers of sampling share: the target's contract,
// the validation of every buffer and the FFI binding (`prefix`: nothing for
// the CPU, the stream for CUDA). Every per-row parameter is an operand, so
// the target has no attributes: new values never recompile.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "params/sampling.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::sampling_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
namespace params = ::jaxops::params;
using params::SampleShape;

inline constexpr auto kSample = contract::target("jaxops_sample");

inline std::vector<contract::TargetDescription> contracts() { return {describe(kSample)}; }

inline ffi::Error check_sample(const ffi::AnyBuffer& logits,
                               const ffi::Buffer<ffi::F32>& row_floats,
                               const ffi::Buffer<ffi::S32>& top_k,
                               const ffi::Buffer<ffi::S32>& tokens, SampleShape* s) {
  const std::string op = kSample.name;
  auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] < 1) {
    return invalid(op, "logits must be [batch, vocab >= 1], got shape " + dims_string(dims));
  }
  s->batch = dims[0];
  s->vocab = dims[1];
  if (s->vocab > std::numeric_limits<int32_t>::max()) {
    return invalid(op, "a vocabulary of more than 2^31 - 1 tokens");
  }
  const std::vector<int64_t> per_row{s->batch}, floats{s->batch, params::kRowFloats};
  JAXOPS_RETURN_IF_ERROR(dims_are(op, "row_floats", row_floats, floats));
  JAXOPS_RETURN_IF_ERROR(dims_are(op, "top_k", top_k, per_row));
  return dims_are(op, "tokens", tokens, per_row);
}

template <typename Binding>
auto bind_sample(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits [batch, vocab]
      .template Arg<ffi::Buffer<ffi::F32>>()  // row_floats [batch, kRowFloats]: uniform, temperature, top_p, min_p
      .template Arg<ffi::Buffer<ffi::S32>>()               // top_k [batch]
      .template Ret<ffi::Buffer<ffi::S32>>();              // tokens [batch]
}

}  // namespace jaxops::sampling_common
