// What the CPU and CUDA handlers of the softmax family share, so the two
// platforms bind the same signatures and accept exactly the same calls: the FFI
// bindings (each takes the platform's binding prefix: nothing for the CPU, the
// stream for CUDA), the validation of every buffer, and the kernels' view
// (params/softmax.h) of an optional mask or bias.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "params/softmax.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::softmax_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::BroadcastOperand;
using ::jaxops::params::CausalLimit;
using ::jaxops::params::kMaxBroadcastAxes;
using ::jaxops::params::kStatsPerRow;
using ::jaxops::params::SoftmaxInput;
using ::jaxops::params::SoftmaxShape;

// -- the targets' contract ------------------------------------------------------------

inline constexpr auto kSoftmaxFwd = contract::target("jaxops_softmax_fwd");
inline constexpr auto kLogSoftmaxFwd = contract::target("jaxops_log_softmax_fwd");
// The position of the first query row along the keys.
inline constexpr auto kCausalSoftmaxFwd = contract::target(
    "jaxops_causal_softmax_fwd", contract::Attribute<int64_t>{"query_offset"});
inline constexpr auto kSoftmaxBwd = contract::target("jaxops_softmax_bwd");
// softmax's backward with causal_softmax's limit: the hidden columns get 0.
inline constexpr auto kCausalSoftmaxBwd = contract::target(
    "jaxops_causal_softmax_bwd", contract::Attribute<int64_t>{"query_offset"});
inline constexpr auto kLogSoftmaxBwd = contract::target("jaxops_log_softmax_bwd");
inline constexpr auto kSoftmaxJvp = contract::target("jaxops_softmax_jvp");
inline constexpr auto kLogSoftmaxJvp = contract::target("jaxops_log_softmax_jvp");
// softmax's tangent with causal_softmax's limit.
inline constexpr auto kCausalSoftmaxJvp = contract::target(
    "jaxops_causal_softmax_jvp", contract::Attribute<int64_t>{"query_offset"});

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kSoftmaxFwd),    describe(kLogSoftmaxFwd),    describe(kCausalSoftmaxFwd),
          describe(kSoftmaxBwd),    describe(kCausalSoftmaxBwd), describe(kLogSoftmaxBwd),
          describe(kSoftmaxJvp),    describe(kLogSoftmaxJvp),    describe(kCausalSoftmaxJvp)};
}

// x and an output (or a second input) shaped like it.
inline ffi::Error check_rows(const std::string& op, const char* x_name, const ffi::AnyBuffer& x,
                             const ffi::AnyBuffer& other, const char* other_name,
                             SoftmaxShape* shape) {
  JAXOPS_RETURN_IF_ERROR(rows_cols(op, x_name, x, &shape->rows, &shape->cols));
  JAXOPS_RETURN_IF_ERROR(same_dims(op, x_name, x, other_name, other));
  return same_dtype(op, x_name, x, other_name, other);
}

// An optional operand broadcast against x (named x_name): absent when it has no
// elements, else of x's rank with each axis 1 or x's size, and of dtype `dtype`.
inline ffi::Error check_broadcast_operand(const std::string& op, const char* name,
                                          const ffi::AnyBuffer& operand, const char* x_name,
                                          const ffi::AnyBuffer& x, ffi::DataType dtype,
                                          const char* dtype_name) {
  if (operand.element_count() == 0) return ffi::Error::Success();
  auto dims = operand.dimensions();
  auto x_dims = x.dimensions();
  bool ok = dims.size() == x_dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i] == 1 || dims[i] == x_dims[i];
  if (!ok) {
    return invalid(op, std::string(name) + " has shape " + dims_string(dims) + ", expected " +
                           x_name + "'s rank with each axis 1 or " + x_name + "'s size " +
                           dims_string(x_dims));
  }
  if (operand.element_type() != dtype) {
    return invalid(op, std::string(name) + " must have dtype " + dtype_name);
  }
  return ffi::Error::Success();
}

