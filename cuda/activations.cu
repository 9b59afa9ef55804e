#include "cuda/activations.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using namespace elementwise;

// sigmoid(z) and 1 - sigmoid(z), each accurate on both tails (see
// cpu/vector_math.h): the complement from whichever form does not cancel.
struct Sigmoid {
  float value;
  float complement;
};

__device__ __forceinline__ Sigmoid sigmoid(float z) {
  const float e = expf(-z);
  const float s = 1.0f / (1.0f + e);
  return {s, s < 0.5f ? 1.0f - s : e * s};
}

struct GeluTanh {
  // 2 sqrt(2/pi) (x + 0.044715 x^3) = x (k0 + k1 x^2)
  static constexpr float k0 = 1.595769122e+00f;
  static constexpr float k1 = 7.135481627e-02f;
  __device__ static float value(float x) { return x * sigmoid(x * (k0 + k1 * x * x)).value; }
  __device__ static void value_and_derivative(float x, float* value, float* derivative) {
    // Past |x| = 20 the sigmoid is 0 or 1 and its derivative 0; the clamp keeps
    // x^2 finite (0 * inf would be NaN). fminf/fmaxf would turn NaN into 20.
    const float clamped = x > 20.0f ? 20.0f : (x < -20.0f ? -20.0f : x);
    const Sigmoid s = sigmoid(clamped * (k0 + k1 * clamped * clamped));
    *value = x * s.value;
    *derivative = s.value + x * s.value * s.complement * (k0 + 3.0f * k1 * clamped * clamped);
  }
};

// Phi(x) = erfc(-x / sqrt 2) / 2: relative accuracy on the lower tail, where
// 1 + erf would cancel.
__device__ __forceinline__ float normal_cdf(float x) {
  constexpr float kMinusInvSqrt2 = -7.071067812e-01f;
  return 0.5f * erfcf(x * kMinusInvSqrt2);
}

struct GeluErf {
  static constexpr float kInvSqrt2Pi = 3.989422804e-01f;
  __device__ static float value(float x) { return x * normal_cdf(x); }
  __device__ static void value_and_derivative(float x, float* value, float* derivative) {
    const float cdf = normal_cdf(x);
    // |x| <= 20 keeps x^2 finite; the density is 0 in float32 from 14.5 on.
    const float clamped = x > 20.0f ? 20.0f : (x < -20.0f ? -20.0f : x);
    *value = x * cdf;
    *derivative = cdf + x * expf(-0.5f * clamped * clamped) * kInvSqrt2Pi;
  }
};

struct Silu {
  __device__ static float value(float x) { return x * sigmoid(x).value; }
  __device__ static void value_and_derivative(float x, float* value, float* derivative) {
    const Sigmoid s = sigmoid(x);
    *value = x * s.value;
    *derivative = s.value * (1.0f + x * s.complement);
  }
};

template <typename Act, typename T>
__global__ void unary_fwd_kernel(const T* x, T* y, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    y[i] = from_float<T>(Act::value(to_float(x[i])));
  }
}

template <typename Act, typename T>
__global__ void unary_bwd_kernel(const T* dy, const T* x, T* dx, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    float value, derivative;
    Act::value_and_derivative(to_float(x[i]), &value, &derivative);
    dx[i] = from_float<T>(to_float(dy[i]) * derivative);
  }
}

template <typename Act, typename T>
__global__ void gated_fwd_kernel(const T* gate, const T* up, T* y, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    y[i] = from_float<T>(Act::value(to_float(gate[i])) * to_float(up[i]));
  }
}

template <typename Act, typename T>
__global__ void gated_bwd_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup,
                                 int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    float value, derivative;
    Act::value_and_derivative(to_float(gate[i]), &value, &derivative);
    const float g = to_float(dy[i]);
    dgate[i] = from_float<T>(g * to_float(up[i]) * derivative);
    dup[i] = from_float<T>(g * value);
  }
}

// Calls fn(Act{}) for the functor of `activation`.
template <typename Fn>
cudaError_t dispatch(Activation activation, Fn&& fn) {
  switch (activation) {
    case Activation::kGeluTanh:
      return fn(GeluTanh{});
    case Activation::kGeluErf:
      return fn(GeluErf{});
    case Activation::kSilu:
      return fn(Silu{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

template <typename T>
cudaError_t activation_fwd(cudaStream_t stream, Activation activation, const T* x, T* y,
                           int64_t n) {
  if (n == 0) return cudaGetLastError();
  return dispatch(activation, [&](auto act) {
    return launch_kernel(unary_fwd_kernel<decltype(act), T>, grid_for(n), kThreads, stream, x, y,
                         n);
  });
}

template <typename T>
cudaError_t activation_bwd(cudaStream_t stream, Activation activation, const T* dy, const T* x,
                           T* dx, int64_t n) {
  if (n == 0) return cudaGetLastError();
  return dispatch(activation, [&](auto act) {
    return launch_kernel(unary_bwd_kernel<decltype(act), T>, grid_for(n), kThreads, stream, dy,
                         x, dx, n);
  });
}

template <typename T>
cudaError_t gated_activation_fwd(cudaStream_t stream, Activation activation, const T* gate,
                                 const T* up, T* y, int64_t n) {
  if (n == 0) return cudaGetLastError();
  return dispatch(activation, [&](auto act) {
    return launch_kernel(gated_fwd_kernel<decltype(act), T>, grid_for(n), kThreads, stream, gate,
                         up, y, n);
  });
}

template <typename T>
cudaError_t gated_activation_bwd(cudaStream_t stream, Activation activation, const T* dy,
                                 const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  if (n == 0) return cudaGetLastError();
  return dispatch(activation, [&](auto act) {
    return launch_kernel(gated_bwd_kernel<decltype(act), T>, grid_for(n), kThreads, stream, dy,
                         gate, up, dgate, dup, n);
  });
}

#define JAXOPS_CUDA_ACTIVATIONS_INSTANTIATE(T)                                                   \
  template cudaError_t activation_fwd<T>(cudaStream_t, Activation, const T*, T*, int64_t);      \
  template cudaError_t activation_bwd<T>(cudaStream_t, Activation, const T*, const T*, T*,      \
                                         int64_t);                                              \
  template cudaError_t gated_activation_fwd<T>(cudaStream_t, Activation, const T*, const T*,    \
                                               T*, int64_t);                                    \
  template cudaError_t gated_activation_bwd<T>(cudaStream_t, Activation, const T*, const T*,    \
                                               const T*, T*, T*, int64_t);

JAXOPS_CUDA_ACTIVATIONS_INSTANTIATE(float)
JAXOPS_CUDA_ACTIVATIONS_INSTANTIATE(__half)
JAXOPS_CUDA_ACTIVATIONS_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
