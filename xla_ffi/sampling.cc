// CPU FFI handler of sampling: validate (xla_ffi/sampling_common.h), then call
// cpu/sampling.
#include <string>

#include "cpu/float_convert.h"
#include "cpu/sampling.h"
#include "xla_ffi/sampling_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace sampling_common;

ffi::Error Sample(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> row_floats,
                  ffi::Buffer<ffi::S32> top_k, ffi::Result<ffi::Buffer<ffi::S32>> tokens) {
  const std::string op = kSample.name;
  SampleShape s;
  JAXOPS_RETURN_IF_ERROR(check_sample(logits, row_floats, top_k, *tokens, &s));
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::sample<T>(data<const T>(logits), row_floats.typed_data(), top_k.typed_data(),
                   tokens->typed_data(), s);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kSample, kSampleCpu, Sample, bind_sample(ffi::Ffi::Bind()));

}  // namespace jaxops
