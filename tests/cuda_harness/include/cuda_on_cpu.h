// Test-only: the CUDA C++ device and runtime API emulated on the CPU, so that the
// UNCHANGED kernel sources of cuda/ compile with g++ (force-included with
// `-include cuda_on_cpu.h`; the <cuda_*.h> and <mma.h> of this directory include
// it too) and run through tests/cuda_harness/runtime.cc. Never shipped.
//
// Execution model (runtime.cc): the blocks of a grid run one after another; the
// threads of a block run as fibers (default) or as OS threads (for
// ThreadSanitizer). __syncthreads is a real barrier; warp-collective intrinsics
// (shuffles, votes, __syncwarp, wmma) wait for every lane named in their mask and
// follow the PTX semantics. Barrier divergence, a lane missing from a warp
// collective and deadlock are reported as a failed launch (cudaErrorLaunchFailure,
// message from cudaGetErrorString) instead of hanging. Static __shared__
// variables live in one ELF section ("jaxops_shared", see __shared__) and dynamic shared memory
// is allocated per block with its exact size; both are filled with 0xff bytes
// (NaN in every float type) before each block.
//
// The emulated device is an sm_80 (__CUDA_ARCH__ 800 unless defined otherwise):
// wmma with f16/bf16/tf32 runs, inline PTX does not compile here and must be
// guarded by `#ifndef JAXOPS_CUDA_HARNESS`. The fast-math intrinsics compute the
// exact functions (the GPU's approximations are within the tests' tolerances).
#pragma once

#define JAXOPS_CUDA_HARNESS 1
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 800
#endif
#define CUDART_VERSION 13000

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>

// -- qualifiers ------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
// Blocks run one at a time, so one static object per __shared__ variable is the
// block's shared memory. The harness build (build.py) compiles kernel files with
// -fdata-sections and moves these function-local statics into the section
// "jaxops_shared", which the runtime poisons before every block. (GCC ignores a
// section attribute on statics of template instantiations, hence the move.)
#define __shared__ static

// -- vector types --------------------------------------------------------------------------

#define JAXOPS_HARNESS_VECTOR_TYPES(name, T)                                                  \
  struct alignas(sizeof(T)) name##1 { T x; };                                                \
  struct alignas(2 * sizeof(T) > 16 ? 16 : 2 * sizeof(T)) name##2 { T x, y; };             \
  struct name##3 { T x, y, z; };                                                             \
  struct alignas(4 * sizeof(T) > 16 ? 16 : 4 * sizeof(T)) name##4 { T x, y, z, w; };       \
  inline name##1 make_##name##1(T x) { return {x}; }                                          \
  inline name##2 make_##name##2(T x, T y) { return {x, y}; }                                  \
  inline name##3 make_##name##3(T x, T y, T z) { return {x, y, z}; }                          \
  inline name##4 make_##name##4(T x, T y, T z, T w) { return {x, y, z, w}; }

JAXOPS_HARNESS_VECTOR_TYPES(char, signed char)
JAXOPS_HARNESS_VECTOR_TYPES(uchar, unsigned char)
JAXOPS_HARNESS_VECTOR_TYPES(short, short)
JAXOPS_HARNESS_VECTOR_TYPES(ushort, unsigned short)
JAXOPS_HARNESS_VECTOR_TYPES(int, int)
JAXOPS_HARNESS_VECTOR_TYPES(uint, unsigned int)
JAXOPS_HARNESS_VECTOR_TYPES(long, long)
JAXOPS_HARNESS_VECTOR_TYPES(ulong, unsigned long)
JAXOPS_HARNESS_VECTOR_TYPES(longlong, long long)
JAXOPS_HARNESS_VECTOR_TYPES(ulonglong, unsigned long long)
JAXOPS_HARNESS_VECTOR_TYPES(float, float)
JAXOPS_HARNESS_VECTOR_TYPES(double, double)
#undef JAXOPS_HARNESS_VECTOR_TYPES

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return {x, y, z}; }
};

static constexpr int warpSize = 32;

// -- runtime API -------------------------------------------------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoDevice = 100,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorUnknown = 999,
};
using cudaError = cudaError_t;
struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

