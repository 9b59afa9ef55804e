#include "cuda/activations.h"

#include "cuda/elementwise.cuh"
#include "cuda/fast_math.cuh"
#include "cuda/launch.cuh"
#include "cuda/pack_io.cuh"

namespace jaxops::cuda {
namespace {

using namespace elementwise;
using namespace pack_io;

// sigmoid(z) and 1 - sigmoid(z), each accurate on both tails (see
// cpu/vector_math.h): the complement from whichever form does not cancel.
// e^-z by one ex2 and 1 / (1 + e) by one reciprocal (MUFU.EX2, MUFU.RCP: a
// few ulps, relative on both tails; past z = -87, where 1 + e exceeds 2^126,
// the reciprocal gives 0 where the value is below float32's normal range):
// expf and an IEEE division would cost about 15 instructions an element, half
// of what the memory system leaves a 16-bit activation.
struct Sigmoid {
  float value;
  float complement;
};

__device__ __forceinline__ Sigmoid sigmoid(float z) {
  const float e = fast_exp2(-z * kLog2e);
  const float s = __fdividef(1.0f, 1.0f + e);
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
    *derivative = cdf + x * fast_exp2(-0.5f * kLog2e * clamped * clamped) * kInvSqrt2Pi;
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

// Vectorised grid-stride map: each iteration, a thread loads kUnroll packs of
// every input (spaced a grid apart, so that each warp's load instruction reads
// 512 contiguous bytes), all before the first is used, computes
// fn(inputs, outputs) element by element and stores its packs of every output.
// The elements past the last whole pack (n % kVec of them) are taken one by one.
// A thread writes only the elements it read, so an output may alias an input.
// Packs are 16 bytes when every buffer is 16-byte aligned (kVec = 16 /
// sizeof(T)), else single elements (kVec = 1).
template <typename T, int kVec, int kIn, int kOut, typename Fn>
__device__ __forceinline__ void map_elements(const T* const (&in)[kIn], T* const (&out)[kOut],
                                             int64_t n, Fn fn) {
  constexpr int kUnroll = kIn == 1 ? 4 : 2;
  const int64_t packs = n / kVec;
  const int64_t stride = grid_threads();
  for (int64_t first = global_thread(); first < packs; first += stride * kUnroll) {
    float v[kIn][kUnroll * kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = first + u * stride;
#pragma unroll
      for (int k = 0; k < kIn; ++k) {
        if (p < packs) load_pack<T, kVec>(in[k] + p * kVec, &v[k][u * kVec]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = first + u * stride;
      if (p >= packs) continue;
      float r[kOut][kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float args[kIn], results[kOut];
#pragma unroll
        for (int k = 0; k < kIn; ++k) args[k] = v[k][u * kVec + j];
        fn(args, results);
#pragma unroll
        for (int k = 0; k < kOut; ++k) r[k][j] = results[k];
      }
#pragma unroll
      for (int k = 0; k < kOut; ++k) store_pack<T, kVec>(out[k] + p * kVec, r[k]);
    }
  }
  for (int64_t i = packs * kVec + global_thread(); i < n; i += stride) {
    float args[kIn], results[kOut];
#pragma unroll
    for (int k = 0; k < kIn; ++k) args[k] = to_float(in[k][i]);
    fn(args, results);
#pragma unroll
    for (int k = 0; k < kOut; ++k) out[k][i] = from_float<T>(results[k]);
  }
}

template <typename Act, typename T, int kVec>
__global__ void unary_fwd_kernel(const T* x, T* y, int64_t n) {
  map_elements<T, kVec>({x}, {y}, n, [](const float (&a)[1], float (&r)[1]) {
    r[0] = Act::value(a[0]);
  });
}

template <typename Act, typename T, int kVec>
__global__ void unary_bwd_kernel(const T* dy, const T* x, T* dx, int64_t n) {
  map_elements<T, kVec>({dy, x}, {dx}, n, [](const float (&a)[2], float (&r)[1]) {
    float value, derivative;
    Act::value_and_derivative(a[1], &value, &derivative);
    r[0] = a[0] * derivative;
  });
}

template <typename Act, typename T, int kVec>
__global__ void gated_fwd_kernel(const T* gate, const T* up, T* y, int64_t n) {
  map_elements<T, kVec>({gate, up}, {y}, n, [](const float (&a)[2], float (&r)[1]) {
    r[0] = Act::value(a[0]) * a[1];
  });
}

template <typename Act, typename T, int kVec>
__global__ void gated_bwd_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup,
                                 int64_t n) {
  map_elements<T, kVec>({dy, gate, up}, {dgate, dup}, n, [](const float (&a)[3], float (&r)[2]) {
    float value, derivative;
    Act::value_and_derivative(a[1], &value, &derivative);
    r[0] = a[0] * a[2] * derivative;
    r[1] = a[0] * value;
  });
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

// Launches kernel<Act, T, kVec> with the widest packs every buffer allows, for
// the functor of `activation`: launch(Act{}, pack width as a std::integral_constant,
// the grid).
template <typename T, typename Launch>
cudaError_t launch_map(Activation activation, int64_t n,
                       std::initializer_list<const void*> buffers, Launch&& launch) {
  if (n == 0) return cudaGetLastError();
  return with_pack_width<T>(aligned(buffers), [&](auto pack_width) {
    constexpr int kVec = decltype(pack_width)::value;
    // A thread's first iteration covers kUnroll (at least 2) packs.
    const dim3 grid(grid_for((n / kVec + 1) / 2));
    return dispatch(activation, [&](auto act) { return launch(act, pack_width, grid); });
  });
}

}  // namespace

template <typename T>
cudaError_t activation_fwd(cudaStream_t stream, Activation activation, const T* x, T* y,
                           int64_t n) {
  return launch_map<T>(activation, n, {x, y}, [&](auto act, auto pack_width, dim3 grid) {
    return launch_kernel(unary_fwd_kernel<decltype(act), T, decltype(pack_width)::value>, grid,
                         kThreads, stream, x, y, n);
  });
}

template <typename T>
cudaError_t activation_bwd(cudaStream_t stream, Activation activation, const T* dy, const T* x,
                           T* dx, int64_t n) {
  return launch_map<T>(activation, n, {dy, x, dx}, [&](auto act, auto pack_width, dim3 grid) {
    return launch_kernel(unary_bwd_kernel<decltype(act), T, decltype(pack_width)::value>, grid,
                         kThreads, stream, dy, x, dx, n);
  });
}

template <typename T>
cudaError_t gated_activation_fwd(cudaStream_t stream, Activation activation, const T* gate,
                                 const T* up, T* y, int64_t n) {
  return launch_map<T>(activation, n, {gate, up, y}, [&](auto act, auto pack_width, dim3 grid) {
    return launch_kernel(gated_fwd_kernel<decltype(act), T, decltype(pack_width)::value>, grid,
                         kThreads, stream, gate, up, y, n);
  });
}

template <typename T>
cudaError_t gated_activation_bwd(cudaStream_t stream, Activation activation, const T* dy,
                                 const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  return launch_map<T>(activation, n, {dy, gate, up, dgate, dup},
                       [&](auto act, auto pack_width, dim3 grid) {
    return launch_kernel(gated_bwd_kernel<decltype(act), T, decltype(pack_width)::value>, grid,
                         kThreads, stream, dy, gate, up, dgate, dup, n);
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
