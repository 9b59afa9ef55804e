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

// int32s of the CPU backward's workspace: row offsets [vocab + 1], then the
// tokens sorted by row [tokens].
inline int64_t embedding_bwd_workspace_ints(const EmbeddingShape& s) {
  return s.vocab + 1 + s.tokens;
}

// The CUDA backward sorts one int64 key (row << 32 | token) per token, padded
// to a power of two of at least one shared-memory tile of the sort.
inline constexpr int64_t kEmbeddingSortTile = 2048;
inline int64_t embedding_sort_keys(int64_t tokens) {
  int64_t keys = kEmbeddingSortTile;
  while (keys < tokens) keys *= 2;
  return keys;
}

// int32s of the CUDA backward's workspace: the sort keys (two int32s each),
// then each row's first and end position among the sorted keys [vocab] each.
inline int64_t embedding_bwd_cuda_workspace_ints(const EmbeddingShape& s) {
  return 2 * embedding_sort_keys(s.tokens) + 2 * s.vocab;
}

}  // namespace jaxops::params
