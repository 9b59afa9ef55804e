// The sm_90 asynchronous-copy and synchronisation instructions of the
// warp-specialised (FlashAttention-3 style) kernels, one device function each:
//   mbarrier: init, fence.mbarrier_init, arrive, arrive.expect_tx, expect_tx,
//     try_wait.parity (and a wait that spins on it), inval;
//   the tensor memory accelerator: cp.async.bulk.tensor 2D-4D loads completing
//     on an mbarrier (complete_tx::bytes), stores and .add reductions from
//     shared memory in bulk async-groups (commit_group, wait_group[.read]),
//     prefetch.tensormap;
//   named barriers bar.sync / bar.arrive with a thread count;
//   setmaxnreg.inc/.dec (register reallocation between warpgroups, sm_90a);
//   fence.proxy.async.shared::cta and elect.sync.
// The CUtensorMap a load names is built on the host by cuda/tensor_map.h.
//
// Under nvcc each is its inline PTX; a build for an architecture without the
// instruction compiles it to a trap (the launchers keep such devices away).
// Under the CPU harness (tests/cuda_harness) each is emulated with its PTX
// semantics and hazards (include/tma_emulation.h): an mbarrier phase completes
// only when its pending arrivals and its transaction bytes both reach zero; a
// TMA destination holds poison until the phase it completes on has completed,
// and a read of it before then (`landed` below, or an ldmatrix) fails the
// launch; waits block the CUDA thread, so a producer warp and consumer
// warpgroups run without deadlock, and a real deadlock is reported.
//
// Swizzle (PTX ISA, "Tensor swizzling modes"; CuTe's Swizzle<B, 4, 3> on byte
// addresses): the 16-byte chunk bits [4, 4 + B) of a shared-memory byte offset
// are XORed with its bits [7, 7 + B), B = 1, 2, 3 for 32, 64, 128-byte
// swizzle; the pattern repeats every 256, 512, 1024 bytes, and a swizzled
// tile starts at a multiple of that. wgmma::swizzled_offset (cuda/wgmma.cuh)
// must compute the same function: tests/test_cuda_harness_tma.py checks that
// they agree on every offset of a pattern.
#pragma once

#include <cstdint>

#include <cuda.h>

#ifdef JAXOPS_CUDA_HARNESS
#include "tma_emulation.h"
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define JAXOPS_TMA_BELOW_SM90 1
#endif
// setmaxnreg exists on the architecture-specific targets only (sm_90a).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXOPS_TMA_NO_SETMAXNREG 1
#endif

namespace jaxops::cuda::tma {

// The shared-memory swizzle of a tensor map (the values of CUtensorMapSwizzle).
enum class Swizzle : int { kNone = 0, k32B = 1, k64B = 2, k128B = 3 };

// The bytes a swizzle pattern spans before it repeats (a swizzled tile's alignment).
__host__ __device__ constexpr uint32_t swizzle_repeat_bytes(Swizzle s) {
  return s == Swizzle::kNone ? 16u : 128u << static_cast<int>(s);
}

// Where the byte at `byte_offset` of a dense box lands in a swizzled tile.
__host__ __device__ constexpr uint32_t swizzled_offset(Swizzle s, uint32_t byte_offset) {
  const uint32_t mask = (1u << static_cast<int>(s)) - 1u;
  return byte_offset ^ (((byte_offset >> 7) & mask) << 4);
}

#ifndef JAXOPS_CUDA_HARNESS
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// -- mbarrier --------------------------------------------------------------------------

// mbarrier.init: a phase completes after `arrive_count` arrivals (and the
// transaction bytes expected in it). One thread initialises; the others may
// use the barrier after fence_barrier_init and a __syncthreads.
__device__ __forceinline__ void init(uint64_t* bar, uint32_t arrive_count) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::mbarrier_init(bar, arrive_count);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_address(bar)),
               "r"(arrive_count) : "memory");
#endif
}