// The kernels' view of a broadcast operand that passed check_broadcast_operand
// (absent: a null view): row `row` of x finds its elements at
// sum_i ((row / prod(row_sizes[i+1:])) % row_sizes[i]) * row_strides[i], then
// column c at c * col_stride. x's leading axes are merged where the operand
// broadcasts alike along them, so the usual masks need one or two groups; more
// than kMaxBroadcastAxes groups is an error on every platform.
template <typename T>
ffi::Error broadcast_operand(const std::string& op, const char* name,
                             const ffi::AnyBuffer& operand, const ffi::AnyBuffer& x,
                             BroadcastOperand<T>* view) {
  *view = {};
  if (operand.element_count() == 0) return ffi::Error::Success();
  auto dims = operand.dimensions();
  auto x_dims = x.dimensions();
  const size_t rank = dims.size();
  int64_t sizes[kMaxBroadcastAxes], strides[kMaxBroadcastAxes];  // innermost first
  int axes = 0;
  int64_t stride = dims[rank - 1];
  for (size_t axis = rank - 1; axis-- > 0;) {
    const int64_t size = x_dims[axis];
    const int64_t axis_stride = dims[axis] == 1 ? 0 : stride;
    stride *= dims[axis];
    if (size == 1) continue;
    const bool merges =
        axes > 0 && ((axis_stride == 0 && strides[axes - 1] == 0) ||
                     (axis_stride != 0 && strides[axes - 1] != 0 &&
                      axis_stride == strides[axes - 1] * sizes[axes - 1]));
    if (merges) {
      sizes[axes - 1] *= size;
      continue;
    }
    if (axes == kMaxBroadcastAxes) {
      return invalid(op, std::string(name) + " broadcasts along more than " +
                             std::to_string(kMaxBroadcastAxes) +
                             " alternating groups of axes, which the kernels do not support");
    }
    sizes[axes] = size;
    strides[axes] = axis_stride;
    ++axes;
  }
  view->data = reinterpret_cast<const T*>(operand.untyped_data());
  view->axes = axes;
  for (int i = 0; i < axes; ++i) {
    view->row_sizes[i] = sizes[axes - 1 - i];
    view->row_strides[i] = strides[axes - 1 - i];
  }
  view->col_stride = dims[rank - 1] == 1 ? 0 : 1;
  return ffi::Error::Success();
}

// The forward's row statistics: float32 [leading axes of x..., kStatsPerRow].
inline ffi::Error check_stats(const std::string& op, const char* x_name, const ffi::AnyBuffer& x,
                              const ffi::AnyBuffer& stats) {
  auto x_dims = x.dimensions();
  std::vector<int64_t> expected(x_dims.begin(), x_dims.end());
  if (expected.empty()) return invalid(op, std::string(x_name) + " must have rank >= 1");
  expected.back() = kStatsPerRow;
  JAXOPS_RETURN_IF_ERROR(dims_are(op, "stats", stats, expected));
  if (stats.element_type() != ffi::DataType::F32) {
    return invalid(op, "stats must have dtype float32");
  }
  return ffi::Error::Success();
}

// The derivative kernels' view of the forward's input (checked by
// check_softmax_input): x, its mask and bias, and the statistics.
// (causal_softmax's derivatives, which take no mask or bias, fill x and
// stats themselves.)
template <typename T>
ffi::Error softmax_input(const std::string& op, const ffi::AnyBuffer& x,
                         const ffi::AnyBuffer& where, const ffi::AnyBuffer& bias,
                         const ffi::AnyBuffer& stats, SoftmaxInput<T>* input) {
  input->x = data<const T>(x);
  input->stats = data<const float>(stats);
  JAXOPS_RETURN_IF_ERROR(broadcast_operand(op, "where", where, x, &input->where));
  return broadcast_operand(op, "bias", bias, x, &input->bias);
}

// -- whole-call validation, one per handler kind ----------------------------------------

// x with its optional mask and bias, as the forward takes them.
inline ffi::Error check_masked_x(const std::string& op, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& where, const ffi::AnyBuffer& bias) {
  JAXOPS_RETURN_IF_ERROR(
      check_broadcast_operand(op, "where", where, "x", x, ffi::DataType::PRED, "bool"));
  return check_broadcast_operand(op, "bias", bias, "x", x, x.element_type(), "x's dtype");
}

inline ffi::Error check_masked_softmax_fwd(const std::string& op, const ffi::AnyBuffer& x,
                                           const ffi::AnyBuffer& where, const ffi::AnyBuffer& bias,
                                           const ffi::AnyBuffer& y, const ffi::AnyBuffer& stats,
                                           SoftmaxShape* s) {
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "x", x, y, "y", s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "x", x, stats));
  return check_masked_x(op, x, where, bias);
}

// The causal limit: the queries are x's second-to-last axis.
inline ffi::Error causal_limit(const std::string& op, const char* x_name, const ffi::AnyBuffer& x,
                               int64_t query_offset, CausalLimit* causal) {
  if (x.dimensions().size() < 2) {
    return invalid(op, std::string(x_name) + " must have rank >= 2 (queries, keys)");
  }
  *causal = {x.dimensions()[x.dimensions().size() - 2], query_offset};
  return ffi::Error::Success();
}

inline ffi::Error check_causal_softmax_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                           const ffi::AnyBuffer& stats, int64_t query_offset,
                                           SoftmaxShape* s, CausalLimit* causal) {
  const std::string op = kCausalSoftmaxFwd.name;
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "x", x, y, "y", s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "x", x, stats));
  return causal_limit(op, "x", x, query_offset, causal);
}

