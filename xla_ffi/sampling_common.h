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
using ::jaxops::params::SampleShape;

inline constexpr auto kSample = contract::target("jaxops_sample");

inline std::vector<contract::TargetDescription> contracts() { return {describe(kSample)}; }

// A per-row operand or result: [batch].
template <typename Buffer>
inline ffi::Error check_per_row(const std::string& op, const char* name, const Buffer& buffer,
                                int64_t batch) {
  const std::vector<int64_t> expected{batch};
  return dims_are(op, name, buffer, expected);
}

inline ffi::Error check_sample(const ffi::AnyBuffer& logits, const ffi::Buffer<ffi::F32>& uniforms,
                               const ffi::Buffer<ffi::F32>& temperature,
                               const ffi::Buffer<ffi::S32>& top_k,
                               const ffi::Buffer<ffi::F32>& top_p,
                               const ffi::Buffer<ffi::F32>& min_p,
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
  JAXOPS_RETURN_IF_ERROR(check_per_row(op, "uniforms", uniforms, s->batch));
  JAXOPS_RETURN_IF_ERROR(check_per_row(op, "temperature", temperature, s->batch));
  JAXOPS_RETURN_IF_ERROR(check_per_row(op, "top_k", top_k, s->batch));
  JAXOPS_RETURN_IF_ERROR(check_per_row(op, "top_p", top_p, s->batch));
  JAXOPS_RETURN_IF_ERROR(check_per_row(op, "min_p", min_p, s->batch));
  return check_per_row(op, "tokens", tokens, s->batch);
}

template <typename Binding>
auto bind_sample(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // logits [batch, vocab]
      .template Arg<ffi::Buffer<ffi::F32>>()               // uniforms [batch], in [0, 1)
      .template Arg<ffi::Buffer<ffi::F32>>()               // temperature [batch]
      .template Arg<ffi::Buffer<ffi::S32>>()               // top_k [batch]
      .template Arg<ffi::Buffer<ffi::F32>>()               // top_p [batch]
      .template Arg<ffi::Buffer<ffi::F32>>()               // min_p [batch]
      .template Ret<ffi::Buffer<ffi::S32>>();              // tokens [batch]
}

}  // namespace jaxops::sampling_common
