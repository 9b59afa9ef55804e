// What the CPU and CUDA handlers of the norms share, so the two platforms bind
// the same signatures and accept exactly the same calls: the FFI bindings (each
// takes the platform's binding prefix: nothing for the CPU, the stream for CUDA)
// and the validation of every buffer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "params/norms.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::norms_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::NormShape;
using ::jaxops::params::WeightGradLayout;

// -- the targets' contract ------------------------------------------------------------

inline constexpr contract::Attribute<float> kEpsilon{"epsilon"};
// Rows are split into `groups` equal groups, one weight gradient each (vmap).
inline constexpr contract::Attribute<int64_t> kGroups{"groups"};

// Column sums each workspace part holds: layer_norm's dweight and dbias terms,
// rms_norm's dweight term.
inline constexpr int64_t kLayerNormWorkspaceSums = 2;
inline constexpr int64_t kRmsNormWorkspaceSums = 1;

// How many pieces the backward reduces a group's weight gradient in, at most:
// about what the platform runs at once (the CPU's threads, the GPU's blocks).
// Any count is correct and the sums are deterministic for each.
inline int64_t weight_grad_tasks(contract::Platform platform) {
  return platform == contract::Platform::kCuda ? 256 : 32;
}

// The backward's workspace [groups * parts, sums, cols] for x (operand 1).
template <int64_t kSums>
contract::Workspace weight_grad_workspace(const contract::WorkspaceQuery& call) {
  const auto& x = call.operand(1);
  const int64_t groups = call.attribute(kGroups);
  if (x.empty() || groups < 1) throw std::invalid_argument("norm workspace: bad x or groups");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) rows *= x[i];
  const int64_t parts =
      std::max<int64_t>(1, std::min(rows / groups, weight_grad_tasks(call.platform) / groups));
  return {{groups * parts, kSums, x.back()}, "float32"};
}

inline constexpr auto kLayerNormFwd = contract::target("jaxops_layer_norm_fwd", kEpsilon);
inline constexpr auto kLayerNormBwd = contract::target_with_workspace(
    "jaxops_layer_norm_bwd", weight_grad_workspace<kLayerNormWorkspaceSums>, kGroups);
inline constexpr auto kRmsNormFwd = contract::target("jaxops_rms_norm_fwd", kEpsilon);
inline constexpr auto kRmsNormBwd = contract::target_with_workspace(
    "jaxops_rms_norm_bwd", weight_grad_workspace<kRmsNormWorkspaceSums>, kGroups);
inline constexpr auto kAddRmsNormFwd = contract::target("jaxops_add_rms_norm_fwd", kEpsilon);
inline constexpr auto kLayerNormJvp = contract::target("jaxops_layer_norm_jvp");
inline constexpr auto kRmsNormJvp = contract::target("jaxops_rms_norm_jvp");

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kLayerNormFwd), describe(kLayerNormBwd), describe(kRmsNormFwd),
          describe(kRmsNormBwd),   describe(kAddRmsNormFwd), describe(kLayerNormJvp),
          describe(kRmsNormJvp)};
}

// -- validation -----------------------------------------------------------------------

// x and an output shaped like it, and an optional per-column parameter
// (weight or bias: absent when it has no elements).
inline ffi::Error check_row_major_io(const std::string& op, const ffi::AnyBuffer& x,
                                     const ffi::AnyBuffer& y, const char* y_name,
                                     NormShape* shape) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, "x", x, &shape->rows, &shape->cols));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, "x", x, y_name, y));
  return same_dtype(op, "x", x, y_name, y);
}

inline ffi::Error check_column_param(const std::string& op, const char* name,
                                     const ffi::AnyBuffer& param, const ffi::AnyBuffer& x,
                                     int64_t cols) {
  if (param.dimensions().size() != 1 ||
      (param.element_count() != 0 && static_cast<int64_t>(param.element_count()) != cols)) {
    return invalid(op, std::string(name) + " has shape " + dims_string(param.dimensions()) +
                           ", expected [" + std::to_string(cols) + "] or [0] (absent)");
  }
  return same_dtype(op, "x", x, name, param);
}

inline ffi::Error check_row_stat(const std::string& op, const char* name,
                                 const ffi::Buffer<ffi::F32>& stat, int64_t rows) {
  return element_count_is(op, name, stat, rows);
}

// A weight gradient [groups, cols] (or [groups, 0] when the parameter is absent).
inline ffi::Error check_weight_grad(const std::string& op, const char* name,
                                    const ffi::AnyBuffer& grad, const ffi::AnyBuffer& param,
                                    int64_t groups, int64_t cols) {
  auto dims = grad.dimensions();
  const int64_t expected_cols = param.element_count() == 0 ? 0 : cols;
  if (dims.size() != 2 || dims[0] != groups || dims[1] != expected_cols) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) + ", expected [" +
                           std::to_string(groups) + ", " + std::to_string(expected_cols) + "]");
  }
  return same_dtype(op, "x", param, name, grad);
}