namespace jaxops_harness {
// The emulated device: an A100 (sm_80).
constexpr int kMultiProcessors = 108;
constexpr int kMaxDynamicSharedBytes = 166912;  // 163 KiB opt-in
constexpr int kDefaultDynamicSharedBytes = 48 * 1024;
constexpr int kMaxThreadsPerBlock = 1024;

cudaError_t& last_error();
const char* error_name(cudaError_t error);
const char* error_string(cudaError_t error);
}  // namespace jaxops_harness

inline cudaError_t cudaGetLastError() {
  const cudaError_t error = jaxops_harness::last_error();
  jaxops_harness::last_error() = cudaSuccess;
  return error;
}
inline cudaError_t cudaPeekAtLastError() { return jaxops_harness::last_error(); }
inline const char* cudaGetErrorName(cudaError_t e) { return jaxops_harness::error_name(e); }
// For cudaErrorLaunchFailure: what the harness found (divergence, deadlock, ...).
inline const char* cudaGetErrorString(cudaError_t e) { return jaxops_harness::error_string(e); }
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = jaxops_harness::kMaxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = jaxops_harness::kDefaultDynamicSharedBytes; break;
    case cudaDevAttrMultiProcessorCount: *value = jaxops_harness::kMultiProcessors; break;
    case cudaDevAttrComputeCapabilityMajor: *value = __CUDA_ARCH__ / 100; break;
    case cudaDevAttrComputeCapabilityMinor: *value = __CUDA_ARCH__ % 100 / 10; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = jaxops_harness::kMaxDynamicSharedBytes; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel*, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize &&
      (value < 0 || value > jaxops_harness::kMaxDynamicSharedBytes)) {
    return jaxops_harness::last_error() = cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// -- execution: thread identity, barriers, warp collectives ---------------------------

namespace jaxops_harness {

// A source location, taken at the call site through default arguments, so that
// reports name the __syncthreads / shuffle of the kernel source.
struct Site {
  const char* file;
  int line;
  static constexpr Site here(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return {file, line};
  }
};

struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  int lane;
};

ThreadContext& this_thread();
void* dynamic_shared_memory();

// A warp collective: every lane named in `mask` deposits pointers to its input
// and its output, and the lane that arrives last calls `complete` while the
// others wait, so `complete` sees every lane's input.
struct Collective;
using Completer = void (*)(const Collective&);
struct Collective {
  const char* op;
  Site site;
  unsigned mask;
  const void* in[32];
  void* out[32];
  Completer complete;
};
void warp_collective(const char* op, Site site, unsigned mask, const void* in, void* out,
                     Completer complete);
// __syncthreads and its counting variants: returns how many threads of the
// block passed a nonzero predicate.
int block_barrier(const char* op, Site site, int predicate);
// Lanes of the calling thread's warp that have not exited.
unsigned live_lanes();

inline void poison(void* p, size_t bytes) { std::memset(p, 0xff, bytes); }

// A kernel launch: runs `kernel` for every thread of every block; returns the
// error a launch of this configuration gets on an sm_80, or
// cudaErrorLaunchFailure with a report when the kernel misbehaves.
cudaError_t launch(const char* kernel_name, dim3 grid, dim3 block, size_t dynamic_shared_bytes,
                   const std::function<void()>& kernel);

}  // namespace jaxops_harness

#define threadIdx (::jaxops_harness::this_thread().thread_idx)
#define blockIdx (::jaxops_harness::this_thread().block_idx)
#define blockDim (::jaxops_harness::this_thread().block_dim)
#define gridDim (::jaxops_harness::this_thread().grid_dim)

inline void __syncthreads(jaxops_harness::Site site = jaxops_harness::Site::here()) {
  jaxops_harness::block_barrier("__syncthreads", site, 0);
}
inline int __syncthreads_count(int predicate,
                               jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::block_barrier("__syncthreads_count", site, predicate != 0);
}
inline int __syncthreads_and(int predicate,
                             jaxops_harness::Site site = jaxops_harness::Site::here()) {
  const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
  return jaxops_harness::block_barrier("__syncthreads_and", site, predicate != 0) ==
         static_cast<int>(threads);
}
inline int __syncthreads_or(int predicate,
                            jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::block_barrier("__syncthreads_or", site, predicate != 0) > 0;
}
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { __builtin_trap(); }

