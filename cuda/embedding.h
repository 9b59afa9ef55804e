// CUDA kernels for the embedding lookup and its gradient. No XLA, no Python.
//
// The same operations, arguments and semantics as cpu/embedding.h (keep the two
// in step), plus the stream to launch on: table [vocab, dim], `tokens` int32
// ids clamped to [0, vocab - 1], T is float, __half or __nv_bfloat16.
//
// The gradient is deterministic and race-free like the CPU one: the tokens are
// sorted by (row, token) as int64 keys (a bitonic sort: shared-memory tiles and
// global steps), each row's span among the sorted keys is marked, and each
// (row, column) of dtable sums its tokens in token order in float32 (a row
// without tokens is written 0). workspace:
// params::embedding_bwd_cuda_workspace_ints(shape) int32s, 8-byte aligned.
// Every function returns cudaGetLastError() after its launches.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params/embedding.h"

namespace jaxops::cuda {

using ::jaxops::params::EmbeddingShape;

template <typename T>
cudaError_t embedding_fwd(cudaStream_t stream, const T* table, const int32_t* ids, T* out,
                          EmbeddingShape shape);

template <typename T>
cudaError_t embedding_bwd(cudaStream_t stream, const T* dout, const int32_t* ids, T* dtable,
                          int32_t* workspace, EmbeddingShape shape);

#define JAXOPS_CUDA_EMBEDDING_DECLARE(T)                                                    \
  extern template cudaError_t embedding_fwd<T>(cudaStream_t, const T*, const int32_t*, T*,  \
                                               EmbeddingShape);                             \
  extern template cudaError_t embedding_bwd<T>(cudaStream_t, const T*, const int32_t*, T*,  \
                                               int32_t*, EmbeddingShape);

JAXOPS_CUDA_EMBEDDING_DECLARE(float)
JAXOPS_CUDA_EMBEDDING_DECLARE(__half)
JAXOPS_CUDA_EMBEDDING_DECLARE(__nv_bfloat16)

#undef JAXOPS_CUDA_EMBEDDING_DECLARE

}  // namespace jaxops::cuda
