#include "cpu/activations.h"

#include <algorithm>
#include <cstddef>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"
#include "cpu/vector_math.h"

namespace jaxops::cpu {
namespace {

namespace vm = vector_math;

// Elements converted to float32 at a time: a few streams of this fit in L1.
constexpr int64_t kBlock = 2048;
// Below this many elements a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;

// Each activation: value(x), and value_and_derivative(x, &value, &derivative).
// Both are inlined into the `omp simd` loops below, so they must stay
// straight-line code (see vector_math.h).
struct GeluTanh {
  // 2 sqrt(2/pi) (x + 0.044715 x^3) = x (k0 + k1 x^2)
  static constexpr float k0 = 1.595769122e+00f;
  static constexpr float k1 = 7.135481627e-02f;
  static float value(float x) { return x * vm::sigmoid(x * (k0 + k1 * x * x)).value; }
  static void value_and_derivative(float x, float* value, float* derivative) {
    // Past |x| = 20 the sigmoid is exactly 0 or 1 and its derivative exactly 0;
    // clamping the polynomial there keeps x^2 finite (0 * inf would be NaN).
    const float clamped = vm::clamp(x, -20.0f, 20.0f);
    const vm::Sigmoid s = vm::sigmoid(clamped * (k0 + k1 * clamped * clamped));
    *value = x * s.value;
    *derivative = s.value + x * s.value * s.complement * (k0 + 3.0f * k1 * clamped * clamped);
  }
};

struct GeluErf {
  static constexpr float kInvSqrt2Pi = 3.989422804e-01f;
  static float value(float x) { return x * vm::gaussian_cdf(x, vm::gaussian_kernel(x)); }
  static void value_and_derivative(float x, float* value, float* derivative) {
    const float e = vm::gaussian_kernel(x);
    const float cdf = vm::gaussian_cdf(x, e);
    *value = x * cdf;
    *derivative = cdf + x * e * kInvSqrt2Pi;
  }
};

struct Silu {
  static float value(float x) { return x * vm::sigmoid(x).value; }
  static void value_and_derivative(float x, float* value, float* derivative) {
    const vm::Sigmoid s = vm::sigmoid(x);
    *value = x * s.value;
    *derivative = s.value * (1.0f + x * s.complement);
  }
};

// Runs block(len, in, out) on the blocks of the flat range [0, n), split into
// contiguous runs per thread: in[k] is the block of inputs[k] as float32, and
// out[k] where the block of outputs[k] is computed in float32 before it is
// stored as T.
template <size_t kInputs, size_t kOutputs, typename T, typename Block>
void map_blocks(int64_t n, const T* const (&inputs)[kInputs], T* const (&outputs)[kOutputs],
                Block&& block) {
  for (T* output : outputs) advise_huge_pages(output, sizeof(T) * n);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel if (n >= kMinParallel)
  {
    // A static schedule gives each thread one run of blocks, which it
    // populates ahead of its writes (cpu/fresh_memory.h).
    WriteAhead write_ahead[kOutputs];
    for (size_t k = 0; k < kOutputs; ++k) write_ahead[k] = WriteAhead(outputs[k], sizeof(T) * n);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
      alignas(64) float in_buffers[kInputs][kBlock], out_buffers[kOutputs][kBlock];
      const float* in[kInputs];
      float* out[kOutputs];
      for (size_t k = 0; k < kInputs; ++k) {
        in[k] = read_as_float(inputs[k] + begin, len, in_buffers[k]);
      }
      for (size_t k = 0; k < kOutputs; ++k) {
        write_ahead[k].before_write(outputs[k] + begin, sizeof(T) * len);
        out[k] = result_target(outputs[k] + begin, out_buffers[k]);
      }
      block(len, in, out);
      for (size_t k = 0; k < kOutputs; ++k) commit_result(out[k], outputs[k] + begin, len);
    }
  }
}

template <typename Act, typename T>
void unary_fwd(const T* x, T* y, int64_t n) {
  map_blocks(n, {x}, {y}, [](int64_t len, const float* const* in, float* const* out) {
    const float* xb = in[0];
    float* yb = out[0];
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) yb[i] = Act::value(xb[i]);
  });
}

