// Test-only: the sm_90 instructions of cuda/tma.cuh emulated on the CPU with
// their PTX semantics and hazards (tests/cuda_harness/tma_emulation.cc, on the
// runtime's waiting and asynchronous-operation hooks declared below):
//   mbarrier: a pending arrival count and a transaction count per phase; a
//     phase completes when both are zero (then the arrivals are re-armed and
//     the phase parity flips); try_wait.parity is true once the phase of that
//     parity has completed. A try_wait that finds its phase incomplete blocks
//     the CUDA thread until the phase completes, or until no thread of the
//     block can run (its "time limit": it returns false); a second such stall
//     with no arrival, transaction or copy in between is a deadlock, reported
//     as one. Using a barrier before mbarrier.init, an arrival beyond the
//     pending count and a transaction count out of the ISA's range fail the
//     launch.
//   cp.async.bulk.tensor loads: asynchronous. At issue the destination is
//     poisoned (0xff bytes) and registered as pending on its barrier's phase;
//     the copy lands at a scheduling point the runtime picks (with
//     JAXOPS_HARNESS_SEED, at a random one; else as late as possible, when no
//     thread can run), reading the box from global memory by the map's dims,
//     strides and element strides, out-of-bounds elements zero, swizzled as
//     tma::swizzled_offset says, and completes its bytes on the barrier. A read
//     of a destination (tma::landed, ldmatrix) before its phase completes, a
//     load into a destination still pending, a destination not 128-byte
//     aligned (or not aligned to its swizzle pattern) fail the launch.
//   bulk stores and .add reductions (float32 only): asynchronous too, in the issuing thread's
//     bulk async-groups: they land at a random scheduling point (with a seed)
//     or at the cp.async.bulk.wait_group that covers them, reading the shared
//     box then, so a source overwritten before the wait stores the new data;
//     out-of-bounds elements are not written. A store with no fence.proxy.async
//     in the block since the issuing thread's previous one, and a thread
//     exiting with bulk groups not waited for, fail the launch. (Generic writes
//     are not tracked one by one: the fence check is that a fence was executed.)
//   bar.sync / bar.arrive id, count: count a multiple of 32 and at most the
//     block's threads; every thread arriving in one generation names the same
//     count; a generation completes with count arrivals, whole warps; a
//     mismatch fails the launch, a count never reached is a deadlock.
//   setmaxnreg: the value a multiple of 8 in [24, 256]; all 128 threads of the
//     warpgroup execute it with the same value (a warpgroup collective); .inc
//     never lowers and .dec never raises the warpgroup's recorded count; the
//     recorded counts of the block's warpgroups must fit the 64K-register file.
//     The plan is recorded per warpgroup (setmaxnreg_plan); execution is
//     otherwise unchanged.
//   elect.sync: a warp collective; the lowest lane is elected.
// Every instruction is counted (jaxops_harness_tma_counts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "cuda_on_cpu.h"
#include "tensor_map_emulation.h"

namespace jaxops_harness {

// -- the runtime's hooks (runtime.cc) ---------------------------------------------------

// A number of its own for every block the runtime runs (state of a block ends with it).
uint64_t block_serial();
// Runs `update` under the block's lock; a non-empty result fails the launch with
// that message. Then wakes the threads whose wait condition now holds.
void block_update(const std::function<std::string()>& update);
// Blocks the calling thread until `ready()` (evaluated under the block's lock)
// holds; returns true then. With `may_time_out`, returns false instead when no
// thread of the block can run and no asynchronous operation is in flight, once
// per such stall (a try_wait's time limit). `detail` adds the state waited on
// to a deadlock report.
bool block_wait(const char* op, Site site, const std::function<bool()>& ready, bool may_time_out,
                const std::function<std::string()>& detail);
// Queues an asynchronous operation: `land` runs once, under the block's lock,
// at a later scheduling point (random with a seed, else when no thread can
// run), or at land_async(id); then the waiters' conditions are re-checked.
uint64_t issue_async(std::function<void()> land);
void land_async(uint64_t id);
// The calling CUDA thread's index in its block, and names for reports.
int thread_index();
std::string thread_description(int index);
std::string shared_description(const void* p);

// -- the instructions (tma_emulation.cc) --------------------------------------------------

void mbarrier_init(uint64_t* bar, uint32_t count, Site site = Site::here());
void mbarrier_fence_init();
void mbarrier_invalidate(uint64_t* bar, Site site = Site::here());
// mbarrier.arrive, after expecting `tx_bytes` more (arrive.expect_tx when nonzero).
uint64_t mbarrier_arrive(uint64_t* bar, uint32_t tx_bytes, Site site = Site::here());
void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes, Site site = Site::here());
bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity, Site site = Site::here());

void tma_prefetch(const CUtensorMap* map, Site site = Site::here());
void tma_load(void* dst, const CUtensorMap* map, int rank, const int32_t* coords, uint64_t* bar,
              Site site = Site::here());
void tma_store(const CUtensorMap* map, int rank, const int32_t* coords, const void* src,
               bool reduce_add, Site site = Site::here());
void bulk_commit_group();
void bulk_wait_group(int pending, Site site = Site::here());

void named_barrier(uint32_t id, uint32_t threads, bool wait, Site site = Site::here());
void setmaxnreg(uint32_t registers, bool increase, Site site = Site::here());
void fence_proxy_async();
bool elect_one(Site site = Site::here());

// Fails the launch when any of the `bytes` bytes at `p` is the destination of
// a TMA load whose mbarrier phase has not completed.
void check_tma_landed(const void* p, size_t bytes, const char* op, Site site = Site::here());
// The per-thread register count warpgroup `warpgroup` of the last block that
// ran set by setmaxnreg (0: none).
int setmaxnreg_plan(int warpgroup);
// Called by the runtime when a thread's kernel returns: a message when it
// leaves bulk async-groups not waited for.
std::string tma_thread_exit_check(int thread);

}  // namespace jaxops_harness