// fence.mbarrier_init.release.cluster: makes the inits visible to the async
// proxy (the TMA unit) and to the other threads after the next barrier.
__device__ __forceinline__ void fence_barrier_init() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::mbarrier_fence_init();
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// mbarrier.inval: before the barrier's memory is used for anything else.
__device__ __forceinline__ void invalidate(uint64_t* bar) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::mbarrier_invalidate(bar);
#else
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" :: "r"(smem_address(bar)) : "memory");
#endif
}

// mbarrier.arrive (release): one arrival on the current phase; returns the
// barrier's state token (opaque).
__device__ __forceinline__ uint64_t arrive(uint64_t* bar) {
#ifdef JAXOPS_CUDA_HARNESS
  return jaxops_harness::mbarrier_arrive(bar, 0);
#else
  uint64_t state;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state)
               : "r"(smem_address(bar)) : "memory");
  return state;
#endif
}

// mbarrier.arrive.expect_tx: expects `bytes` more transaction bytes in the
// current phase, then arrives (the producer's call before its TMA loads).
__device__ __forceinline__ uint64_t arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef JAXOPS_CUDA_HARNESS
  return jaxops_harness::mbarrier_arrive(bar, bytes);
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
  return 0;
#else
  uint64_t state;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n" : "=l"(state)
               : "r"(smem_address(bar)), "r"(bytes) : "memory");
  return state;
#endif
}

// mbarrier.expect_tx: expects `bytes` more transaction bytes, without arriving.
__device__ __forceinline__ void expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::mbarrier_expect_tx(bar, bytes);
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
               :: "r"(smem_address(bar)), "r"(bytes) : "memory");
#endif
}

// mbarrier.try_wait.parity (acquire): whether the phase of parity `phase`
// has completed (the barrier's current phase has the other parity); waits a
// while for it first. A barrier starts in phase 0, so a consumer waits on
// parity 0 first, and a producer waiting for a free stage on parity 1 passes.
__device__ __forceinline__ bool try_wait_parity(uint64_t* bar, uint32_t phase) {
#ifdef JAXOPS_CUDA_HARNESS
  return jaxops_harness::mbarrier_try_wait_parity(bar, phase);
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
  return false;
#else
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_address(bar)), "r"(phase) : "memory");
  return done != 0;
#endif
}

// Spins on try_wait.parity until the phase of parity `phase` has completed.
__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t phase) {
  while (!try_wait_parity(bar, phase)) {
  }
}

// -- the tensor memory accelerator ------------------------------------------------------

// prefetch.tensormap: brings the tensor map (a __grid_constant__ parameter)
// into the cache before the first load names it.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::tma_prefetch(map);
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(map) : "memory");
#endif
}

// cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes:
// the map's box at element coordinates (c0 innermost, ...) into `smem_dst`
// (128-byte aligned; aligned to swizzle_repeat_bytes when swizzled), elements
// outside the tensor zero; completes the box's bytes on `bar`, whose phase
// must expect them (arrive_expect_tx). One thread issues it.
#ifdef JAXOPS_CUDA_HARNESS
#define JAXOPS_TMA_LOAD(RANK, ...)                                                         \
  const int32_t coords[RANK] = {__VA_ARGS__};                                               \
  jaxops_harness::tma_load(smem_dst, map, RANK, coords, bar)
#elif defined(JAXOPS_TMA_BELOW_SM90)
#define JAXOPS_TMA_LOAD(RANK, ...) __trap()
#else
#define JAXOPS_TMA_LOAD(RANK, COORDS, ...)                                                   \
  asm volatile("cp.async.bulk.tensor." #RANK "d.shared::cluster.global.mbarrier::complete_tx::bytes" \
               " [%0], [%1, {" COORDS "}], [%2];\n"                                          \
               :: "r"(smem_address(smem_dst)), "l"(map), "r"(smem_address(bar)), __VA_ARGS__ \
               : "memory")
#endif