// The derivatives' view of the forward: x (its mask and bias, absent for
// causal_softmax's) and the statistics, and an array `other` shaped like x.
inline ffi::Error check_softmax_input(const std::string& op, const ffi::AnyBuffer& x,
                                      const ffi::AnyBuffer& where, const ffi::AnyBuffer& bias,
                                      const ffi::AnyBuffer& stats, const ffi::AnyBuffer& other,
                                      const char* other_name, SoftmaxShape* s) {
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "x", x, other, other_name, s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "x", x, stats));
  return check_masked_x(op, x, where, bias);
}

// The backward kernels: the cotangent dy and the result dx, shaped like x.
inline ffi::Error check_softmax_bwd(const std::string& op, const ffi::AnyBuffer& dy,
                                    const ffi::AnyBuffer& x, const ffi::AnyBuffer& where,
                                    const ffi::AnyBuffer& bias, const ffi::AnyBuffer& stats,
                                    const ffi::AnyBuffer& dx, SoftmaxShape* s) {
  JAXOPS_RETURN_IF_ERROR(check_softmax_input(op, x, where, bias, stats, dy, "dy", s));
  return check_rows(op, "x", x, dx, "dx", s);
}

inline ffi::Error check_causal_softmax_bwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                           const ffi::AnyBuffer& stats, const ffi::AnyBuffer& dx,
                                           int64_t query_offset, SoftmaxShape* s,
                                           CausalLimit* causal) {
  const std::string op = kCausalSoftmaxBwd.name;
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "x", x, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "x", x, dx, "dx", s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "x", x, stats));
  return causal_limit(op, "x", x, query_offset, causal);
}

// The tangent primitives: the tangents dx ([0]: absent, else x's shape) and
// dbias (broadcast against x as the forward's bias) sum to the input's
// tangent; dy is the output's.
inline ffi::Error check_softmax_jvp(const std::string& op, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& where, const ffi::AnyBuffer& bias,
                                    const ffi::AnyBuffer& stats, const ffi::AnyBuffer& dx,
                                    const ffi::AnyBuffer& dbias, const ffi::AnyBuffer& dy,
                                    SoftmaxShape* s) {
  JAXOPS_RETURN_IF_ERROR(check_softmax_input(op, x, where, bias, stats, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_optional_like(op, "x", x, "dx", dx));
  return check_broadcast_operand(op, "dbias", dbias, "x", x, x.element_type(), "x's dtype");
}

inline ffi::Error check_causal_softmax_jvp(const ffi::AnyBuffer& x, const ffi::AnyBuffer& stats,
                                           const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dy,
                                           int64_t query_offset, SoftmaxShape* s,
                                           CausalLimit* causal) {
  const std::string op = kCausalSoftmaxJvp.name;
  JAXOPS_RETURN_IF_ERROR(check_rows(op, "x", x, dy, "dy", s));
  JAXOPS_RETURN_IF_ERROR(check_stats(op, "x", x, stats));
  JAXOPS_RETURN_IF_ERROR(check_optional_like(op, "x", x, "dx", dx));
  return causal_limit(op, "x", x, query_offset, causal);
}

// -- bindings: `prefix` is ffi::Ffi::Bind(), with the stream context on CUDA ----------

template <typename Binding>
auto bind_masked_softmax_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()                      // where (bool; [0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // bias ([0]: absent)
      .template Ret<ffi::AnyBuffer>()                      // y
      .template Ret<ffi::AnyBuffer>();                     // stats (float32 [..., 2])
}

template <typename Binding>
auto bind_causal_softmax_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x
      .template Ret<ffi::AnyBuffer>()                      // y
      .template Ret<ffi::AnyBuffer>();                     // stats
}

template <typename Binding>
auto bind_softmax_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()                      // x
      .template Arg<ffi::AnyBuffer>()                      // where ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // bias ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // stats (the forward's)
      .template Ret<ffi::AnyBuffer>();                     // dx
}

template <typename Binding>
auto bind_causal_softmax_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()                      // x
      .template Arg<ffi::AnyBuffer>()                      // stats
      .template Ret<ffi::AnyBuffer>();                     // dx
}

template <typename Binding>
auto bind_softmax_jvp(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()                      // where ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // bias ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // stats
      .template Arg<ffi::AnyBuffer>()                      // dx ([0]: absent)
      .template Arg<ffi::AnyBuffer>()                      // dbias ([0]: absent)
      .template Ret<ffi::AnyBuffer>();                     // dy
}

template <typename Binding>
auto bind_causal_softmax_jvp(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()                      // stats
      .template Arg<ffi::AnyBuffer>()                      // dx ([0]: absent)
      .template Ret<ffi::AnyBuffer>();                     // dy
}

}  // namespace jaxops::softmax_common