namespace jaxops_harness {

inline void complete_nothing(const Collective&) {}

// shfl.sync as PTX defines it: `c` packs the segment mask (bits 8..12) and the
// clamp (bits 0..4); a lane whose source is out of its segment reads its own
// value; a source lane outside the mask gives an undefined value (poison here).
enum class ShuffleMode { kIdx, kUp, kDown, kBfly };
template <typename T>
struct ShuffleIn {
  T value;
  ShuffleMode mode;
  int b;
  int c;
};
template <typename T>
void complete_shuffle(const Collective& op) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(op.mask >> lane & 1u)) continue;
    const auto& in = *static_cast<const ShuffleIn<T>*>(op.in[lane]);
    const int b = in.b & 31, clamp = in.c & 31, segmask = (in.c >> 8) & 31;
    const int max_lane = (lane & segmask) | (clamp & ~segmask);
    const int min_lane = lane & segmask;
    int j = lane;
    bool valid = false;
    switch (in.mode) {
      case ShuffleMode::kUp: j = lane - b; valid = j >= max_lane; break;
      case ShuffleMode::kDown: j = lane + b; valid = j <= max_lane; break;
      case ShuffleMode::kBfly: j = lane ^ b; valid = j <= max_lane; break;
      case ShuffleMode::kIdx: j = min_lane | (b & ~segmask); valid = j <= max_lane; break;
    }
    if (!valid) j = lane;
    T* out = static_cast<T*>(op.out[lane]);
    if (op.mask >> j & 1u) {
      std::memcpy(out, &static_cast<const ShuffleIn<T>*>(op.in[j])->value, sizeof(T));
    } else {
      poison(out, sizeof(T));
    }
  }
}

void check_shuffle_width(int width, Site site);

template <typename T>
T shuffle(const char* name, Site site, unsigned mask, T var, ShuffleMode mode, int b, int width) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 16,
                "shuffled values are registers");
  check_shuffle_width(width, site);
  const int segmask = (32 - width) << 8;
  const ShuffleIn<T> in{var, mode, b, mode == ShuffleMode::kUp ? segmask : (segmask | 0x1f)};
  T out;
  warp_collective(name, site, mask, &in, &out, &complete_shuffle<T>);
  return out;
}

struct VoteOut {
  unsigned ballot;
};
inline void complete_ballot(const Collective& op) {
  unsigned ballot = 0;
  for (int lane = 0; lane < 32; ++lane) {
    if ((op.mask >> lane & 1u) && *static_cast<const int*>(op.in[lane])) ballot |= 1u << lane;
  }
  for (int lane = 0; lane < 32; ++lane) {
    if (op.mask >> lane & 1u) *static_cast<unsigned*>(op.out[lane]) = ballot;
  }
}
inline unsigned ballot(const char* name, Site site, unsigned mask, int predicate) {
  const int in = predicate != 0;
  unsigned out;
  warp_collective(name, site, mask, &in, &out, &complete_ballot);
  return out;
}

template <typename T, typename Reduce>
void complete_reduce(const Collective& op) {
  T acc{};
  bool first = true;
  for (int lane = 0; lane < 32; ++lane) {
    if (!(op.mask >> lane & 1u)) continue;
    const T v = *static_cast<const T*>(op.in[lane]);
    acc = first ? v : Reduce()(acc, v);
    first = false;
  }
  for (int lane = 0; lane < 32; ++lane) {
    if (op.mask >> lane & 1u) *static_cast<T*>(op.out[lane]) = acc;
  }
}
template <typename T, typename Reduce>
T reduce(const char* name, Site site, unsigned mask, T value) {
  T out;
  warp_collective(name, site, mask, &value, &out, &complete_reduce<T, Reduce>);
  return out;
}
struct Min {
  template <typename T>
  T operator()(T a, T b) const { return b < a ? b : a; }
};
struct Max {
  template <typename T>
  T operator()(T a, T b) const { return a < b ? b : a; }
};