// The groups attribute and the workspace [groups * parts, sums, cols], which
// give the backward's weight-gradient layout (its parts: the workspace's rows).
inline ffi::Error check_groups_and_workspace(const std::string& op, int64_t groups,
                                             NormShape shape,
                                             const ffi::Buffer<ffi::F32>& workspace, int64_t sums,
                                             WeightGradLayout* layout) {
  if (groups < 1 || shape.rows % groups != 0) {
    return invalid(op, "groups=" + std::to_string(groups) + " must be >= 1 and divide the " +
                           std::to_string(shape.rows) + " rows");
  }
  auto dims = workspace.dimensions();
  if (dims.size() != 3 || dims[0] < groups || dims[0] % groups != 0 || dims[1] != sums ||
      dims[2] != shape.cols) {
    return invalid(op, "workspace has shape " + dims_string(dims) + ", expected [groups * parts, " +
                           std::to_string(sums) + ", " + std::to_string(shape.cols) + "]");
  }
  *layout = {groups, dims[0] / groups};
  return ffi::Error::Success();
}

// -- whole-call validation, one per handler ------------------------------------------

inline ffi::Error check_layer_norm_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                       const ffi::AnyBuffer& bias, const ffi::AnyBuffer& y,
                                       const ffi::Buffer<ffi::F32>& mean,
                                       const ffi::Buffer<ffi::F32>& rstd, NormShape* s) {
  const std::string op = kLayerNormFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, y, "y", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "bias", bias, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "mean", mean, s->rows));
  return check_row_stat(op, "rstd", rstd, s->rows);
}

inline ffi::Error check_layer_norm_bwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                       const ffi::AnyBuffer& weight, const ffi::AnyBuffer& bias,
                                       const ffi::Buffer<ffi::F32>& mean,
                                       const ffi::Buffer<ffi::F32>& rstd, const ffi::AnyBuffer& dx,
                                       const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dbias,
                                       const ffi::Buffer<ffi::F32>& workspace, int64_t groups,
                                       NormShape* s, WeightGradLayout* layout) {
  const std::string op = kLayerNormBwd.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dx, "dx", s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "bias", bias, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "mean", mean, s->rows));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", rstd, s->rows));
  JAXOPS_RETURN_IF_ERROR(check_groups_and_workspace(op, groups, *s, workspace, kLayerNormWorkspaceSums, layout));
  JAXOPS_RETURN_IF_ERROR(check_weight_grad(op, "dweight", dweight, weight, groups, s->cols));
  return check_weight_grad(op, "dbias", dbias, bias, groups, s->cols);
}

inline ffi::Error check_rms_norm_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                     const ffi::AnyBuffer& y, const ffi::Buffer<ffi::F32>& rstd,
                                     NormShape* s) {
  const std::string op = kRmsNormFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, y, "y", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  return check_row_stat(op, "rstd", rstd, s->rows);
}

inline ffi::Error check_rms_norm_bwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                     const ffi::AnyBuffer& weight,
                                     const ffi::Buffer<ffi::F32>& rstd,
                                     const ffi::AnyBuffer& dresidual, const ffi::AnyBuffer& dx,
                                     const ffi::AnyBuffer& dweight,
                                     const ffi::Buffer<ffi::F32>& workspace, int64_t groups,
                                     NormShape* s, WeightGradLayout* layout) {
  const std::string op = kRmsNormBwd.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dx, "dx", s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", rstd, s->rows));
  if (dresidual.element_count() != 0) {
    JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dresidual, "dresidual", s));
  }
  JAXOPS_RETURN_IF_ERROR(check_groups_and_workspace(op, groups, *s, workspace, kRmsNormWorkspaceSums, layout));
  return check_weight_grad(op, "dweight", dweight, weight, groups, s->cols);
}

inline ffi::Error check_add_rms_norm_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& residual,
                                         const ffi::AnyBuffer& weight, const ffi::AnyBuffer& y,
                                         const ffi::AnyBuffer& h,
                                         const ffi::Buffer<ffi::F32>& rstd, NormShape* s) {
  const std::string op = kAddRmsNormFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, y, "y", s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, residual, "residual", s));
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, h, "h", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  return check_row_stat(op, "rstd", rstd, s->rows);
}

