#include "cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/row_buffer.h"

namespace jaxops::cpu {
namespace {

namespace hp = ::jaxops::params;
using hp::AdamWFloat;

// Elements converted to float32 at a time: a few streams of this fit in L1.
constexpr int64_t kBlock = 2048;
// Below this many elements in all a second thread costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;

// The hyper-parameters read once from `scalars` (b1_moment: the leaf's).
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

// A thread's float32 copies of a block of the 16-bit arrays.
struct BlockBuffers {
  alignas(64) float g[kBlock];
  alignas(64) float p[kBlock];
  alignas(64) float m[kBlock];
  alignas(64) float out[kBlock];
  alignas(64) float m_out[kBlock];
};

// Elements [begin, begin + len) of a leaf whose grads/params/out are T and
// first moment M, converted to float32 a block at a time; the options are
// compiled in (no branch per element).
template <typename T, typename M, bool kApply, bool kDecay, bool kNesterov>
void adamw_range(const AdamWLeaf& leaf, int64_t begin, int64_t len, const Scalars& s,
                 BlockBuffers& b) {
  T* out = static_cast<T*>(leaf.out) + begin;
  M* m_out = static_cast<M*>(leaf.m_out) + begin;
  const float* g = read_as_float(static_cast<const T*>(leaf.grads) + begin, len, b.g);
  // The parameters are read only where the step uses them.
  const float* p =
      kApply || kDecay ? read_as_float(static_cast<const T*>(leaf.params) + begin, len, b.p) : g;
  const float* m = read_as_float(static_cast<const M*>(leaf.m) + begin, len, b.m);
  float* o = result_target(out, b.out);
  float* mo = result_target(m_out, b.m_out);
  adamw_block<kApply, kDecay, kNesterov>(g, p, m, leaf.v + begin, o, mo, leaf.v_out + begin, len,
                                         s);
  commit_result(o, out, len);
  commit_result(mo, m_out, len);
}

using RangeFn = void (*)(const AdamWLeaf&, int64_t, int64_t, const Scalars&, BlockBuffers&);

template <typename T, typename M, bool kApply, bool kDecay>
RangeFn pick_nesterov(bool nesterov) {
  return nesterov ? adamw_range<T, M, kApply, kDecay, true>
                  : adamw_range<T, M, kApply, kDecay, false>;
}

template <typename T, typename M>
RangeFn pick_options(AdamWOptions o, bool decay) {
  if (o.apply_updates) {
    return decay ? pick_nesterov<T, M, true, true>(o.nesterov)
                 : pick_nesterov<T, M, true, false>(o.nesterov);
  }
  return decay ? pick_nesterov<T, M, false, true>(o.nesterov)
               : pick_nesterov<T, M, false, false>(o.nesterov);
}

template <typename T>
RangeFn pick_moment(AdamWFloat moment, AdamWOptions o, bool decay) {
  switch (moment) {
    case AdamWFloat::kBFloat16: return pick_options<T, bfloat16>(o, decay);
    case AdamWFloat::kFloat16: return pick_options<T, float16>(o, decay);
    default: return pick_options<T, float>(o, decay);
  }
}

// What runs a leaf's blocks: its types and the call's and leaf's options.
RangeFn pick_range(const AdamWLeaf& leaf, AdamWOptions o) {
  switch (leaf.type) {
    case AdamWFloat::kBFloat16: return pick_moment<bfloat16>(leaf.moment, o, leaf.decay);
    case AdamWFloat::kFloat16: return pick_moment<float16>(leaf.moment, o, leaf.decay);
    default: return pick_moment<float>(leaf.moment, o, leaf.decay);
  }
}

size_t element_bytes(AdamWFloat type) { return type == AdamWFloat::kFloat32 ? 4 : 2; }

// What a leaf's blocks run, chosen once per leaf.
struct LeafPlan {
  RangeFn range;
  Scalars scalars;
  int64_t first_block;  // the leaf's first block among all the leaves'
};

}  // namespace

void adamw(const AdamWLeaf* leaves, int64_t count, const float* scalars, AdamWOptions options) {
  std::vector<LeafPlan> plans(static_cast<size_t>(count));
  int64_t blocks = 0, elements = 0;
  for (int64_t i = 0; i < count; ++i) {
    const AdamWLeaf& leaf = leaves[i];
    const Scalars s{scalars[hp::kAdamWStepSize],    scalars[hp::kAdamWB1],
                    scalars[hp::kAdamWOneMinusB1],  scalars[hp::kAdamWB2],
                    scalars[hp::kAdamWOneMinusB2],  scalars[hp::kAdamWEps],
                    scalars[hp::kAdamWEpsRoot],     scalars[hp::kAdamWWeightDecay],
                    scalars[hp::kAdamWC1],          scalars[hp::kAdamWC2],
                    scalars[hp::kAdamWC1Next],
                    scalars[hp::kAdamWB1Moment + static_cast<int>(leaf.moment)]};
    plans[i] = LeafPlan{pick_range(leaf, options), s, blocks};
    blocks += (leaf.size + kBlock - 1) / kBlock;
    elements += leaf.size;
    // Only fresh outputs gain from the advice; aliased ones are already mapped.
    if (leaf.out != leaf.params && leaf.out != leaf.grads) {
      advise_huge_pages(leaf.out, element_bytes(leaf.type) * leaf.size);
    }
    if (leaf.m_out != leaf.m) advise_huge_pages(leaf.m_out, element_bytes(leaf.moment) * leaf.size);
    if (leaf.v_out != leaf.v) advise_huge_pages(leaf.v_out, sizeof(float) * leaf.size);
  }
#pragma omp parallel for schedule(static) if (elements >= kMinParallel)
  for (int64_t b = 0; b < blocks; ++b) {
    // The leaf of block b: the last whose first block is at most b (an empty
    // leaf has no block and shares its first block with the next).
    const auto after = std::upper_bound(plans.begin(), plans.end(), b,
                                        [](int64_t x, const LeafPlan& p) { return x < p.first_block; });
    const int64_t i = (after - plans.begin()) - 1;
    const LeafPlan& plan = plans[i];
    const int64_t begin = (b - plan.first_block) * kBlock;
    BlockBuffers buffers;
    plan.range(leaves[i], begin, std::min(kBlock, leaves[i].size - begin), plan.scalars,
               buffers);
  }
}

}  // namespace jaxops::cpu
