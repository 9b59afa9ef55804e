// What the CPU and CUDA handlers of the 2:4 sparse linear layer share: the
// targets' contract, the validation of every buffer against the packed layout
// (params/sparse.h) and the FFI bindings (`prefix`: nothing for the CPU, the
// stream for CUDA). x and dy have any leading axes (the rows); the packed
// weight is values [out, in / 2] and metadata uint8 [out, ceil(in / 8)].
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "params/sparse.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/matmul_precision.h"

namespace jaxops::sparse_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;

using ::jaxops::params::sparse_metadata_cols;
using ::jaxops::params::sparse_values_cols;
using ::jaxops::params::SparseLinearShape;

// -- the targets' contract ------------------------------------------------------------

using matmul_precision::kAllowTf32;
inline constexpr auto kSparseLinearFwd = contract::target("jaxops_sparse_linear_fwd", kAllowTf32);
inline constexpr auto kSparseLinearDx = contract::target("jaxops_sparse_linear_dx", kAllowTf32);
inline constexpr auto kSparseLinearDvalues =
    contract::target("jaxops_sparse_linear_dvalues", kAllowTf32);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kSparseLinearFwd), describe(kSparseLinearDx), describe(kSparseLinearDvalues)};
}

// in and out from the packed weight; values must be [out, in / 2] with in a
// multiple of 4, metadata [out, ceil(in / 8)] uint8, and both of rank 2.
inline ffi::Error check_packed(const std::string& op, const ffi::AnyBuffer& values,
                               const ffi::Buffer<ffi::U8>& metadata, SparseLinearShape* s) {
  auto dims = values.dimensions();
  if (dims.size() != 2 || dims[1] % 2 != 0) {
    return invalid(op, "values must be [out, in / 2] with in a multiple of 4, got shape " +
                           dims_string(dims));
  }
  s->out = dims[0];
  s->in = 2 * dims[1];
  const std::vector<int64_t> expected{s->out, sparse_metadata_cols(s->in)};
  return dims_are(op, "metadata", metadata, expected);
}

// `a` is [rows..., cols]: sets *rows; cols must be `cols`.
inline ffi::Error check_rows_of(const std::string& op, const char* name, const ffi::AnyBuffer& a,
                                int64_t cols, int64_t* rows) {
  auto dims = a.dimensions();
  if (dims.size() < 1 || dims.back() != cols) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) +
                           ", expected [..., " + std::to_string(cols) + "]");
  }
  *rows = product(dims, 0, dims.size() - 1);
  return ffi::Error::Success();
}

// `b` is [leading axes of `a`..., cols].
inline ffi::Error check_rows_like(const std::string& op, const char* a_name,
                                  const ffi::AnyBuffer& a, const char* b_name,
                                  const ffi::AnyBuffer& b, int64_t cols) {
  auto da = a.dimensions(), db = b.dimensions();
  bool ok = da.size() == db.size() && db.size() >= 1 && db.back() == cols;
  for (size_t i = 0; ok && i + 1 < da.size(); ++i) ok = da[i] == db[i];
  if (!ok) {
    return invalid(op, std::string(b_name) + " has shape " + dims_string(db) + ", expected " +
                           a_name + "'s leading axes " + dims_string(da) + " with last axis " +
                           std::to_string(cols));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_sparse_linear_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& values,
                                          const ffi::Buffer<ffi::U8>& metadata,
                                          const ffi::AnyBuffer& bias, const ffi::AnyBuffer& y,
                                          SparseLinearShape* s) {
  const std::string op = kSparseLinearFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_packed(op, values, metadata, s));
  JAXOPS_RETURN_IF_ERROR(check_rows_of(op, "x", x, s->in, &s->rows));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "x", x, "values", values));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "x", x, "y", y));
  if (!is_placeholder(bias)) {
    JAXOPS_RETURN_IF_ERROR(dims_are(op, "bias", bias, std::vector<int64_t>{s->out}));
    JAXOPS_RETURN_IF_ERROR(same_dtype(op, "x", x, "bias", bias));
  }
  return check_rows_like(op, "x", x, "y", y, s->out);
}

inline ffi::Error check_sparse_linear_dx(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& values,
                                         const ffi::Buffer<ffi::U8>& metadata,
                                         const ffi::AnyBuffer& dx, SparseLinearShape* s) {
  const std::string op = kSparseLinearDx.name;
  JAXOPS_RETURN_IF_ERROR(check_packed(op, values, metadata, s));
  JAXOPS_RETURN_IF_ERROR(check_rows_of(op, "dy", dy, s->out, &s->rows));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "dy", dy, "values", values));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "dy", dy, "dx", dx));
  return check_rows_like(op, "dy", dy, "dx", dx, s->in);
}

inline ffi::Error check_sparse_linear_dvalues(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                              const ffi::Buffer<ffi::U8>& metadata,
                                              const ffi::AnyBuffer& dvalues,
                                              SparseLinearShape* s) {
  const std::string op = kSparseLinearDvalues.name;
  JAXOPS_RETURN_IF_ERROR(check_packed(op, dvalues, metadata, s));
  JAXOPS_RETURN_IF_ERROR(check_rows_of(op, "dy", dy, s->out, &s->rows));
  JAXOPS_RETURN_IF_ERROR(check_rows_like(op, "dy", dy, "x", x, s->in));
  JAXOPS_RETURN_IF_ERROR(same_dtype(op, "dy", dy, "x", x));
  return same_dtype(op, "dy", dy, "dvalues", dvalues);
}

template <typename Binding>
auto bind_sparse_linear_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x [..., in]
      .template Arg<ffi::AnyBuffer>()                      // values [out, in / 2]
      .template Arg<ffi::Buffer<ffi::U8>>()                // metadata [out, ceil(in / 8)]
      .template Arg<ffi::AnyBuffer>()                      // bias [out] or [0] (absent)
      .template Ret<ffi::AnyBuffer>();                     // y [..., out]
}

template <typename Binding>
auto bind_sparse_linear_dx(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dy [..., out]
      .template Arg<ffi::AnyBuffer>()                      // values
      .template Arg<ffi::Buffer<ffi::U8>>()                // metadata
      .template Ret<ffi::AnyBuffer>();                     // dx [..., in]
}

template <typename Binding>
auto bind_sparse_linear_dvalues(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dy [..., out]
      .template Arg<ffi::AnyBuffer>()                      // x [..., in]
      .template Arg<ffi::Buffer<ffi::U8>>()                // metadata
      .template Ret<ffi::AnyBuffer>();                     // dvalues [out, in / 2]
}

}  // namespace jaxops::sparse_common