__device__ __forceinline__ void load_2d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                        int32_t c1, uint64_t* bar) {
#ifdef JAXOPS_CUDA_HARNESS
  JAXOPS_TMA_LOAD(2, c0, c1);
#else
  JAXOPS_TMA_LOAD(2, "%3, %4", "r"(c0), "r"(c1));
#endif
}
__device__ __forceinline__ void load_3d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                        int32_t c1, int32_t c2, uint64_t* bar) {
#ifdef JAXOPS_CUDA_HARNESS
  JAXOPS_TMA_LOAD(3, c0, c1, c2);
#else
  JAXOPS_TMA_LOAD(3, "%3, %4, %5", "r"(c0), "r"(c1), "r"(c2));
#endif
}
__device__ __forceinline__ void load_4d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                        int32_t c1, int32_t c2, int32_t c3, uint64_t* bar) {
#ifdef JAXOPS_CUDA_HARNESS
  JAXOPS_TMA_LOAD(4, c0, c1, c2, c3);
#else
  JAXOPS_TMA_LOAD(4, "%3, %4, %5, %6", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
#endif
}
#undef JAXOPS_TMA_LOAD

// cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group (kAdd false) and
// cp.reduce.async.bulk.tensor.Nd.global.shared::cta.add.tile.bulk_group (kAdd
// true: global += box, element-wise and atomic, e.g. float32 dQ partial sums):
// the box at `smem_src` to the map's tensor at the coordinates; elements
// outside the tensor are not written. Generic-proxy writes of the box must be
// fenced first (fence_proxy_async, then a barrier); `smem_src` may be
// overwritten only after a bulk_wait_group_read that covers the store.
#ifdef JAXOPS_CUDA_HARNESS
#define JAXOPS_TMA_STORE(RANK, ADD, ...)                                                   \
  const int32_t coords[RANK] = {__VA_ARGS__};                                               \
  jaxops_harness::tma_store(map, RANK, coords, smem_src, ADD)
#elif defined(JAXOPS_TMA_BELOW_SM90)
#define JAXOPS_TMA_STORE(RANK, ADD, ...) __trap()
#else
#define JAXOPS_TMA_STORE(RANK, ADD, COORDS, ...)                                             \
  if constexpr (ADD) {                                                                       \
    asm volatile("cp.reduce.async.bulk.tensor." #RANK "d.global.shared::cta.add.tile.bulk_group" \
                 " [%0, {" COORDS "}], [%1];\n"                                              \
                 :: "l"(map), "r"(smem_address(smem_src)), __VA_ARGS__ : "memory");          \
  } else {                                                                                   \
    asm volatile("cp.async.bulk.tensor." #RANK "d.global.shared::cta.bulk_group"             \
                 " [%0, {" COORDS "}], [%1];\n"                                              \
                 :: "l"(map), "r"(smem_address(smem_src)), __VA_ARGS__ : "memory");          \
  }
#endif

template <bool kAdd = false>
__device__ __forceinline__ void store_2d(const CUtensorMap* map, const void* smem_src,
                                         int32_t c0, int32_t c1) {
#ifdef JAXOPS_CUDA_HARNESS
  JAXOPS_TMA_STORE(2, kAdd, c0, c1);
#else
  JAXOPS_TMA_STORE(2, kAdd, "%2, %3", "r"(c0), "r"(c1));
#endif
}
template <bool kAdd = false>
__device__ __forceinline__ void store_3d(const CUtensorMap* map, const void* smem_src,
                                         int32_t c0, int32_t c1, int32_t c2) {
#ifdef JAXOPS_CUDA_HARNESS
  JAXOPS_TMA_STORE(3, kAdd, c0, c1, c2);
#else
  JAXOPS_TMA_STORE(3, kAdd, "%2, %3, %4", "r"(c0), "r"(c1), "r"(c2));
#endif
}
template <bool kAdd = false>
__device__ __forceinline__ void store_4d(const CUtensorMap* map, const void* smem_src,
                                         int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
#ifdef JAXOPS_CUDA_HARNESS
  JAXOPS_TMA_STORE(4, kAdd, c0, c1, c2, c3);
#else
  JAXOPS_TMA_STORE(4, kAdd, "%2, %3, %4, %5", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
#endif
}
#undef JAXOPS_TMA_STORE

__device__ __forceinline__ void reduce_add_2d(const CUtensorMap* map, const void* smem_src,
                                              int32_t c0, int32_t c1) {
  store_2d<true>(map, smem_src, c0, c1);
}
__device__ __forceinline__ void reduce_add_3d(const CUtensorMap* map, const void* smem_src,
                                              int32_t c0, int32_t c1, int32_t c2) {
  store_3d<true>(map, smem_src, c0, c1, c2);
}
__device__ __forceinline__ void reduce_add_4d(const CUtensorMap* map, const void* smem_src,
                                              int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  store_4d<true>(map, smem_src, c0, c1, c2, c3);
}

// cp.async.bulk.commit_group: the calling thread's bulk stores since the last
// commit form a group.
__device__ __forceinline__ void bulk_commit_group() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::bulk_commit_group();
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// cp.async.bulk.wait_group.read kPending: all but the kPending newest groups
// have read their shared-memory sources (which may then be reused).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::bulk_wait_group(kPending);
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(kPending) : "memory");
#endif
}

