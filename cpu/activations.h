// Elementwise activations (GELU, SiLU) and the gated ones (SwiGLU, GeGLU),
// forward and backward, on flat arrays of n elements. T is float, bfloat16 or
// float16; the math is float32 and results are rounded to T once.
//
//   gelu_tanh(x) = x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))
//                  (= x/2 (1 + tanh(...)), without the 1 + tanh cancellation)
//   gelu_erf(x)  = x * Phi(x)
//   silu(x)      = x * sigmoid(x)
//   gated(gate, up) = act(gate) * up
//
// The gated backward produces both gradients in one pass:
//   dgate = dy * up * act'(gate),  dup = dy * act(gate).
#pragma once

#include <cstdint>

#include "params/activations.h"

namespace jaxops::cpu {

using ::jaxops::params::Activation;

template <typename T>
void activation_fwd(Activation activation, const T* x, T* y, int64_t n);

template <typename T>
void activation_bwd(Activation activation, const T* dy, const T* x, T* dx, int64_t n);

template <typename T>
void gated_activation_fwd(Activation activation, const T* gate, const T* up, T* y, int64_t n);

template <typename T>
void gated_activation_bwd(Activation activation, const T* dy, const T* gate, const T* up,
                          T* dgate, T* dup, int64_t n);

}  // namespace jaxops::cpu
