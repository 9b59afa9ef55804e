// The contract of every target (xla_ffi/contract.h), exported by both nanobind
// modules (_jaxops_cpu, _jaxops_cuda) for the Python side to read: the target
// names, the attributes each binds (name and type) and the workspace sizes,
// from the very declarations the handlers are bound and registered with.
//
// Header-only and free of kernels: the CPU module is compiled for the baseline
// ISA and holds no handler (they live in the per-ISA libraries it loads), so it
// compiles these declarations itself rather than asking a kernel library.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "params/attention.h"
#include "xla_ffi/activations_common.h"
#include "xla_ffi/adamw_common.h"
#include "xla_ffi/attention_common.h"
#include "xla_ffi/contract.h"
#include "xla_ffi/cross_entropy_common.h"
#include "xla_ffi/embedding_common.h"
#include "xla_ffi/norms_common.h"
#include "xla_ffi/paged_attention_common.h"
#include "xla_ffi/patch_embed_common.h"
#include "xla_ffi/rope_common.h"
#include "xla_ffi/routing_common.h"
#include "xla_ffi/sampling_common.h"
#include "xla_ffi/softmax_common.h"
#include "xla_ffi/sparse_common.h"

namespace jaxops::python_contract {

namespace nb = nanobind;

// Every family's targets (one line per family).
inline const std::vector<contract::TargetDescription>& all_targets() {
  static const std::vector<contract::TargetDescription> all = [] {
    std::vector<contract::TargetDescription> out;
    for (auto family : {activations_common::contracts(), adamw_common::contracts(),
                        attention_common::contracts(), cross_entropy_common::contracts(),
                        embedding_common::contracts(), norms_common::contracts(),
                        rope_common::contracts(), softmax_common::contracts(),
                        paged_attention_common::contracts(), sampling_common::contracts(),
                        routing_common::contracts(), patch_embed_common::contracts(),
                        sparse_common::contracts()}) {
      out.insert(out.end(), family.begin(), family.end());
    }
    return out;
  }();
  return all;
}

inline const contract::TargetDescription& find_target(const std::string& name) {
  for (const auto& target : all_targets()) {
    if (name == target.name) return target;
  }
  throw nb::key_error(("no jaxops FFI target " + name).c_str());
}

inline contract::Platform platform_named(const std::string& name) {
  if (name == "cpu") return contract::Platform::kCpu;
  if (name == "cuda") return contract::Platform::kCuda;
  throw nb::value_error(("no jaxops kernels for platform " + name).c_str());
}

inline void define(nb::module_& m) {
  m.def(
      "contract",
      []() {
        nb::dict out;
        for (const auto& target : all_targets()) {
          nb::list attributes;
          for (const auto& [name, type] : target.attributes) {
            attributes.append(nb::make_tuple(name, type));
          }
          out[target.name] = nb::make_tuple(attributes, target.workspace != nullptr);
        }
        return out;
      },
      "Map of custom-call target name -> (attributes, has_workspace): the attributes as "
      "(name, numpy type name) in the order the handlers bind them.");
  m.def(
      "workspace",
      [](const std::string& target, std::vector<std::vector<int64_t>> operands,
         std::map<std::string, int64_t> integer_attributes, const std::string& platform) {
        const auto& declared = find_target(target);
        if (declared.workspace == nullptr) {
          throw nb::value_error((target + " has no workspace").c_str());
        }
        const contract::Workspace workspace = declared.workspace(
            {std::move(operands), std::move(integer_attributes), platform_named(platform)});
        return nb::make_tuple(nb::tuple(nb::cast(workspace.dims)), workspace.dtype);
      },
      nb::arg("target"), nb::arg("operands"), nb::arg("integer_attributes"), nb::arg("platform"),
      "(dims, numpy dtype name) of the hidden workspace result of a call to `target` with "
      "operands of these shapes and these integer attributes, lowered for `platform` "
      "('cpu' or 'cuda').");
  m.def(
      "limits",
      []() {
        nb::dict out;
        out["cuda_attention_max_head_dim"] = params::kCudaAttentionMaxHeadDim;
        out["cuda_paged_attention_max_head_dim"] = params::kCudaPagedAttentionMaxHeadDim;
        out["cuda_paged_attention_max_value_head_dim"] =
            params::kCudaPagedAttentionMaxValueHeadDim;
        return out;
      },
      "Limits of the kernels that the Python side checks before choosing one.");
}

}  // namespace jaxops::python_contract
