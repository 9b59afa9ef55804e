#include "cpu/activations.h"

#include <algorithm>
#include <type_traits>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
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

// Blocks of the flat range [0, n), split into contiguous runs per thread.
template <typename Fn>
void for_each_block(int64_t n, Fn&& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kMinParallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock;
    fn(begin, std::min(kBlock, n - begin));
  }
}

// A block of T as float32: the data itself when T is float, else converted
// into `buffer`.
template <typename T>
const float* read_block(const T* src, int64_t len, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, buffer, len);
    return buffer;
  }
}

// Where a float32 result block is computed: the output itself when T is float,
// else `buffer`, stored by write_block.
template <typename T>
float* block_target(T* dst, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return buffer;
  }
}

template <typename T>
void write_block(const float* buffer, T* dst, int64_t len) {
  if constexpr (!std::is_same_v<T, float>) store_row(buffer, dst, len);
}

template <typename Act, typename T>
void unary_fwd(const T* x, T* y, int64_t n) {
  advise_huge_pages(y, sizeof(T) * n);
  for_each_block(n, [&](int64_t begin, int64_t len) {
    alignas(64) float x_buf[kBlock], y_buf[kBlock];
    const float* xb = read_block(x + begin, len, x_buf);
    float* yb = block_target(y + begin, y_buf);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) yb[i] = Act::value(xb[i]);
    write_block(yb, y + begin, len);
  });
}

template <typename Act, typename T>
void unary_bwd(const T* dy, const T* x, T* dx, int64_t n) {
  advise_huge_pages(dx, sizeof(T) * n);
  for_each_block(n, [&](int64_t begin, int64_t len) {
    alignas(64) float x_buf[kBlock], dy_buf[kBlock], dx_buf[kBlock];
    const float* xb = read_block(x + begin, len, x_buf);
    const float* dyb = read_block(dy + begin, len, dy_buf);
    float* dxb = block_target(dx + begin, dx_buf);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      float value, derivative;
      Act::value_and_derivative(xb[i], &value, &derivative);
      dxb[i] = dyb[i] * derivative;
    }
    write_block(dxb, dx + begin, len);
  });
}

template <typename Act, typename T>
void gated_fwd(const T* gate, const T* up, T* y, int64_t n) {
  advise_huge_pages(y, sizeof(T) * n);
  for_each_block(n, [&](int64_t begin, int64_t len) {
    alignas(64) float gate_buf[kBlock], up_buf[kBlock], y_buf[kBlock];
    const float* gb = read_block(gate + begin, len, gate_buf);
    const float* ub = read_block(up + begin, len, up_buf);
    float* yb = block_target(y + begin, y_buf);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) yb[i] = Act::value(gb[i]) * ub[i];
    write_block(yb, y + begin, len);
  });
}

template <typename Act, typename T>
void gated_bwd(const T* dy, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  advise_huge_pages(dgate, sizeof(T) * n);
  advise_huge_pages(dup, sizeof(T) * n);
  for_each_block(n, [&](int64_t begin, int64_t len) {
    alignas(64) float dy_buf[kBlock], gate_buf[kBlock], up_buf[kBlock], dgate_buf[kBlock],
        dup_buf[kBlock];
    const float* dyb = read_block(dy + begin, len, dy_buf);
    const float* gb = read_block(gate + begin, len, gate_buf);
    const float* ub = read_block(up + begin, len, up_buf);
    float* dgb = block_target(dgate + begin, dgate_buf);
    float* dub = block_target(dup + begin, dup_buf);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      float value, derivative;
      Act::value_and_derivative(gb[i], &value, &derivative);
      dgb[i] = dyb[i] * ub[i] * derivative;
      dub[i] = dyb[i] * value;
    }
    write_block(dgb, dgate + begin, len);
    write_block(dub, dup + begin, len);
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
