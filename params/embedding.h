// The parameters of the embedding lookup and its gradient, one set for the CPU
// kernels (cpu/embedding.h), the CUDA kernels (cuda/embedding.h) and the FFI
// handlers that fill them (xla_ffi/embedding_common.h).
#pragma once

#include <cstdint>

namespace jaxops::params {

// table [vocab, dim]; `tokens` int32 ids; the looked-up rows [tokens, dim].
struct EmbeddingShape {
  int64_t vocab;
  int64_t dim;
  int64_t tokens;
};

// int32s of the backward's workspace: row offsets [vocab + 1], then the tokens
// sorted by row [tokens].
inline int64_t embedding_bwd_workspace_ints(const EmbeddingShape& s) {
  return s.vocab + 1 + s.tokens;
}

}  // namespace jaxops::params
