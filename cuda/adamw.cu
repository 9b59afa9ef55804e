#include "cuda/adamw.h"

#include <climits>
#include <type_traits>

#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

namespace hp = ::jaxops::params;
using hp::AdamWFloat;

// Work layout. The leaves of a launch are cut into tiles of kTile elements,
// one tile per block (the last tile of a leaf may be short); a block finds its
// leaf by a binary search of the table's first tiles (uniform across the
// block, in the constant bank). A thread owns kPerThread elements of its tile
// as 16-byte packs of the leaf's parameter type (two packs of 4 float32, one of
// 8 bfloat16/float16), consecutive threads owning consecutive packs, so each
// load or store instruction of a warp moves one contiguous 512-byte span (a
// first moment or v wider than the parameters: two or one 16-byte accesses
// per pack, 8 bytes for a 16-bit moment of float32 parameters). Every load of
// a thread is issued before its first store: 64-128 bytes in flight per
// thread (docs/cuda.md has the occupancy and bytes-in-flight plan). A leaf
// whose buffers are not all 16-byte aligned, and the short last tile, take
// the element-wise path over the same layout.
constexpr int kThreads = 256;
constexpr int kPerThread = 8;
constexpr int64_t kTile = int64_t{kThreads} * kPerThread;

// The kernel's parameter: one launch's leaves. Leaf i covers the tiles
// [first_tile[i], first_tile[i + 1]) (the last leaf up to the grid's end).
struct LeafTable {
  hp::AdamWLeaf leaf[kAdamWLeavesPerLaunch];
  int64_t first_tile[kAdamWLeavesPerLaunch];
  bool packed[kAdamWLeavesPerLaunch];  // every buffer 16-byte aligned: 16-byte accesses
  int count;
};
// The most a kernel's parameters may hold (CUDA 12.1 and later, sm_70 and
// later, a driver of the R530 series or newer; 4 KiB before).
static_assert(sizeof(LeafTable) + sizeof(const float*) <= 32764,
              "the leaf table must fit in the kernel's parameters");

struct Scalars {
  float step, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, weight_decay, c1, c2, c1_next,
      b1_moment;
};

__device__ __forceinline__ Scalars read_scalars(const float* s, AdamWFloat moment) {
  return Scalars{s[hp::kAdamWStepSize],    s[hp::kAdamWB1],
                 s[hp::kAdamWOneMinusB1],  s[hp::kAdamWB2],
                 s[hp::kAdamWOneMinusB2],  s[hp::kAdamWEps],
                 s[hp::kAdamWEpsRoot],     s[hp::kAdamWWeightDecay],
                 s[hp::kAdamWC1],          s[hp::kAdamWC2],
                 s[hp::kAdamWC1Next],      s[hp::kAdamWB1Moment + static_cast<int>(moment)]};
}

// One element, in optax.adamw's operation order (scale_by_adam,
// add_decayed_weights, scale_by_learning_rate), as cpu/adamw.cc computes it;
// IEEE division and square root (the CPU's rounding). `out` is the update or,
// with kApply, the new parameter.
template <bool kApply, bool kNesterov>
__device__ __forceinline__ void adamw_element(float g, float p, float m, float v, bool decay,
                                              const Scalars& s, float& out, float& m_out,
                                              float& v_out) {
  const float mi = s.one_minus_b1 * g + s.b1_moment * m;
  const float vi = s.one_minus_b2 * (g * g) + s.b2 * v;
  const float m_hat = kNesterov
                          ? s.b1 * __fdiv_rn(mi, s.c1_next) + s.one_minus_b1 * __fdiv_rn(g, s.c1)
                          : __fdiv_rn(mi, s.c1);
  float u = __fdiv_rn(m_hat, __fsqrt_rn(__fdiv_rn(vi, s.c2) + s.eps_root) + s.eps);
  if (decay) u = u + s.weight_decay * p;
  u = s.step * u;
  out = kApply ? p + u : u;
  m_out = mi;
  v_out = vi;
}

