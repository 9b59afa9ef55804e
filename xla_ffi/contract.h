// The contract of a custom-call target: its name, the attributes its handlers
// bind (name and C++ type) and, where it has one, the size of its hidden
// workspace result as a function of the operand shapes.
//
// Each family declares its targets once, in xla_ffi/<family>_common.h (these
// are facts of the FFI interface, which kernels never see; plain sizes that
// kernels share stay in params/<family>.h and the declarations call them).
// The handlers bind their attributes from the declaration
// (bind_attributes) and register under its name (JAXOPS_FFI_TARGET), and the
// nanobind modules export the same declarations (xla_ffi/python_contract.h),
// so the Python side lowers with the names and types the handlers decode and a
// handler cannot disagree with what Python reads.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "xla_ffi/registry.h"

namespace jaxops::contract {

// The platforms whose workspace sizes may differ.
enum class Platform { kCpu, kCuda };

// An attribute a handler binds as `.Attr<T>(name)`.
template <typename T>
struct Attribute {
  const char* name;
};

// The attribute types handlers bind, named as numpy names the scalar type the
// Python side casts each attribute to (an f64 attribute does not bind to
// Attr<float>).
template <typename T>
constexpr const char* type_name();
template <>
constexpr const char* type_name<float>() { return "float32"; }
template <>
constexpr const char* type_name<double>() { return "float64"; }
template <>
constexpr const char* type_name<int64_t>() { return "int64"; }
template <>
constexpr const char* type_name<bool>() { return "bool"; }

// What a workspace size depends on: the call's operand shapes (in binding
// order), its integer attributes and the platform. A missing entry throws
// std::out_of_range, which the Python module raises as an IndexError.
struct WorkspaceQuery {
  std::vector<std::vector<int64_t>> operands;
  std::map<std::string, int64_t> attributes;
  Platform platform;

  const std::vector<int64_t>& operand(size_t i) const { return operands.at(i); }
  int64_t attribute(Attribute<int64_t> declared) const {
    auto found = attributes.find(declared.name);
    if (found == attributes.end()) {
      throw std::out_of_range(std::string("no integer attribute ") + declared.name);
    }
    return found->second;
  }
};

// The hidden result a target appends to its outputs.
struct Workspace {
  std::vector<int64_t> dims;
  const char* dtype;  // numpy name: "float32", "int32", "uint8"
};

using WorkspaceFn = Workspace (*)(const WorkspaceQuery&);

template <typename... T>
struct Target {
  const char* name;
  std::tuple<Attribute<T>...> attributes;
  WorkspaceFn workspace;  // nullptr: the target has no workspace result
};

template <typename... T>
constexpr Target<T...> target(const char* name, Attribute<T>... attributes) {
  return {name, std::make_tuple(attributes...), nullptr};
}

template <typename... T>
constexpr Target<T...> target_with_workspace(const char* name, WorkspaceFn workspace,
                                             Attribute<T>... attributes) {
  return {name, std::make_tuple(attributes...), workspace};
}

// The binding `make_binding()` returns, followed by `.Attr<T>(name)` for the
// first N attributes of `target`, in their order. XLA's bindings cannot be
// moved from outside, so each step works on the prvalue the previous returns.
template <size_t N, typename MakeBinding, typename... T>
auto bind_first_attributes(MakeBinding&& make_binding, const Target<T...>& target) {
  if constexpr (N == 0) {
    return make_binding();
  } else {
    using Type = std::tuple_element_t<N - 1, std::tuple<T...>>;
    return bind_first_attributes<N - 1>(make_binding, target)
        .template Attr<Type>(std::get<N - 1>(target.attributes).name);
  }
}

template <typename MakeBinding, typename... T>
auto bind_attributes(MakeBinding&& make_binding, const Target<T...>& target) {
  return bind_first_attributes<sizeof...(T)>(make_binding, target);
}

// A target as the Python module exports it.
struct TargetDescription {
  const char* name;
  std::vector<std::pair<const char*, const char*>> attributes;  // (name, type), bound order
  WorkspaceFn workspace;
};

template <typename... T>
TargetDescription describe(const Target<T...>& target) {
  TargetDescription out{target.name, {}, target.workspace};
  std::apply([&](const auto&... attribute) {
    (out.attributes.emplace_back(attribute.name, type_name<T>()), ...);
  }, target.attributes);
  return out;
}

}  // namespace jaxops::contract

// Defines the XLA FFI handler `symbol` running `fn` with the buffers of
// `binding` and the attributes of `declaration`, and registers it under the
// name `declaration` gives: what a handler binds and the name it answers to
// cannot differ from the contract the Python side reads.
#define JAXOPS_FFI_TARGET(declaration, symbol, fn, binding)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                    \
      symbol, fn, ::jaxops::contract::bind_attributes([] { return binding; }, declaration)); \
  JAXOPS_REGISTER_FFI_TARGET((declaration).name, symbol)
