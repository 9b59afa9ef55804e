#include "cpu/adamw.h"

#include <algorithm>
#include <cmath>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"

namespace jaxops::cpu {
namespace {

namespace hp = ::jaxops::params;

// Elements converted to float32 at a time: a few streams of this fit in L1.
constexpr int64_t kBlock = 2048;
// Below this many elements a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;

// The hyper-parameters read once from `scalars`.
struct Scalars {
  float step, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, weight_decay, c1, c2, c1_next,
      b1_moment;
};

// The operation order follows optax.adamw (scale_by_adam, add_decayed_weights,
// scale_by_learning_rate) so the two agree to rounding.
template <bool kApply, bool kDecay, bool kNesterov>
void adamw_block(const float* g, const float* p, const float* m, const float* v, float* out,
                 float* m_out, float* v_out, int64_t len, const Scalars& s) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float mi = s.one_minus_b1 * g[i] + s.b1_moment * m[i];
    const float vi = s.one_minus_b2 * (g[i] * g[i]) + s.b2 * v[i];
    const float m_hat = kNesterov ? s.b1 * (mi / s.c1_next) + s.one_minus_b1 * (g[i] / s.c1)
                                  : mi / s.c1;
    float u = m_hat / (std::sqrt(vi / s.c2 + s.eps_root) + s.eps);
    if constexpr (kDecay) u = u + s.weight_decay * p[i];
    u = s.step * u;
    out[i] = kApply ? p[i] + u : u;
    m_out[i] = mi;
    v_out[i] = vi;
  }
}

using BlockFn = void (*)(const float*, const float*, const float*, const float*, float*, float*,
                         float*, int64_t, const Scalars&);

template <bool kApply, bool kDecay>
BlockFn pick_nesterov(bool nesterov) {
  return nesterov ? adamw_block<kApply, kDecay, true> : adamw_block<kApply, kDecay, false>;
}

// The block function with the options compiled in (no branch per element).
BlockFn pick_block(AdamWOptions o) {
  if (o.apply_updates) {
    return o.decay ? pick_nesterov<true, true>(o.nesterov) : pick_nesterov<true, false>(o.nesterov);
  }
  return o.decay ? pick_nesterov<false, true>(o.nesterov) : pick_nesterov<false, false>(o.nesterov);
}

}  // namespace

template <typename T, typename M>
void adamw(const T* grads, const T* params, const M* m, const float* v, const float* scalars,
           T* out, M* m_out, float* v_out, int64_t n, AdamWOptions options) {
  const Scalars s{scalars[hp::kAdamWStepSize],    scalars[hp::kAdamWB1],
                  scalars[hp::kAdamWOneMinusB1],  scalars[hp::kAdamWB2],
                  scalars[hp::kAdamWOneMinusB2],  scalars[hp::kAdamWEps],
                  scalars[hp::kAdamWEpsRoot],     scalars[hp::kAdamWWeightDecay],
                  scalars[hp::kAdamWC1],          scalars[hp::kAdamWC2],
                  scalars[hp::kAdamWC1Next],      scalars[hp::kAdamWB1Moment]};
  const BlockFn block = pick_block(options);
  // Only fresh outputs gain from the advice; aliased ones are already mapped.
  if (static_cast<const void*>(out) != static_cast<const void*>(params) &&
      static_cast<const void*>(out) != static_cast<const void*>(grads)) {
    advise_huge_pages(out, sizeof(T) * n);
  }
  if (m_out != m) advise_huge_pages(m_out, sizeof(M) * n);
  if (v_out != v) advise_huge_pages(v_out, sizeof(float) * n);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kMinParallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
    alignas(64) float g_buf[kBlock], p_buf[kBlock], m_buf[kBlock], out_buf[kBlock],
        m_out_buf[kBlock];
    const float* g = read_as_float(grads + begin, len, g_buf);
    // The parameters are read only where the step uses them.
    const float* p = options.decay || options.apply_updates
                         ? read_as_float(params + begin, len, p_buf)
                         : g;
    const float* mb = read_as_float(m + begin, len, m_buf);
    float* o = result_target(out + begin, out_buf);
    float* mo = result_target(m_out + begin, m_out_buf);
    block(g, p, mb, v + begin, o, mo, v_out + begin, len, s);
    commit_result(o, out + begin, len);
    commit_result(mo, m_out + begin, len);
  }
}

#define JAXOPS_INSTANTIATE_ADAMW(T, M)                                                       \
  template void adamw<T, M>(const T*, const T*, const M*, const float*, const float*, T*, M*, \
                            float*, int64_t, AdamWOptions);

JAXOPS_INSTANTIATE_ADAMW(float, float)
JAXOPS_INSTANTIATE_ADAMW(bfloat16, float)
JAXOPS_INSTANTIATE_ADAMW(float16, float)
JAXOPS_INSTANTIATE_ADAMW(float, bfloat16)
JAXOPS_INSTANTIATE_ADAMW(bfloat16, bfloat16)
JAXOPS_INSTANTIATE_ADAMW(float16, bfloat16)
JAXOPS_INSTANTIATE_ADAMW(float, float16)
JAXOPS_INSTANTIATE_ADAMW(bfloat16, float16)
JAXOPS_INSTANTIATE_ADAMW(float16, float16)

}  // namespace jaxops::cpu