// kV consecutive elements of U, moved as whole 16-byte (or one 8-byte) accesses.
template <typename U, int kV>
struct Pack {
  static constexpr int kBytes = kV * static_cast<int>(sizeof(U));
  static_assert(kBytes == 8 || kBytes % 16 == 0, "packs are 8 bytes or whole 16-byte vectors");
  using Raw = typename std::conditional<kBytes == 8, uint2, uint4>::type;
  static constexpr int kRaws = kBytes == 8 ? 1 : kBytes / 16;
  union {
    Raw raw[kRaws];
    U values[kV];
  };

  __device__ __forceinline__ void load(const U* p) {
#pragma unroll
    for (int r = 0; r < kRaws; ++r) raw[r] = reinterpret_cast<const Raw*>(p)[r];
  }
  __device__ __forceinline__ void store(U* p) const {
#pragma unroll
    for (int r = 0; r < kRaws; ++r) reinterpret_cast<Raw*>(p)[r] = raw[r];
  }
};

template <typename U, int kV>
__device__ __forceinline__ void load_floats(const U* p, float (&out)[kV]) {
  Pack<U, kV> pack;
  pack.load(p);
#pragma unroll
  for (int j = 0; j < kV; ++j) out[j] = to_float(pack.values[j]);
}

template <typename U, int kV>
__device__ __forceinline__ void store_floats(U* p, const float (&in)[kV]) {
  Pack<U, kV> pack;
#pragma unroll
  for (int j = 0; j < kV; ++j) pack.values[j] = from_float<U>(in[j]);
  pack.store(p);
}

// This thread's elements of the tile at `begin` of a leaf whose grads, params
// and out are T and first moment M.
template <typename T, typename M, bool kApply, bool kNesterov>
__device__ __forceinline__ void adamw_tile(const hp::AdamWLeaf& leaf, bool packed, int64_t begin,
                                           const float* scalars) {
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  constexpr int kPacks = kPerThread / kV;
  const Scalars s = read_scalars(scalars, leaf.moment);
  const T* grads = static_cast<const T*>(leaf.grads);
  const T* params = static_cast<const T*>(leaf.params);
  const M* m = static_cast<const M*>(leaf.m);
  T* out = static_cast<T*>(leaf.out);
  M* m_out = static_cast<M*>(leaf.m_out);
  const bool decay = leaf.decay;
  // The parameters are read only where the step uses them.
  const bool reads_params = kApply || decay;
  if (packed && begin + kTile <= leaf.size) {
    float g[kPacks][kV], p[kPacks][kV], mv[kPacks][kV], v[kPacks][kV];
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t e = begin + (int64_t{i} * kThreads + threadIdx.x) * kV;
      load_floats(grads + e, g[i]);
      if (reads_params) {
        load_floats(params + e, p[i]);
      } else {
#pragma unroll
        for (int j = 0; j < kV; ++j) p[i][j] = 0.0f;
      }
      load_floats(m + e, mv[i]);
      load_floats(leaf.v + e, v[i]);
    }
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t e = begin + (int64_t{i} * kThreads + threadIdx.x) * kV;
      float o[kV], mo[kV], vo[kV];
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        adamw_element<kApply, kNesterov>(g[i][j], p[i][j], mv[i][j], v[i][j], decay, s, o[j],
                                         mo[j], vo[j]);
      }
      store_floats(out + e, o);
      store_floats(m_out + e, mo);
      store_floats(leaf.v_out + e, vo);
    }
    return;
  }
  for (int i = 0; i < kPacks; ++i) {
    for (int j = 0; j < kV; ++j) {
      const int64_t e = begin + (int64_t{i} * kThreads + threadIdx.x) * kV + j;
      if (e >= leaf.size) continue;
      float o, mo, vo;
      adamw_element<kApply, kNesterov>(to_float(grads[e]), reads_params ? to_float(params[e]) : 0.0f,
                                       to_float(m[e]), leaf.v[e], decay, s, o, mo, vo);
      out[e] = from_float<T>(o);
      m_out[e] = from_float<M>(mo);
      leaf.v_out[e] = vo;
    }
  }
}