template <typename T>
void complete_match_any(const Collective& op) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(op.mask >> lane & 1u)) continue;
    unsigned same = 0;
    for (int other = 0; other < 32; ++other) {
      if ((op.mask >> other & 1u) &&
          std::memcmp(op.in[lane], op.in[other], sizeof(T)) == 0) {
        same |= 1u << other;
      }
    }
    *static_cast<unsigned*>(op.out[lane]) = same;
  }
}

}  // namespace jaxops_harness

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::shuffle("__shfl_sync", site, mask, var,
                                 jaxops_harness::ShuffleMode::kIdx, src_lane, width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::shuffle("__shfl_up_sync", site, mask, var,
                                 jaxops_harness::ShuffleMode::kUp, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::shuffle("__shfl_down_sync", site, mask, var,
                                 jaxops_harness::ShuffleMode::kDown, static_cast<int>(delta),
                                 width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::shuffle("__shfl_xor_sync", site, mask, var,
                                 jaxops_harness::ShuffleMode::kBfly, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::ballot("__ballot_sync", site, mask, predicate);
}
inline int __any_sync(unsigned mask, int predicate,
                      jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::ballot("__any_sync", site, mask, predicate) != 0;
}
inline int __all_sync(unsigned mask, int predicate,
                      jaxops_harness::Site site = jaxops_harness::Site::here()) {
  return jaxops_harness::ballot("__all_sync", site, mask, predicate) == mask;
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       jaxops_harness::Site site = jaxops_harness::Site::here()) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  jaxops_harness::warp_collective("__syncwarp", site, mask, nullptr, nullptr,
                                  &jaxops_harness::complete_nothing);
}
// Approximation: the lanes of the warp that have not exited (a GPU reports the
// lanes converged at this instruction, which may be fewer).
inline unsigned __activemask() { return jaxops_harness::live_lanes(); }
template <typename T>
unsigned __match_any_sync(unsigned mask, T value,
                          jaxops_harness::Site site = jaxops_harness::Site::here()) {
  unsigned out;
  jaxops_harness::warp_collective("__match_any_sync", site, mask, &value, &out,
                                  &jaxops_harness::complete_match_any<T>);
  return out;
}
#define JAXOPS_HARNESS_REDUCE(name, T, Reduce)                                             \
  inline T name(unsigned mask, T value,                                                   \
                jaxops_harness::Site site = jaxops_harness::Site::here()) {               \
    return jaxops_harness::reduce<T, Reduce>(#name, site, mask, value);                   \
  }
JAXOPS_HARNESS_REDUCE(__reduce_add_sync, unsigned, std::plus<unsigned>)
JAXOPS_HARNESS_REDUCE(__reduce_add_sync, int, std::plus<int>)
JAXOPS_HARNESS_REDUCE(__reduce_min_sync, unsigned, jaxops_harness::Min)
JAXOPS_HARNESS_REDUCE(__reduce_min_sync, int, jaxops_harness::Min)
JAXOPS_HARNESS_REDUCE(__reduce_max_sync, unsigned, jaxops_harness::Max)
JAXOPS_HARNESS_REDUCE(__reduce_max_sync, int, jaxops_harness::Max)
JAXOPS_HARNESS_REDUCE(__reduce_and_sync, unsigned, std::bit_and<unsigned>)
JAXOPS_HARNESS_REDUCE(__reduce_or_sync, unsigned, std::bit_or<unsigned>)
JAXOPS_HARNESS_REDUCE(__reduce_xor_sync, unsigned, std::bit_xor<unsigned>)
#undef JAXOPS_HARNESS_REDUCE

// -- kernel launch (the harness side of cuda/launch.cuh) -------------------------------

namespace jaxops::cuda {

template <typename... Params, typename... Args>
cudaError_t launch_kernel_dynamic_shared(void (*kernel)(Params...), dim3 grid, dim3 block,
                                         size_t shared_bytes, cudaStream_t,
                                         Args... args) {
  return jaxops_harness::launch("kernel", grid, block, shared_bytes,
                                [&] { kernel(static_cast<Params>(args)...); });
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                          Args... args) {
  return launch_kernel_dynamic_shared(kernel, grid, block, 0, stream, args...);
}

template <typename T>
__device__ __forceinline__ T* dynamic_shared_memory() {
  return static_cast<T*>(jaxops_harness::dynamic_shared_memory());
}

}  // namespace jaxops::cuda

// -- memory access intrinsics and atomics -------------------------------------------------

template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
template <typename T>
inline T __ldca(const T* p) { return *p; }
template <typename T>
inline T __ldcs(const T* p) { return *p; }
template <typename T>
inline T __ldlu(const T* p) { return *p; }
template <typename T>
inline T __ldcv(const T* p) { return *p; }
template <typename T>
inline void __stwb(T* p, T v) { *p = v; }
template <typename T>
inline void __stcg(T* p, T v) { *p = v; }
template <typename T>
inline void __stcs(T* p, T v) { *p = v; }
template <typename T>
inline void __stwt(T* p, T v) { *p = v; }

namespace jaxops_harness {
// Atomic read-modify-write of any 4- or 8-byte type (real atomics: the OS-thread
// mode runs a block's threads concurrently).
template <typename T, typename F>
T atomic_update(T* address, F update) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "32- or 64-bit atomics");
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  Bits* bits = reinterpret_cast<Bits*>(address);
  Bits expected = __atomic_load_n(bits, __ATOMIC_RELAXED);
  for (;;) {
    T old;
    std::memcpy(&old, &expected, sizeof(T));
    const T next = update(old);
    Bits desired;
    std::memcpy(&desired, &next, sizeof(T));
    if (__atomic_compare_exchange_n(bits, &expected, desired, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_RELAXED)) {
      return old;
    }
  }
}
}  // namespace jaxops_harness

template <typename T>
inline T atomicAdd(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return static_cast<T>(old + v); });
}
template <typename T>
inline T atomicSub(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return static_cast<T>(old - v); });
}
template <typename T>
inline T atomicMax(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return old < v ? v : old; });
}
template <typename T>
inline T atomicMin(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return v < old ? v : old; });
}
template <typename T>
inline T atomicExch(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T) { return v; });
}
template <typename T>
inline T atomicAnd(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return old & v; });
}
template <typename T>
inline T atomicOr(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return old | v; });
}
template <typename T>
inline T atomicXor(T* p, T v) {
  return jaxops_harness::atomic_update(p, [v](T old) { return old ^ v; });
}
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
  return jaxops_harness::atomic_update(p, [=](T old) { return old == compare ? v : old; });
}

