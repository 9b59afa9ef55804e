// CPU FFI handlers of the embedding lookup and its gradient: decode and
// validate, then call cpu/embedding. ids come flattened to any shape; the
// looked-up rows have shape ids.shape + [dim].
#include <limits>
#include <string>

#include "cpu/embedding.h"
#include "cpu/float_convert.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/registry.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;

template <typename Fn>
ffi::Error dispatch(const std::string& op, ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<float, cpu::bfloat16, cpu::float16>(op, dtype, std::forward<Fn>(fn));
}

// `rows` has shape ids.shape + [dim].
ffi::Error check_rows(const std::string& op, const char* name, const ffi::AnyBuffer& rows,
                      const ffi::Buffer<ffi::S32>& ids, int64_t dim) {
  auto dims = rows.dimensions(), id_dims = ids.dimensions();
  bool ok = dims.size() == id_dims.size() + 1 && dims.back() == dim;
  for (size_t i = 0; ok && i < id_dims.size(); ++i) ok = dims[i] == id_dims[i];
  if (!ok) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) +
                           ", expected ids' shape " + dims_string(id_dims) + " + [" +
                           std::to_string(dim) + "]");
  }
  return ffi::Error::Success();
}

ffi::Error check_table(const std::string& op, const char* name, const ffi::AnyBuffer& table,
                       cpu::EmbeddingShape* shape) {
  auto dims = table.dimensions();
  if (dims.size() != 2 || dims[0] < 1) {
    return invalid(op, std::string(name) + " must be [vocab >= 1, dim], got shape " +
                           dims_string(dims));
  }
  shape->vocab = dims[0];
  shape->dim = dims[1];
  return ffi::Error::Success();
}

ffi::Error check_tokens(const std::string& op, const ffi::Buffer<ffi::S32>& ids,
                        cpu::EmbeddingShape* shape) {
  shape->tokens = static_cast<int64_t>(ids.element_count());
  if (shape->tokens > std::numeric_limits<int32_t>::max()) {
    return invalid(op, "more than 2^31 - 1 ids");
  }
  return ffi::Error::Success();
}

ffi::Error EmbeddingFwd(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> out) {
  const std::string op = "jaxops_embedding_fwd";
  cpu::EmbeddingShape shape;
  JAXOPS_RETURN_IF_ERROR(check_table(op, "table", table, &shape));
  JAXOPS_RETURN_IF_ERROR(check_tokens(op, ids, &shape));
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "out", *out, ids, shape.dim));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "table", table, "out", *out));
  return dispatch(op, table.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::embedding_fwd<T>(data<const T>(table), ids.typed_data(), data<T>(*out), shape);
    return ffi::Error::Success();
  });
}

ffi::Error EmbeddingBwd(ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> dtable,
                        ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  const std::string op = "jaxops_embedding_bwd";
  cpu::EmbeddingShape shape;
  JAXOPS_RETURN_IF_ERROR(check_table(op, "dtable", *dtable, &shape));
  JAXOPS_RETURN_IF_ERROR(check_tokens(op, ids, &shape));
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "dout", dout, ids, shape.dim));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "dout", dout, "dtable", *dtable));
  JAXOPS_RETURN_IF_ERROR(element_count_is(
      op, "workspace", *workspace,
      static_cast<int64_t>(cpu::embedding_bwd_workspace_ints(shape))));
  return dispatch(op, dout.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::embedding_bwd<T>(data<const T>(dout), ids.typed_data(), data<T>(*dtable),
                          workspace->typed_data(), shape);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kEmbeddingFwd, EmbeddingFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids
                                  .Ret<ffi::AnyBuffer>());        // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(kEmbeddingBwd, EmbeddingBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // dout
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids
                                  .Ret<ffi::AnyBuffer>()          // dtable
                                  .Ret<ffi::Buffer<ffi::S32>>()); // workspace

JAXOPS_REGISTER_FFI_TARGET("jaxops_embedding_fwd", kEmbeddingFwd);
JAXOPS_REGISTER_FFI_TARGET("jaxops_embedding_bwd", kEmbeddingBwd);

}  // namespace jaxops
