#include "cuda/adamw.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using namespace elementwise;
namespace hp = ::jaxops::params;

// The operation order follows optax.adamw (scale_by_adam, add_decayed_weights,
// scale_by_learning_rate), as cpu/adamw.cc does. Each element is read before
// its outputs are written, so outputs may alias inputs. The options are
// template parameters: no branch per element.
template <typename T, typename M, bool kApply, bool kDecay, bool kNesterov>
__global__ void adamw_kernel(const T* grads, const T* params, const M* m, const float* v,
                             const float* scalars, T* out, M* m_out, float* v_out, int64_t n) {
  const float step = scalars[hp::kAdamWStepSize], b1 = scalars[hp::kAdamWB1],
              one_minus_b1 = scalars[hp::kAdamWOneMinusB1], b2 = scalars[hp::kAdamWB2],
              one_minus_b2 = scalars[hp::kAdamWOneMinusB2], eps = scalars[hp::kAdamWEps],
              eps_root = scalars[hp::kAdamWEpsRoot],
              weight_decay = scalars[hp::kAdamWWeightDecay], c1 = scalars[hp::kAdamWC1],
              c2 = scalars[hp::kAdamWC2], c1_next = scalars[hp::kAdamWC1Next],
              b1_moment = scalars[hp::kAdamWB1Moment];
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float g = to_float(grads[i]);
    const float p = kDecay || kApply ? to_float(params[i]) : 0.0f;
    const float mi = one_minus_b1 * g + b1_moment * to_float(m[i]);
    const float vi = one_minus_b2 * (g * g) + b2 * v[i];
    const float m_hat = kNesterov ? b1 * __fdiv_rn(mi, c1_next) + one_minus_b1 * __fdiv_rn(g, c1)
                                  : __fdiv_rn(mi, c1);
    float u = __fdiv_rn(m_hat, __fsqrt_rn(__fdiv_rn(vi, c2) + eps_root) + eps);
    if (kDecay) u = u + weight_decay * p;
    u = step * u;
    out[i] = from_float<T>(kApply ? p + u : u);
    m_out[i] = from_float<M>(mi);
    v_out[i] = vi;
  }
}

template <typename T, typename M, bool kApply, bool kDecay>
cudaError_t launch_nesterov(cudaStream_t stream, const T* grads, const T* params, const M* m,
                            const float* v, const float* scalars, T* out, M* m_out,
                            float* v_out, int64_t n, bool nesterov) {
  auto kernel = nesterov ? adamw_kernel<T, M, kApply, kDecay, true>
                         : adamw_kernel<T, M, kApply, kDecay, false>;
  return launch_kernel(kernel, grid_for(n), kThreads, stream, grads, params, m, v, scalars, out,
                       m_out, v_out, n);
}

}  // namespace

template <typename T, typename M>
cudaError_t adamw(cudaStream_t stream, const T* grads, const T* params, const M* m,
                  const float* v, const float* scalars, T* out, M* m_out, float* v_out,
                  int64_t n, AdamWOptions o) {
  if (n == 0) return cudaGetLastError();
  if (o.apply_updates) {
    return o.decay ? launch_nesterov<T, M, true, true>(stream, grads, params, m, v, scalars, out,
                                                       m_out, v_out, n, o.nesterov)
                   : launch_nesterov<T, M, true, false>(stream, grads, params, m, v, scalars,
                                                        out, m_out, v_out, n, o.nesterov);
  }
  return o.decay ? launch_nesterov<T, M, false, true>(stream, grads, params, m, v, scalars, out,
                                                      m_out, v_out, n, o.nesterov)
                 : launch_nesterov<T, M, false, false>(stream, grads, params, m, v, scalars, out,
                                                       m_out, v_out, n, o.nesterov);
}

#define JAXOPS_CUDA_ADAMW_INSTANTIATE(T, M)                                               \
  template cudaError_t adamw<T, M>(cudaStream_t, const T*, const T*, const M*,            \
                                   const float*, const float*, T*, M*, float*, int64_t,   \
                                   AdamWOptions);

JAXOPS_CUDA_ADAMW_INSTANTIATE(float, float)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__half, float)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__nv_bfloat16, float)
JAXOPS_CUDA_ADAMW_INSTANTIATE(float, __nv_bfloat16)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__half, __nv_bfloat16)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
JAXOPS_CUDA_ADAMW_INSTANTIATE(float, __half)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__nv_bfloat16, __half)
JAXOPS_CUDA_ADAMW_INSTANTIATE(__half, __half)

}  // namespace jaxops::cuda