template <typename T, bool kApply, bool kNesterov>
__device__ __forceinline__ void adamw_tile_of(const hp::AdamWLeaf& leaf, bool packed,
                                              int64_t begin, const float* scalars) {
  switch (leaf.moment) {
    case AdamWFloat::kBFloat16:
      return adamw_tile<T, __nv_bfloat16, kApply, kNesterov>(leaf, packed, begin, scalars);
    case AdamWFloat::kFloat16:
      return adamw_tile<T, __half, kApply, kNesterov>(leaf, packed, begin, scalars);
    default:
      return adamw_tile<T, float, kApply, kNesterov>(leaf, packed, begin, scalars);
  }
}

// The storage types are per leaf, so a block switches on its leaf's (the
// branch is uniform across the block); the options are template parameters.
template <bool kApply, bool kNesterov>
__global__ void __launch_bounds__(kThreads, 2)
    adamw_kernel(const __grid_constant__ LeafTable table, const float* scalars) {
  const int64_t tile = blockIdx.x;
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_tile[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const hp::AdamWLeaf& leaf = table.leaf[lo];
  const bool packed = table.packed[lo];
  const int64_t begin = (tile - table.first_tile[lo]) * kTile;
  switch (leaf.type) {
    case AdamWFloat::kBFloat16:
      return adamw_tile_of<__nv_bfloat16, kApply, kNesterov>(leaf, packed, begin, scalars);
    case AdamWFloat::kFloat16:
      return adamw_tile_of<__half, kApply, kNesterov>(leaf, packed, begin, scalars);
    default:
      return adamw_tile_of<float, kApply, kNesterov>(leaf, packed, begin, scalars);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

cudaError_t launch(cudaStream_t stream, const LeafTable& table, int64_t tiles,
                   const float* scalars, AdamWOptions o) {
  if (tiles > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(tiles));
  if (o.apply_updates) {
    return o.nesterov ? launch_kernel(adamw_kernel<true, true>, grid, kThreads, stream, table, scalars)
                      : launch_kernel(adamw_kernel<true, false>, grid, kThreads, stream, table, scalars);
  }
  return o.nesterov ? launch_kernel(adamw_kernel<false, true>, grid, kThreads, stream, table, scalars)
                    : launch_kernel(adamw_kernel<false, false>, grid, kThreads, stream, table, scalars);
}

}  // namespace

cudaError_t adamw(cudaStream_t stream, const AdamWLeaf* leaves, int64_t count,
                  const float* scalars, AdamWOptions options) {
  // Passed by value into the launch's parameters, so reused for every launch.
  static thread_local LeafTable table;
  table.count = 0;
  int64_t tiles = 0;
  for (int64_t i = 0; i <= count; ++i) {
    const bool full = table.count == kAdamWLeavesPerLaunch;
    if ((i == count || full) && table.count > 0) {
      const cudaError_t status = launch(stream, table, tiles, scalars, options);
      if (status != cudaSuccess) return status;
      table.count = 0;
      tiles = 0;
    }
    if (i == count) break;
    const AdamWLeaf& leaf = leaves[i];
    if (leaf.size == 0) continue;  // no tile
    const int k = table.count++;
    table.leaf[k] = leaf;
    table.first_tile[k] = tiles;
    table.packed[k] = aligned16(leaf.grads) && aligned16(leaf.params) && aligned16(leaf.m) &&
                      aligned16(leaf.v) && aligned16(leaf.out) && aligned16(leaf.m_out) &&
                      aligned16(leaf.v_out);
    tiles += (leaf.size + kTile - 1) / kTile;
  }
  return cudaGetLastError();
}

}  // namespace jaxops::cuda