// cp.async.bulk.wait_group kPending: all but the kPending newest groups have
// completed (their writes to global memory are done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::bulk_wait_group(kPending);
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(kPending) : "memory");
#endif
}

// `count` elements from `p`, a TMA destination, as a kernel reads them: the
// same pointer under nvcc; under the harness the launch fails if any of them
// is the destination of a TMA load whose mbarrier phase has not completed.
template <typename T>
__device__ __forceinline__ const T* landed(const T* p, uint32_t count) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::check_tma_landed(p, sizeof(T) * count, "a read of a TMA destination");
#else
  (void)count;
#endif
  return p;
}

// -- named barriers, register reallocation, proxy fence, election ------------------------

// bar.sync id, threads: waits until `threads` threads (a multiple of 32, whole
// warps) have arrived at barrier `id` (0..15; 0 is also __syncthreads's).
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::named_barrier(id, threads, true);
#else
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
#endif
}

// bar.arrive id, threads: arrives at barrier `id` without waiting (a producer
// signalling the threads that named_sync on it).
__device__ __forceinline__ void named_arrive(uint32_t id, uint32_t threads) {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::named_barrier(id, threads, false);
#else
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
#endif
}

// setmaxnreg.inc/.dec.sync.aligned.u32 kRegisters: the whole warpgroup (128
// threads) raises or lowers its per-thread register allocation to kRegisters
// (24..256, a multiple of 8): the producer gives registers to the consumers.
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegisters >= 24 && kRegisters <= 256 && kRegisters % 8 == 0,
                "setmaxnreg takes a multiple of 8 in [24, 256]");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::setmaxnreg(kRegisters, true);
#elif defined(JAXOPS_TMA_NO_SETMAXNREG)
  __trap();
#else
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegisters >= 24 && kRegisters <= 256 && kRegisters % 8 == 0,
                "setmaxnreg takes a multiple of 8 in [24, 256]");
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::setmaxnreg(kRegisters, false);
#elif defined(JAXOPS_TMA_NO_SETMAXNREG)
  __trap();
#else
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegisters));
#endif
}

// fence.proxy.async.shared::cta: orders this thread's generic-proxy writes to
// shared memory before later async-proxy reads of it (a TMA store, a wgmma).
__device__ __forceinline__ void fence_proxy_async() {
#ifdef JAXOPS_CUDA_HARNESS
  jaxops_harness::fence_proxy_async();
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
#else
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// elect.sync with a full mask: true on one lane of the warp (every lane calls it).
__device__ __forceinline__ bool elect_one() {
#ifdef JAXOPS_CUDA_HARNESS
  return jaxops_harness::elect_one();
#elif defined(JAXOPS_TMA_BELOW_SM90)
  __trap();
  return false;
#else
  uint32_t elected;
  asm volatile(
      "{\n .reg .b32 leader;\n .reg .pred p;\n elect.sync leader|p, 0xffffffff;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
#endif
}

}  // namespace jaxops::cuda::tma