// -- math ----------------------------------------------------------------------------------

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __tanhf(float x) { return std::tanh(x); }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x > 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; std::memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; std::memcpy(&x, &i, 8); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}
inline int __mul24(int a, int b) { return a * b; }
using std::fmaxf;
using std::fminf;
using std::max;
using std::min;
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

#define CUDART_INF_F (std::numeric_limits<float>::infinity())
#define CUDART_NAN_F (std::numeric_limits<float>::quiet_NaN())
#define CUDART_INF (std::numeric_limits<double>::infinity())
#define CUDART_NAN (std::numeric_limits<double>::quiet_NaN())

// -- __half and __nv_bfloat16 ----------------------------------------------------------

static_assert(sizeof(_Float16) == 2, "the harness converts halves with the compiler's _Float16");

struct __half_raw {
  unsigned short x;
};
struct __nv_bfloat16_raw {
  unsigned short x;
};

namespace jaxops_harness {
inline unsigned short float_to_half_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // round to nearest even
  unsigned short bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
inline float half_bits_to_float(unsigned short bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}
inline unsigned short float_to_bfloat16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<unsigned short>(u >> 16);
}
inline float bfloat16_bits_to_float(unsigned short bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// __half and __nv_bfloat16 share their shape: 16 bits, implicit conversions from
// and to float, arithmetic in float rounded once (exact for + - * /).
template <unsigned short (*kFromFloat)(float), float (*kToFloat)(unsigned short)>
struct Float16Bits {
  unsigned short __x;
  Float16Bits() = default;
  Float16Bits(float f) : __x(kFromFloat(f)) {}
  Float16Bits(double f) : __x(kFromFloat(static_cast<float>(f))) {}
  Float16Bits(int i) : __x(kFromFloat(static_cast<float>(i))) {}
  Float16Bits(unsigned i) : __x(kFromFloat(static_cast<float>(i))) {}
  Float16Bits(long long i) : __x(kFromFloat(static_cast<float>(i))) {}
  operator float() const { return kToFloat(__x); }
  static Float16Bits from_bits(unsigned short bits) {
    Float16Bits h;
    h.__x = bits;
    return h;
  }
  Float16Bits& operator+=(Float16Bits o) { return *this = Float16Bits(float(*this) + float(o)); }
  Float16Bits& operator-=(Float16Bits o) { return *this = Float16Bits(float(*this) - float(o)); }
  Float16Bits& operator*=(Float16Bits o) { return *this = Float16Bits(float(*this) * float(o)); }
  Float16Bits& operator/=(Float16Bits o) { return *this = Float16Bits(float(*this) / float(o)); }
  friend Float16Bits operator+(Float16Bits a, Float16Bits b) { return Float16Bits(float(a) + float(b)); }
  friend Float16Bits operator-(Float16Bits a, Float16Bits b) { return Float16Bits(float(a) - float(b)); }
  friend Float16Bits operator*(Float16Bits a, Float16Bits b) { return Float16Bits(float(a) * float(b)); }
  friend Float16Bits operator/(Float16Bits a, Float16Bits b) { return Float16Bits(float(a) / float(b)); }
  friend Float16Bits operator-(Float16Bits a) { return from_bits(a.__x ^ 0x8000u); }
  friend bool operator==(Float16Bits a, Float16Bits b) { return float(a) == float(b); }
  friend bool operator!=(Float16Bits a, Float16Bits b) { return float(a) != float(b); }
  friend bool operator<(Float16Bits a, Float16Bits b) { return float(a) < float(b); }
  friend bool operator>(Float16Bits a, Float16Bits b) { return float(a) > float(b); }
  friend bool operator<=(Float16Bits a, Float16Bits b) { return float(a) <= float(b); }
  friend bool operator>=(Float16Bits a, Float16Bits b) { return float(a) >= float(b); }
};
}  // namespace jaxops_harness

