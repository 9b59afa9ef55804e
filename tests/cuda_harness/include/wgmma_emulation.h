// Test-only: the sm_90a warpgroup products of cuda/wgmma.cuh emulated on the CPU
// with their PTX ISA semantics (see that file for the layouts) and hazards. The
// products themselves are in wgmma_emulation_products.h; the bookkeeping in
// tests/cuda_harness/wgmma_emulation.cc, on the runtime's waiting hooks of
// tma_emulation.h.
//   wgmma.mma_async: a collective of the warpgroup, the 128 consecutive threads
//     (4 warps) holding the caller: every one must arrive with the same
//     descriptors and scale-d, else the launch fails (a warpgroup cut short by
//     the block size, a thread arriving with other operands); a thread that
//     never arrives (a warp that skipped the product) leaves the others
//     waiting, reported as a deadlock that names the warps missing. The last
//     to arrive computes D = A B + (scale-d ? C : 0): A and B read from shared
//     memory through their descriptors (start, LBO, SBO and swizzle exactly as
//     the hardware reads them; base offset 0 only) or A from the threads'
//     registers, products exact in float summed in float over k onto C (TF32
//     operands: the top 19 bits of the float32 patterns, as the tensor cores
//     read them). Each thread first checks the shared bytes it is assigned
//     (every 128th element of A and B) against the dynamic shared memory's
//     bounds and against TMA loads still in flight (check_tma_landed), and
//     reads them outside the runtime's lock, so that ThreadSanitizer sees a
//     barrier missing before the product as a race.
//   Accumulator hazards: a product's accumulator is pending from its issue until
//     a wgmma.wait_group that covers the group it was committed in (PTX
//     counting: wait_group N completes all but the N most recent groups; a
//     product never committed is never covered); any operator[] access before
//     then fails the launch. A product whose accumulator was accessed since
//     the thread's last wgmma.fence (or with no fence yet) fails the launch;
//     products chained on one accumulator need none, as in the ISA.
//   Not checked: writes of the RS A registers after the fence (they are plain
//     registers); fence.proxy.async between generic stores and the product.
// Shared-memory addresses (wgmma_shared_address): dynamic shared memory only,
// as the offset from the 1024-byte boundary at or below its start, so that
// alignments of pointers and of shared addresses agree as on a GPU.
// Products are counted (jaxops_harness_wgmmas).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda_on_cpu.h"

namespace jaxops_harness {

// The pending state of one thread's accumulator fragment.
struct WgmmaAccumulatorState {
  static constexpr uint64_t kNone = ~uint64_t{0};
  // The thread's commit group the last product on it joins (its count of
  // commits at the issue), kNone when no product is pending.
  uint64_t group = kNone;
  // The thread's fence count at the last operator[] access since the last product.
  uint64_t accessed_at_fence = kNone;
  uint64_t block = 0;  // block_serial of the product (a new block starts clean)
};

// operator[] of an Accumulator: fails the launch while a product is pending on it.
void wgmma_access(WgmmaAccumulatorState& state, int element);
void wgmma_fence();
void wgmma_commit_group();
void wgmma_wait_group(int pending);
uint32_t wgmma_shared_address(const void* p);

// Fails the launch with `message` (runtime.cc; also declared by mma_emulation.h).
[[noreturn]] void fail_launch(const std::string& message);
// Bytes of the block's dynamic shared memory (runtime.cc).
size_t dynamic_shared_memory_bytes();

}  // namespace jaxops_harness
