#include "cpu/adamw.h"

#include <algorithm>
#include <cmath>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"

namespace jaxops::cpu {
namespace {

// Elements converted to float32 at a time: a few streams of this fit in L1.
constexpr int64_t kBlock = 2048;
// Below this many elements a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;

// The operation order follows optax.adamw (scale_by_adam, add_decayed_weights,
// scale_by_learning_rate) so the two agree to rounding.
template <bool kApply, bool kDecay>
void adamw_block(const float* g, const float* p, const float* m, const float* v, float* out,
                 float* m_out, float* v_out, int64_t len, AdamWHyperparameters h, float lr,
                 float c1, float c2) {
  const float step = -lr;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float mi = h.one_minus_b1 * g[i] + h.b1 * m[i];
    const float vi = h.one_minus_b2 * (g[i] * g[i]) + h.b2 * v[i];
    float u = (mi / c1) / (std::sqrt(vi / c2) + h.eps);
    if constexpr (kDecay) u = u + h.weight_decay * p[i];
    u = step * u;
    out[i] = kApply ? p[i] + u : u;
    m_out[i] = mi;
    v_out[i] = vi;
  }
}

}  // namespace

template <typename T>
void adamw(const T* grads, const T* params, const float* m, const float* v, const float* scalars,
           T* out, float* m_out, float* v_out, int64_t n, AdamWHyperparameters hyper,
           bool apply_updates) {
  const float lr = scalars[0], c1 = scalars[1], c2 = scalars[2];
  // optax skips the decay term when weight_decay is 0 (so 0 * inf is no NaN).
  const bool decay = hyper.weight_decay != 0.0f;
  // Only fresh outputs gain from the advice; aliased ones are already mapped.
  if (static_cast<const void*>(out) != static_cast<const void*>(params) &&
      static_cast<const void*>(out) != static_cast<const void*>(grads)) {
    advise_huge_pages(out, sizeof(T) * n);
  }
  if (m_out != m) advise_huge_pages(m_out, sizeof(float) * n);
  if (v_out != v) advise_huge_pages(v_out, sizeof(float) * n);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kMinParallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
    alignas(64) float g_buf[kBlock], p_buf[kBlock], out_buf[kBlock];
    const float* g = read_as_float(grads + begin, len, g_buf);
    const float* p = read_as_float(params + begin, len, p_buf);
    float* o = result_target(out + begin, out_buf);
    const float* mb = m + begin;
    const float* vb = v + begin;
    float* mo = m_out + begin;
    float* vo = v_out + begin;
    if (apply_updates) {
      if (decay) {
        adamw_block<true, true>(g, p, mb, vb, o, mo, vo, len, hyper, lr, c1, c2);
      } else {
        adamw_block<true, false>(g, p, mb, vb, o, mo, vo, len, hyper, lr, c1, c2);
      }
    } else {
      if (decay) {
        adamw_block<false, true>(g, p, mb, vb, o, mo, vo, len, hyper, lr, c1, c2);
      } else {
        adamw_block<false, false>(g, p, mb, vb, o, mo, vo, len, hyper, lr, c1, c2);
      }
    }
    commit_result(o, out + begin, len);
  }
}

#define JAXOPS_INSTANTIATE_ADAMW(T)                                                            \
  template void adamw<T>(const T*, const T*, const float*, const float*, const float*, T*,     \
                         float*, float*, int64_t, AdamWHyperparameters, bool);

JAXOPS_INSTANTIATE_ADAMW(float)
JAXOPS_INSTANTIATE_ADAMW(bfloat16)
JAXOPS_INSTANTIATE_ADAMW(float16)

}  // namespace jaxops::cpu
