// Sampling one token per row of logits [batch, vocab] (jaxops.sample): the
// specification is the jnp reference (jaxops/reference.py: sample_with_uniforms)
// and params/sampling.h holds the per-row arithmetic both must share. T is
// float, bfloat16 or float16; everything is computed in float32.
//
// Per row, without sorting the vocabulary: the kept tokens are a prefix of the
// order "z = logits / temperature descending, lower index first", so each
// filter is a boundary (a key and, among the tokens tied at it, the last index
// kept) found by a bitwise binary search on the tokens' order keys (32 passes
// counting tokens for top-k, summing weights for top-p), over a candidate list
// that is compacted as soon as the search has excluded most of it. Then one
// pass draws from the kept tokens in index order. Rows run in parallel (OpenMP).
//
// tokens[row] = -1 for a row with a NaN logit or no logit above -inf.
#pragma once

#include <cstdint>

#include "params/sampling.h"

namespace jaxops::cpu {

using ::jaxops::params::SampleShape;

template <typename T>
void sample(const T* logits, const float* row_floats, const int32_t* top_k, int32_t* tokens,
            SampleShape shape);

}  // namespace jaxops::cpu
