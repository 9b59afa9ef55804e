// What the CPU and CUDA handlers of the activations share, so the two platforms
// bind the same signatures and accept exactly the same calls: the validation of
// every buffer and the FFI bindings (each takes the platform's binding prefix:
// nothing for the CPU, the stream for CUDA). Every buffer of an elementwise op
// has the shape and dtype of its first operand; the kernels see them flat.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "params/activations.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/ffi_common.h"

namespace jaxops::activations_common {

namespace ffi = xla::ffi;
using namespace ::jaxops::ffi_common;
using ::jaxops::params::Activation;

// -- the targets' contract ------------------------------------------------------------

// true: the tanh form of GELU.
inline constexpr contract::Attribute<bool> kApproximate{"approximate"};

inline constexpr auto kGeluFwd = contract::target("jaxops_gelu_fwd", kApproximate);
inline constexpr auto kGeluBwd = contract::target("jaxops_gelu_bwd", kApproximate);
inline constexpr auto kSiluFwd = contract::target("jaxops_silu_fwd");
inline constexpr auto kSiluBwd = contract::target("jaxops_silu_bwd");
inline constexpr auto kSwigluFwd = contract::target("jaxops_swiglu_fwd");
inline constexpr auto kSwigluBwd = contract::target("jaxops_swiglu_bwd");
inline constexpr auto kGegluFwd = contract::target("jaxops_geglu_fwd", kApproximate);
inline constexpr auto kGegluBwd = contract::target("jaxops_geglu_bwd", kApproximate);

inline std::vector<contract::TargetDescription> contracts() {
  return {describe(kGeluFwd),   describe(kGeluBwd),   describe(kSiluFwd),  describe(kSiluBwd),
          describe(kSwigluFwd), describe(kSwigluBwd), describe(kGegluFwd), describe(kGegluBwd)};
}

// gelu and geglu choose their form with the `approximate` attribute.
inline Activation gelu_activation(bool approximate) {
  return approximate ? Activation::kGeluTanh : Activation::kGeluErf;
}

// `other` has the shape and dtype of `first`.
inline ffi::Error check_like(const std::string& op, const char* first_name,
                             const ffi::AnyBuffer& first, const char* name,
                             const ffi::AnyBuffer& other) {
  JAXOPS_RETURN_IF_ERROR(same_dims(op, first_name, first, name, other));
  return same_dtype(op, first_name, first, name, other);
}

inline ffi::Error check_unary_fwd(const std::string& op, const ffi::AnyBuffer& x,
                                  const ffi::AnyBuffer& y) {
  return check_like(op, "x", x, "y", y);
}

inline ffi::Error check_unary_bwd(const std::string& op, const ffi::AnyBuffer& dy,
                                  const ffi::AnyBuffer& x, const ffi::AnyBuffer& dx) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "x", x, "dy", dy));
  return check_like(op, "x", x, "dx", dx);
}

inline ffi::Error check_gated_fwd(const std::string& op, const ffi::AnyBuffer& gate,
                                  const ffi::AnyBuffer& up, const ffi::AnyBuffer& y) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "up", up));
  return check_like(op, "gate", gate, "y", y);
}

inline ffi::Error check_gated_bwd(const std::string& op, const ffi::AnyBuffer& dy,
                                  const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up,
                                  const ffi::AnyBuffer& dgate, const ffi::AnyBuffer& dup) {
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "dy", dy));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "up", up));
  JAXOPS_RETURN_IF_ERROR(check_like(op, "gate", gate, "dgate", dgate));
  return check_like(op, "gate", gate, "dup", dup);
}

// -- bindings: `prefix` is ffi::Ffi::Bind(), with the stream context on CUDA ----------

template <typename Binding>
auto bind_unary_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // x
      .template Ret<ffi::AnyBuffer>();                     // y
}

template <typename Binding>
auto bind_unary_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()                      // x
      .template Ret<ffi::AnyBuffer>();                     // dx
}

template <typename Binding>
auto bind_gated_fwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // gate
      .template Arg<ffi::AnyBuffer>()                      // up
      .template Ret<ffi::AnyBuffer>();                     // y
}

template <typename Binding>
auto bind_gated_bwd(Binding prefix) {
  return std::move(prefix).template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()                      // gate
      .template Arg<ffi::AnyBuffer>()                      // up
      .template Ret<ffi::AnyBuffer>()                      // dgate
      .template Ret<ffi::AnyBuffer>();                     // dup
}

}  // namespace jaxops::activations_common
