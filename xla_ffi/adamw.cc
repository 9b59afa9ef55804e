// CPU FFI handler of the fused AdamW step over every leaf of a model: validate
// into the leaf table (xla_ffi/adamw_common.h), then call cpu/adamw.
#include <vector>

#include "cpu/adamw.h"
#include "xla_ffi/adamw_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace adamw_common;

ffi::Error AdamW(ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args, ffi::RemainingRets rets,
                 bool apply_updates, bool nesterov, int64_t decayed_leaves) {
  std::vector<AdamWLeaf> leaves;
  JAXOPS_RETURN_IF_ERROR(collect_leaves(scalars, args, rets, decayed_leaves, &leaves));
  cpu::adamw(leaves.data(), static_cast<int64_t>(leaves.size()), scalars.typed_data(),
             AdamWOptions{apply_updates, nesterov});
  return ffi::Error::Success();
}

}  // namespace

JAXOPS_FFI_TARGET(kAdamW, kAdamWCpu, AdamW, bind_adamw(ffi::Ffi::Bind()));

}  // namespace jaxops
