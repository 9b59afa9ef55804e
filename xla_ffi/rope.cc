// CPU FFI handler of rotary position embedding: validate
// (xla_ffi/rope_common.h), then call cpu/rope.
#include <string>

#include "cpu/float_convert.h"
#include "cpu/rope.h"
#include "xla_ffi/rope_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace rope_common;

ffi::Error Rope(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> y,
                ffi::Result<ffi::Buffer<ffi::F32>> workspace, double theta, int64_t rotary_dim,
                bool interleaved, bool inverse) {
  const std::string op = kRope.name;
  RopeShape d;
  JAXOPS_RETURN_IF_ERROR(check_rope(x, positions, *y, *workspace, theta, rotary_dim, &d));
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rope<T>(data<const T>(x), positions.typed_data(), data<T>(*y), workspace->typed_data(),
                 d, theta, interleaved, inverse);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kRope, kRopeCpu, Rope, bind_rope(ffi::Ffi::Bind()));

}  // namespace jaxops
