// CUDA FFI handlers of the embedding lookup and its gradient: the CPU handlers'
// targets, bindings and validation (xla_ffi/embedding_common.h), then launches
// of cuda/embedding on the stream XLA hands over.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/embedding.h"
#include "xla_ffi/cuda/cuda_binding.h"
#include "xla_ffi/cuda/cuda_dispatch.h"
#include "xla_ffi/cuda/cuda_status.h"
#include "xla_ffi/embedding_common.h"

namespace jaxops {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_common;
using namespace embedding_common;
using ffi_cuda::cuda_binding;
using ffi_cuda::dispatch;
using ffi_cuda::launch_status;

ffi::Error EmbeddingFwd(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> out) {
  const std::string op = kEmbeddingFwd.name;
  EmbeddingShape d;
  JAXOPS_RETURN_IF_ERROR(check_embedding_fwd(table, ids, *out, &d));
  return dispatch(op, table.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::embedding_fwd<T>(stream, data<const T>(table),
                                                    ids.typed_data(), data<T>(*out),
                                                    d));
  });
}

ffi::Error EmbeddingBwd(cudaStream_t stream, ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> dtable,
                        ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t vocab) {
  const std::string op = kEmbeddingBwd.name;
  EmbeddingShape d;
  JAXOPS_RETURN_IF_ERROR(check_embedding_bwd(dout, ids, *dtable, *workspace, vocab,
                                             contract::Platform::kCuda, &d));
  return dispatch(op, dout.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return launch_status(op, cuda::embedding_bwd<T>(stream, data<const T>(dout),
                                                    ids.typed_data(), data<T>(*dtable),
                                                    workspace->typed_data(),
                                                    d));
  });
}

}  // namespace

JAXOPS_FFI_TARGET(kEmbeddingFwd, kEmbeddingFwdCuda, EmbeddingFwd,
                  bind_embedding_fwd(cuda_binding()));
JAXOPS_FFI_TARGET(kEmbeddingBwd, kEmbeddingBwdCuda, EmbeddingBwd,
                  bind_embedding_bwd(cuda_binding()));

}  // namespace jaxops
