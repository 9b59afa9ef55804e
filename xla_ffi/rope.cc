// CPU FFI handler of rotary position embedding: decode and validate, then call
// cpu/rope.
#include <string>

#include "cpu/float_convert.h"
#include "cpu/rope.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;

ffi::Error check_rope_buffers(const std::string& op, const ffi::AnyBuffer& x,
                              const ffi::Buffer<ffi::S32>& positions, const ffi::AnyBuffer& y,
                              const ffi::Buffer<ffi::F32>& workspace, int64_t rotary_dim,
                              cpu::RopeShape* shape) {
  auto dims = x.dimensions();
  if (dims.size() != 4) {
    return invalid(op, "x must have rank 4 [batch, seq, heads, head_dim], got shape " +
                           dims_string(dims));
  }
  *shape = {dims[0], dims[1], dims[2], dims[3], rotary_dim, 0};
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > shape->head_dim) {
    return invalid(op, "rotary_dim=" + std::to_string(rotary_dim) +
                           " must be even and in [2, head_dim=" +
                           std::to_string(shape->head_dim) + "]");
  }
  auto pdims = positions.dimensions();
  if (pdims.size() != 2 || (pdims[0] != 1 && pdims[0] != shape->batch) ||
      pdims[1] != shape->seq) {
    return invalid(op, "positions has shape " + dims_string(pdims) + ", expected [1, " +
                           std::to_string(shape->seq) + "] or [" + std::to_string(shape->batch) +
                           ", " + std::to_string(shape->seq) + "]");
  }
  shape->position_rows = pdims[0];
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "x", x, "y", y));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "x", x, "y", y));
  return element_count_is(op, "workspace", workspace,
                          static_cast<int64_t>(cpu::rope_workspace_floats(*shape)));
}

ffi::Error Rope(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> y,
                ffi::Result<ffi::Buffer<ffi::F32>> workspace, double theta, int64_t rotary_dim,
                bool interleaved, bool inverse) {
  const std::string op = "jaxops_rope";
  cpu::RopeShape shape;
  JAXOPS_RETURN_IF_ERROR(
      check_rope_buffers(op, x, positions, *y, *workspace, rotary_dim, &shape));
  if (!(theta > 0.0)) return invalid(op, "theta must be > 0, got " + std::to_string(theta));
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rope<T>(data<const T>(x), positions.typed_data(), data<T>(*y), workspace->typed_data(),
                 shape, theta, interleaved, inverse);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kRope, Rope,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace
                                  .Attr<double>("theta")
                                  .Attr<int64_t>("rotary_dim")
                                  .Attr<bool>("interleaved")
                                  .Attr<bool>("inverse"));

JAXOPS_REGISTER_FFI_TARGET("jaxops_rope", kRope);

}  // namespace jaxops
