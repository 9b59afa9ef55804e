// Embedding lookup and its gradient. table is [vocab, dim] row-major; ids are
// `tokens` int32 indices; out is [tokens, dim]. T is float, bfloat16 or
// float16.
//
// Out-of-range ids are clamped to [0, vocab - 1] (jnp.take(..., mode="clip")):
// a lookup never reads outside the table, and the gradient of a clamped id
// goes to the row that was read.
//
// The gradient is a scatter-add of the rows of dout into dtable [vocab, dim]
// without atomics: the tokens are counting-sorted by row (stable), then each
// row sums its tokens in token order, in float32, and is written once. Rows
// are split among threads, so no two threads touch one row and the result is
// the same for any number of threads.
#pragma once

#include <cstdint>

#include "params/embedding.h"

namespace jaxops::cpu {

using ::jaxops::params::EmbeddingShape;

template <typename T>
void embedding_fwd(const T* table, const int32_t* ids, T* out, EmbeddingShape shape);

// workspace: vocab + 1 + tokens int32s (row offsets, then the sorted token order).
template <typename T>
void embedding_bwd(const T* dout, const int32_t* ids, T* dtable, int32_t* workspace,
                   EmbeddingShape shape);

}  // namespace jaxops::cpu
