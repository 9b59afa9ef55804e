// CPU FFI handlers of the embedding lookup and its gradient: validate
// (xla_ffi/embedding_common.h), then call cpu/embedding.
#include <string>

#include "cpu/embedding.h"
#include "cpu/float_convert.h"
#include "xla_ffi/embedding_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace embedding_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

ffi::Error EmbeddingFwd(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> out) {
  const std::string op = kEmbeddingFwd.name;
  EmbeddingShape d;
  JAXOPS_RETURN_IF_ERROR(check_embedding_fwd(table, ids, *out, &d));
  return dispatch(op, table.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::embedding_fwd<T>(data<const T>(table), ids.typed_data(), data<T>(*out),
                          d);
    return ffi::Error::Success();
  });
}

ffi::Error EmbeddingBwd(ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> dtable,
                        ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t vocab) {
  const std::string op = kEmbeddingBwd.name;
  EmbeddingShape d;
  JAXOPS_RETURN_IF_ERROR(check_embedding_bwd(dout, ids, *dtable, *workspace, vocab,
                                             contract::Platform::kCpu, &d));
  return dispatch(op, dout.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::embedding_bwd<T>(data<const T>(dout), ids.typed_data(), data<T>(*dtable),
                          workspace->typed_data(), d);
    return ffi::Error::Success();
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kEmbeddingFwd, kEmbeddingFwdCpu, EmbeddingFwd,
                  bind_embedding_fwd(ffi::Ffi::Bind()));
JAXOPS_FFI_TARGET(kEmbeddingBwd, kEmbeddingBwdCpu, EmbeddingBwd,
                  bind_embedding_bwd(ffi::Ffi::Bind()));

}  // namespace jaxops
