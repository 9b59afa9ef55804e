#include "cuda/adamw.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using namespace elementwise;

// The operation order follows optax.adamw (scale_by_adam, add_decayed_weights,
// scale_by_learning_rate), as cpu/adamw.cc does. Each element is read before
// its outputs are written, so outputs may alias inputs.
template <typename T>
__global__ void adamw_kernel(const T* grads, const T* params, const float* m, const float* v,
                             const float* scalars, T* out, float* m_out, float* v_out, int64_t n,
                             AdamWHyperparameters h, bool apply_updates) {
  const float lr = scalars[0], c1 = scalars[1], c2 = scalars[2];
  const float step = -lr;
  // optax skips the decay term when weight_decay is 0 (so 0 * inf is no NaN).
  const bool decay = h.weight_decay != 0.0f;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float g = to_float(grads[i]);
    const float p = decay || apply_updates ? to_float(params[i]) : 0.0f;
    const float mi = h.one_minus_b1 * g + h.b1 * m[i];
    const float vi = h.one_minus_b2 * (g * g) + h.b2 * v[i];
    float u = __fdiv_rn(__fdiv_rn(mi, c1), __fsqrt_rn(__fdiv_rn(vi, c2)) + h.eps);
    if (decay) u = u + h.weight_decay * p;
    u = step * u;
    out[i] = from_float<T>(apply_updates ? p + u : u);
    m_out[i] = mi;
    v_out[i] = vi;
  }
}

}  // namespace

template <typename T>
cudaError_t adamw(cudaStream_t stream, const T* grads, const T* params, const float* m,
                  const float* v, const float* scalars, T* out, float* m_out, float* v_out,
                  int64_t n, AdamWHyperparameters hyper, bool apply_updates) {
  if (n == 0) return cudaGetLastError();
  return launch_kernel(adamw_kernel<T>, grid_for(n), kThreads, stream, grads, params, m, v,
                       scalars, out, m_out, v_out, n, hyper, apply_updates);
}

#define JAXOPS_CUDA_ADAMW_INSTANTIATE(T)                                                    \
  template cudaError_t adamw<T>(cudaStream_t, const T*, const T*, const float*,             \
                                const float*, const float*, T*, float*, float*, int64_t,    \
                                AdamWHyperparameters, bool);

JAXOPS_CUDA_ADAMW_INSTANTIATE(float)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__half)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