template <typename Act, typename T>
void unary_bwd(const T* dy, const T* x, T* dx, int64_t n) {
  map_blocks(n, {x, dy}, {dx}, [](int64_t len, const float* const* in, float* const* out) {
    const float *xb = in[0], *dyb = in[1];
    float* dxb = out[0];
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      float value, derivative;
      Act::value_and_derivative(xb[i], &value, &derivative);
      dxb[i] = dyb[i] * derivative;
    }
  });
}

template <typename Act, typename T>
void gated_fwd(const T* gate, const T* up, T* y, int64_t n) {
  map_blocks(n, {gate, up}, {y}, [](int64_t len, const float* const* in, float* const* out) {
    const float *gb = in[0], *ub = in[1];
    float* yb = out[0];
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) yb[i] = Act::value(gb[i]) * ub[i];
  });
}

template <typename Act, typename T>
void gated_bwd(const T* dy, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  map_blocks(n, {dy, gate, up}, {dgate, dup},
             [](int64_t len, const float* const* in, float* const* out) {
               const float *dyb = in[0], *gb = in[1], *ub = in[2];
               float *dgb = out[0], *dub = out[1];
#pragma omp simd
               for (int64_t i = 0; i < len; ++i) {
                 float value, derivative;
                 Act::value_and_derivative(gb[i], &value, &derivative);
                 dgb[i] = dyb[i] * ub[i] * derivative;
                 dub[i] = dyb[i] * value;
               }
             });
}

// Calls fn(Act{}) for the functor of `activation`.
template <typename Fn>
void dispatch(Activation activation, Fn&& fn) {
  switch (activation) {
    case Activation::kGeluTanh:
      return fn(GeluTanh{});
    case Activation::kGeluErf:
      return fn(GeluErf{});
    case Activation::kSilu:
      return fn(Silu{});
  }
}

}  // namespace

template <typename T>
void activation_fwd(Activation activation, const T* x, T* y, int64_t n) {
  dispatch(activation, [&](auto act) { unary_fwd<decltype(act)>(x, y, n); });
}

template <typename T>
void activation_bwd(Activation activation, const T* dy, const T* x, T* dx, int64_t n) {
  dispatch(activation, [&](auto act) { unary_bwd<decltype(act)>(dy, x, dx, n); });
}

template <typename T>
void gated_activation_fwd(Activation activation, const T* gate, const T* up, T* y, int64_t n) {
  dispatch(activation, [&](auto act) { gated_fwd<decltype(act)>(gate, up, y, n); });
}

template <typename T>
void gated_activation_bwd(Activation activation, const T* dy, const T* gate, const T* up,
                          T* dgate, T* dup, int64_t n) {
  dispatch(activation,
           [&](auto act) { gated_bwd<decltype(act)>(dy, gate, up, dgate, dup, n); });
}

#define JAXOPS_INSTANTIATE_ACTIVATIONS(T)                                                    \
  template void activation_fwd<T>(Activation, const T*, T*, int64_t);                        \
  template void activation_bwd<T>(Activation, const T*, const T*, T*, int64_t);              \
  template void gated_activation_fwd<T>(Activation, const T*, const T*, T*, int64_t);        \
  template void gated_activation_bwd<T>(Activation, const T*, const T*, const T*, T*, T*,    \
                                        int64_t);

JAXOPS_INSTANTIATE_ACTIVATIONS(float)
JAXOPS_INSTANTIATE_ACTIVATIONS(bfloat16)
JAXOPS_INSTANTIATE_ACTIVATIONS(float16)

}  // namespace jaxops::cpu
