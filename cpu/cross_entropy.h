// Cross-entropy of logits [rows, vocab] (row-major) against integer labels
// [rows], forward, backward and forward-mode derivative (JVP). T is float,
// bfloat16 or float16; Label is int32_t or int64_t; all arithmetic is float32.
//
// Per row, with lse = logsumexp(logits) and eps = label_smoothing:
//   loss = (1 - eps) * (lse - logits[label]) + eps * (lse - mean(logits))
//          + z_loss * lse^2
//   dloss/dlogits = p * (1 + 2 * z_loss * lse) - eps / vocab - (1 - eps) * onehot(label)
// with p = exp(logits - lse). A row whose label is `ignore_index` has loss 0
// and gradient 0 and is not read. A row whose label is otherwise outside
// [0, vocab) has loss NaN and gradient 0 and is not read either (the label is
// never used as an index). Both get lse = 0.
#pragma once

#include <cstdint>

#include "params/cross_entropy.h"

namespace jaxops::cpu {

using ::jaxops::params::CrossEntropyOptions;
using ::jaxops::params::CrossEntropyShape;

// loss and lse per row (float32).
template <typename T, typename Label>
void cross_entropy_fwd(const T* logits, const Label* labels, float* loss, float* lse,
                       CrossEntropyShape shape, CrossEntropyOptions options);

// dlogits = dloss[row] * dloss/dlogits, from the forward's lse; one pass that
// reads each row once and writes it once. dlogits may be logits (in place).
template <typename T, typename Label>
void cross_entropy_bwd(const T* logits, const Label* labels, const float* lse, const float* dloss,
                       T* dlogits, CrossEntropyShape shape, CrossEntropyOptions options);

// The loss and its gradient for a unit cotangent on every row, in one pass:
// what a caller that scales the gradient afterwards (a summed or averaged loss)
// needs. dlogits may be logits (in place).
template <typename T, typename Label>
void cross_entropy_fwd_grad(const T* logits, const Label* labels, float* loss, T* dlogits,
                            CrossEntropyShape shape, CrossEntropyOptions options);

// The tangent of the loss for a tangent dlogits of the logits, from the
// forward's lse: with p = exp(logits - lse),
//   dloss = (1 + 2 * z_loss * lse) * sum(p * dlogits) - eps * mean(dlogits)
//           - (1 - eps) * dlogits[label];
// 0 on the rows that the forward does not compute (ignored or out-of-range
// label: their loss is a constant), which are not read.
template <typename T, typename Label>
void cross_entropy_jvp(const T* logits, const Label* labels, const float* lse, const T* dlogits,
                       float* dloss, CrossEntropyShape shape, CrossEntropyOptions options);

}  // namespace jaxops::cpu