inline ffi::Error check_layer_norm_jvp(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                       const ffi::Buffer<ffi::F32>& mean,
                                       const ffi::Buffer<ffi::F32>& rstd, const ffi::AnyBuffer& dx,
                                       const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dbias,
                                       const ffi::AnyBuffer& dy, NormShape* s) {
  const std::string op = kLayerNormJvp.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "mean", mean, s->rows));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", rstd, s->rows));
  JAXOPS_RETURN_IF_ERROR(check_optional_like(op, "x", x, "dx", dx));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "dweight", dweight, x, s->cols));
  return check_column_param(op, "dbias", dbias, x, s->cols);
}

inline ffi::Error check_rms_norm_jvp(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                     const ffi::Buffer<ffi::F32>& rstd, const ffi::AnyBuffer& dx,
                                     const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dy,
                                     NormShape* s) {
  const std::string op = kRmsNormJvp.name;
  JAXOPS_RETURN_IF_ERROR(check_row_major_io(op, x, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_column_param(op, "weight", weight, x, s->cols));
  JAXOPS_RETURN_IF_ERROR(check_row_stat(op, "rstd", rstd, s->rows));
  JAXOPS_RETURN_IF_ERROR(check_optional_like(op, "x", x, "dx", dx));
  return check_column_param(op, "dweight", dweight, x, s->cols);
}

// -- bindings: `prefix` is ffi::Ffi::Bind(), with the stream context on CUDA ----------

template <typename Binding>
auto bind_layer_norm_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // x
      .template Arg<ffi::AnyBuffer>()                    // weight ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                    // bias ([0]: absent)
      .template Ret<ffi::AnyBuffer>()                    // y
      .template Ret<ffi::Buffer<ffi::F32>>()             // mean
      .template Ret<ffi::Buffer<ffi::F32>>();            // rstd
}

template <typename Binding>
auto bind_layer_norm_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // dy
      .template Arg<ffi::AnyBuffer>()                    // x
      .template Arg<ffi::AnyBuffer>()                    // weight
      .template Arg<ffi::AnyBuffer>()                    // bias
      .template Arg<ffi::Buffer<ffi::F32>>()             // mean
      .template Arg<ffi::Buffer<ffi::F32>>()             // rstd
      .template Ret<ffi::AnyBuffer>()                    // dx
      .template Ret<ffi::AnyBuffer>()                    // dweight [groups, cols]
      .template Ret<ffi::AnyBuffer>()                    // dbias [groups, cols]
      .template Ret<ffi::Buffer<ffi::F32>>();            // workspace
}

template <typename Binding>
auto bind_rms_norm_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // x
      .template Arg<ffi::AnyBuffer>()                    // weight
      .template Ret<ffi::AnyBuffer>()                    // y
      .template Ret<ffi::Buffer<ffi::F32>>();            // rstd
}

template <typename Binding>
auto bind_rms_norm_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // dy
      .template Arg<ffi::AnyBuffer>()                    // x
      .template Arg<ffi::AnyBuffer>()                    // weight
      .template Arg<ffi::Buffer<ffi::F32>>()             // rstd
      .template Arg<ffi::AnyBuffer>()                    // dresidual ([0]: absent)
      .template Ret<ffi::AnyBuffer>()                    // dx
      .template Ret<ffi::AnyBuffer>()                    // dweight [groups, cols]
      .template Ret<ffi::Buffer<ffi::F32>>();            // workspace
}

template <typename Binding>
auto bind_add_rms_norm_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // x
      .template Arg<ffi::AnyBuffer>()                    // residual
      .template Arg<ffi::AnyBuffer>()                    // weight
      .template Ret<ffi::AnyBuffer>()                    // y
      .template Ret<ffi::AnyBuffer>()                    // h (aliases residual when donated)
      .template Ret<ffi::Buffer<ffi::F32>>();            // rstd
}

// The tangent primitives: the absent tangents ([0]) are zero.
template <typename Binding>
auto bind_layer_norm_jvp(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // x
      .template Arg<ffi::AnyBuffer>()                    // weight ([0]: absent)
      .template Arg<ffi::Buffer<ffi::F32>>()             // mean
      .template Arg<ffi::Buffer<ffi::F32>>()             // rstd
      .template Arg<ffi::AnyBuffer>()                    // dx ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                    // dweight ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                    // dbias ([0]: absent)
      .template Ret<ffi::AnyBuffer>();                   // dy
}

template <typename Binding>
auto bind_rms_norm_jvp(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()           // x
      .template Arg<ffi::AnyBuffer>()                    // weight ([0]: absent)
      .template Arg<ffi::Buffer<ffi::F32>>()             // rstd
      .template Arg<ffi::AnyBuffer>()                    // dx ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                    // dweight ([0]: absent)
      .template Ret<ffi::AnyBuffer>();                   // dy
}

}  // namespace jaxops::norms_common
