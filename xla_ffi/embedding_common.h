// What the CPU and CUDA handlers of the embedding share: the validation of
// every buffer and the FFI bindings (`prefix`: nothing for the CPU, the stream
// for CUDA). ids come flattened to any shape; the looked-up rows have shape
// ids.shape + [dim].
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "params/embedding.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::embedding_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

using ::jaxops::params::embedding_bwd_cuda_workspace_ints;
using ::jaxops::params::embedding_bwd_workspace_ints;
using ::jaxops::params::EmbeddingShape;

// -- the targets' contract ------------------------------------------------------------

inline constexpr contract::Attribute<int64_t> kVocab{"vocab"};

// int32s of the backward's sort workspace on `platform`.
inline int64_t embedding_bwd_workspace_size(const EmbeddingShape& s, contract::Platform platform) {
  return platform == contract::Platform::kCuda ? embedding_bwd_cuda_workspace_ints(s)
                                               : embedding_bwd_workspace_ints(s);
}

// The backward's sort workspace for ids (operand 1) and the vocab attribute.
inline contract::Workspace embedding_bwd_workspace(const contract::WorkspaceQuery& call) {
  EmbeddingShape s{};
  s.vocab = call.attribute(kVocab);
  s.tokens = 1;
  for (int64_t d : call.operand(1)) s.tokens *= d;
  return {{embedding_bwd_workspace_size(s, call.platform)}, "int32"};
}

inline constexpr auto kEmbeddingFwd = contract::target("jaxops_embedding_fwd");
inline constexpr auto kEmbeddingBwd =
    contract::target_with_workspace("jaxops_embedding_bwd", embedding_bwd_workspace, kVocab);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kEmbeddingFwd), describe(kEmbeddingBwd)};
}

// `rows` has shape ids.shape + [dim].
inline ffi::Error check_rows(const std::string& op, const char* name, const ffi::AnyBuffer& rows,
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

inline ffi::Error check_table_and_ids(const std::string& op, const char* table_name,
                                      const ffi::AnyBuffer& table,
                                      const ffi::Buffer<ffi::S32>& ids, EmbeddingShape* d) {
  auto dims = table.dimensions();
  if (dims.size() != 2 || dims[0] < 1) {
    return invalid(op, std::string(table_name) + " must be [vocab >= 1, dim], got shape " +
                           dims_string(dims));
  }
  d->vocab = dims[0];
  d->dim = dims[1];
  d->tokens = static_cast<int64_t>(ids.element_count());
  if (d->tokens > std::numeric_limits<int32_t>::max() ||
      d->vocab >= std::numeric_limits<int32_t>::max()) {
    return invalid(op, "more than 2^31 - 1 ids or table rows");
  }
  return ffi::Error::Success();
}

inline ffi::Error check_embedding_fwd(const ffi::AnyBuffer& table,
                                      const ffi::Buffer<ffi::S32>& ids, const ffi::AnyBuffer& out,
                                      EmbeddingShape* d) {
  const std::string op = kEmbeddingFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_table_and_ids(op, "table", table, ids, d));
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "out", out, ids, d->dim));
  return same_dtype(op, "table", table, "out", out);
}

inline ffi::Error check_embedding_bwd(const ffi::AnyBuffer& dout,
                                      const ffi::Buffer<ffi::S32>& ids,
                                      const ffi::AnyBuffer& dtable,
                                      const ffi::Buffer<ffi::S32>& workspace, int64_t vocab,
                                      contract::Platform platform, EmbeddingShape* d) {
  const std::string op = kEmbeddingBwd.name;
  JAXOPS_RETURN_IF_ERROR(check_table_and_ids(op, "dtable", dtable, ids, d));
  if (d->vocab != vocab) {
    return invalid(op, "dtable has " + std::to_string(d->vocab) + " rows, expected vocab=" +
                           std::to_string(vocab));
  }
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "dout", dout, ids, d->dim));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "dout", dout, "dtable", dtable));
  return element_count_is(op, "workspace", workspace,
                          embedding_bwd_workspace_size(*d, platform));
}

template <typename Binding>
auto bind_embedding_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // table [vocab, dim]
      .template Arg<ffi::Buffer<ffi::S32>>()               // ids
      .template Ret<ffi::AnyBuffer>();                     // out: ids.shape + [dim]
}

template <typename Binding>
auto bind_embedding_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dout: ids.shape + [dim]
      .template Arg<ffi::Buffer<ffi::S32>>()               // ids
      .template Ret<ffi::AnyBuffer>()                      // dtable [vocab, dim]
      .template Ret<ffi::Buffer<ffi::S32>>();              // workspace
}

}  // namespace jaxops::embedding_common