using __half = jaxops_harness::Float16Bits<jaxops_harness::float_to_half_bits,
                                           jaxops_harness::half_bits_to_float>;
using __nv_bfloat16 = jaxops_harness::Float16Bits<jaxops_harness::float_to_bfloat16_bits,
                                                  jaxops_harness::bfloat16_bits_to_float>;
using half = __half;
using nv_bfloat16 = __nv_bfloat16;
static_assert(sizeof(__half) == 2 && std::is_trivially_copyable<__half>::value &&
                  std::is_trivially_default_constructible<__half>::value,
              "__half must be a 2-byte POD like CUDA's");

struct alignas(4) __half2 {
  __half x, y;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
using half2 = __half2;
using nv_bfloat162 = __nv_bfloat162;

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __half __ushort_as_half(unsigned short bits) { return __half::from_bits(bits); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __int2half_rn(int i) { return __half(static_cast<float>(i)); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) {
  return __nv_bfloat16::from_bits(bits);
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }

inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return {__half(a), __half(a)}; }
inline __half2 __float22half2_rn(float2 v) { return {__half(v.x), __half(v.y)}; }
inline float2 __half22float2(__half2 v) { return {float(v.x), float(v.y)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline float __low2float(__half2 v) { return float(v.x); }
inline float __high2float(__half2 v) { return float(v.y); }
inline __half __low2half(__half2 v) { return v.x; }
inline __half __high2half(__half2 v) { return v.y; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline __nv_bfloat162 __float2bfloat162_rn(float a) {
  return {__nv_bfloat16(a), __nv_bfloat16(a)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) {
  return {__nv_bfloat16(v.x), __nv_bfloat16(v.y)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline float __low2float(__nv_bfloat162 v) { return float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return float(v.y); }

template <typename H>
inline H __hadd(H a, H b) { return a + b; }
template <typename H>
inline H __hsub(H a, H b) { return a - b; }
template <typename H>
inline H __hmul(H a, H b) { return a * b; }
template <typename H>
inline H __hdiv(H a, H b) { return a / b; }
template <typename H>
inline H __hneg(H a) { return -a; }
template <typename H>
inline H __habs(H a) { return H::from_bits(a.__x & 0x7fffu); }
template <typename H>
inline H __hfma(H a, H b, H c) { return H(std::fma(float(a), float(b), float(c))); }
template <typename H>
inline H __hmax(H a, H b) { return H(std::fmax(float(a), float(b))); }
template <typename H>
inline H __hmin(H a, H b) { return H(std::fmin(float(a), float(b))); }
template <typename H>
inline bool __hisnan(H a) { return std::isnan(float(a)); }
template <typename H>
inline int __hisinf(H a) {
  const float f = float(a);
  return std::isinf(f) ? (f > 0 ? 1 : -1) : 0;
}
inline __half2 __hadd2(__half2 a, __half2 b) { return {a.x + b.x, a.y + b.y}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return {a.x * b.x, a.y * b.y}; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)};
}
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {a.x + b.x, a.y + b.y};
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {a.x * b.x, a.y * b.y};
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)};
}

// -- nvcuda::wmma ----------------------------------------------------------------------
//
// Emulated fragment layout: element e of lane l holds the element whose row-major
// index in the fragment's matrix (A: M x K, B: K x N, accumulator: M x N) is
// e * 32 + l. Code that does not depend on the element-to-lane mapping (the
// portable wmma API: loads, stores, mma, fill, element-wise ops on x[]) runs as on
// a GPU. mma computes in float and rounds once into the accumulator type; tf32
// operands are truncated to tf32 as the tensor cores read them (a kernel rounds
// them first with __float_to_tf32, as the wmma documentation requires). Every
// emulated mma_sync is counted by its operand type (jaxops_harness_wmma_mmas), so
// a test can tell which precision a kernel's products took.

namespace jaxops_harness {
// The operand types of wmma::mma_sync the harness counts.
enum class WmmaOperand { kHalf = 0, kBfloat16 = 1, kTf32 = 2 };
void count_wmma_mma(WmmaOperand operand);
}  // namespace jaxops_harness

namespace nvcuda::wmma {

// cvt.rna.tf32.f32: float32 rounded to tf32's 10 explicit mantissa bits, to
// nearest with ties away from zero, in a float whose 13 low bits are zero; NaN
// and infinities pass unchanged (adding half an ulp to their bits would turn an
// infinity into a NaN, or a NaN into -0), a finite value beyond tf32's largest
// becomes an infinity.
inline float __float_to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
}

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}  // namespace precision

template <typename T>
struct storage {
  using type = T;
};
template <>
struct storage<precision::tf32> {
  using type = float;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  using element_type = T;
  using storage_element_type = typename storage<T>::type;
  static constexpr int kRows = std::is_same<Use, matrix_b>::value ? K : M;
  static constexpr int kCols = std::is_same<Use, matrix_a>::value ? K : N;
  static_assert(kRows * kCols % 32 == 0, "a fragment spreads over the 32 lanes of a warp");
  static constexpr int num_elements = kRows * kCols / 32;
  storage_element_type x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (auto& e : f.x) e = static_cast<typename fragment<Use, M, N, K, T, Layout>::storage_element_type>(value);
}

namespace detail {
template <typename Frag>
inline int row_of(int e) { return (e * 32 + jaxops_harness::this_thread().lane) / Frag::kCols; }
template <typename Frag>
inline int col_of(int e) { return (e * 32 + jaxops_harness::this_thread().lane) % Frag::kCols; }
inline size_t offset(int row, int col, unsigned ldm, bool row_major_memory) {
  return row_major_memory ? static_cast<size_t>(row) * ldm + col
                          : static_cast<size_t>(col) * ldm + row;
}
inline void warp_sync(const char* op, jaxops_harness::Site site) {
  jaxops_harness::warp_collective(op, site, 0xffffffffu, nullptr, nullptr,
                                  &jaxops_harness::complete_nothing);
}
template <typename Frag, typename P>
inline void load(Frag& f, const P* p, unsigned ldm, bool row_major_memory) {
  for (int e = 0; e < Frag::num_elements; ++e) {
    f.x[e] = static_cast<typename Frag::storage_element_type>(
        p[offset(row_of<Frag>(e), col_of<Frag>(e), ldm, row_major_memory)]);
  }
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout, typename P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const P* p, unsigned ldm,
                             jaxops_harness::Site site = jaxops_harness::Site::here()) {
  static_assert(!std::is_same<Use, accumulator>::value, "accumulators take a layout_t");
  detail::warp_sync("wmma::load_matrix_sync", site);
  detail::load(f, p, ldm, std::is_same<Layout, row_major>::value);
}
template <int M, int N, int K, typename T, typename P>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const P* p, unsigned ldm,
                             layout_t layout,
                             jaxops_harness::Site site = jaxops_harness::Site::here()) {
  detail::warp_sync("wmma::load_matrix_sync", site);
  detail::load(f, p, ldm, layout == mem_row_major);
}
template <int M, int N, int K, typename T, typename P>
inline void store_matrix_sync(P* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout,
                              jaxops_harness::Site site = jaxops_harness::Site::here()) {
  using Frag = fragment<accumulator, M, N, K, T>;
  detail::warp_sync("wmma::store_matrix_sync", site);
  for (int e = 0; e < Frag::num_elements; ++e) {
    p[detail::offset(detail::row_of<Frag>(e), detail::col_of<Frag>(e), ldm,
                     layout == mem_row_major)] = static_cast<P>(f.x[e]);
  }
}

namespace detail {
template <typename T>
inline float operand(const T& v) { return static_cast<float>(v); }
inline float tf32_operand(float v) {
  return std::isfinite(v) ? __uint_as_float(__float_as_uint(v) & 0xffffe000u) : v;
}
struct MmaLane {
  const void* a;
  const void* b;
  const void* c;
};
template <typename T>
constexpr jaxops_harness::WmmaOperand wmma_operand() {
  using jaxops_harness::WmmaOperand;
  static_assert(std::is_same<T, precision::tf32>::value || std::is_same<T, __half>::value ||
                    std::is_same<T, __nv_bfloat16>::value,
                "the harness emulates wmma on tf32, half and bfloat16 operands");
  return std::is_same<T, precision::tf32>::value ? WmmaOperand::kTf32
         : std::is_same<T, __half>::value        ? WmmaOperand::kHalf
                                                 : WmmaOperand::kBfloat16;
}
template <typename FragD, typename FragA, typename FragB, typename FragC, int M, int N, int K>
void complete_mma(const jaxops_harness::Collective& op) {
  constexpr bool kTf32 = std::is_same<typename FragA::element_type, precision::tf32>::value;
  jaxops_harness::count_wmma_mma(wmma_operand<typename FragA::element_type>());
  float a[M * K], b[K * N], acc[M * N];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& in = *static_cast<const MmaLane*>(op.in[lane]);
    const auto& fa = *static_cast<const FragA*>(in.a);
    const auto& fb = *static_cast<const FragB*>(in.b);
    const auto& fc = *static_cast<const FragC*>(in.c);
    for (int e = 0; e < FragA::num_elements; ++e) {
      const float v = operand(fa.x[e]);
      a[e * 32 + lane] = kTf32 ? tf32_operand(v) : v;
    }
    for (int e = 0; e < FragB::num_elements; ++e) {
      const float v = operand(fb.x[e]);
      b[e * 32 + lane] = kTf32 ? tf32_operand(v) : v;
    }
    for (int e = 0; e < FragC::num_elements; ++e) acc[e * 32 + lane] = operand(fc.x[e]);
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float sum = acc[i * N + j];
      for (int k = 0; k < K; ++k) sum += a[i * K + k] * b[k * N + j];
      acc[i * N + j] = sum;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    auto& fd = *static_cast<FragD*>(op.out[lane]);
    for (int e = 0; e < FragD::num_elements; ++e) {
      fd.x[e] = static_cast<typename FragD::storage_element_type>(acc[e * 32 + lane]);
    }
  }
}
}  // namespace detail

template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB, typename TC,
          typename TD>
inline void mma_sync(fragment<accumulator, M, N, K, TD>& d,
                     const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b,
                     const fragment<accumulator, M, N, K, TC>& c, bool = false,
                     jaxops_harness::Site site = jaxops_harness::Site::here()) {
  using FragD = fragment<accumulator, M, N, K, TD>;
  const detail::MmaLane in{&a, &b, &c};
  // d may alias c: the result goes to a copy until every lane's c has been read.
  FragD result;
  jaxops_harness::warp_collective(
      "wmma::mma_sync", site, 0xffffffffu, &in, &result,
      &detail::complete_mma<FragD, fragment<matrix_a, M, N, K, TA, LA>,
                            fragment<matrix_b, M, N, K, TB, LB>,
                            fragment<accumulator, M, N, K, TC>, M, N, K>);
  d = result;
}

}  // namespace nvcuda::wmma
