// Test-only: the bookkeeping of the wgmma emulation (include/wgmma_emulation.h):
// the warpgroup rendezvous of wgmma.mma_async, each CUDA thread's fence and
// commit-group counts, the accumulator hazards, and the shared-memory window the
// descriptors address. Built on the runtime's hooks of include/tma_emulation.h
// (block_update, block_wait, block_serial): the rendezvous state changes only
// inside block_update, under the block's lock, and waiting threads are released
// by block_wait's condition, so a warp that never arrives ends in the runtime's
// deadlock report, with the warps missing as its detail.
#include "cuda/wgmma.cuh"
#include "tma_emulation.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>

namespace jaxops_harness {
namespace {

namespace wg = jaxops::cuda::wgmma;

// One CUDA thread's wgmma state, reset when a new block first touches it. Only
// its own thread reads or writes a slot, so no lock is needed (and none orders
// the CUDA threads for ThreadSanitizer).
struct ThreadState {
  uint64_t block = 0;
  uint64_t fences = 0;
  uint64_t committed = 0;  // commit groups
  uint64_t completed = 0;  // groups covered by a wait_group
};
ThreadState g_threads[kMaxThreadsPerBlock];

ThreadState& thread_state() {
  ThreadState& s = g_threads[thread_index()];
  const uint64_t block = block_serial();
  if (s.block != block) s = ThreadState{block};
  return s;
}

// The rendezvous of one warpgroup (changed only under the block's lock).
struct Rendezvous {
  uint64_t block = 0;
  const char* name = nullptr;
  int arrived = 0;
  uint64_t generation = 0;  // products completed
  const WgmmaLane* in[128];
  float* out[128];
  bool present[128];
  WgmmaCompleter complete = nullptr;
};
Rendezvous g_warpgroups[kMaxThreadsPerBlock / 128];

std::atomic<unsigned long long> g_wgmmas[3];

std::string where() { return thread_description(thread_index()); }

const unsigned char* window_base() {
  const auto start = reinterpret_cast<uintptr_t>(dynamic_shared_memory());
  return reinterpret_cast<const unsigned char*>(start & ~uintptr_t{1023});
}

}  // namespace

void count_wgmma(int kind) { ++g_wgmmas[kind]; }

uint32_t wgmma_shared_address(const void* p) {
  const auto* start = static_cast<const unsigned char*>(dynamic_shared_memory());
  const auto* byte = static_cast<const unsigned char*>(p);
  if (byte < start || byte >= start + dynamic_shared_memory_bytes()) {
    fail_launch("wgmma shared_address: " + where() +
                " takes the address of a byte outside the block's dynamic shared memory "
                "(the harness gives shared addresses to dynamic shared memory only)");
  }
  return static_cast<uint32_t>(byte - window_base());
}

const unsigned char* wgmma_element(const WgmmaOperand& op, uint32_t mn, uint32_t k,
                                   std::string* error) {
  const wg::DescriptorFields f = wg::decode_descriptor(op.desc);
  if (f.base_offset != 0) {
    *error = "the descriptor's base offset is " + std::to_string(f.base_offset) +
             " (the harness emulates base offset 0: tiles aligned to their swizzle pattern)";
    return nullptr;
  }
  const uint32_t logical =
      f.start_address + wg::canonical_offset(op.mn_major ? wg::Major::kMN : wg::Major::kK,
                                             f.swizzle, op.element_bytes, f.leading_byte_offset,
                                             f.stride_byte_offset, mn, k);
  const uint32_t address = wg::swizzled_offset(f.swizzle, logical);
  const unsigned char* p = window_base() + address;
  const auto* start = static_cast<const unsigned char*>(dynamic_shared_memory());
  if (p < start || p + op.element_bytes > start + dynamic_shared_memory_bytes()) {
    *error = "element (" + std::to_string(mn) + ", " + std::to_string(k) +
             ") is at shared address " + std::to_string(address) +
             ", outside the block's dynamic shared memory";
    return nullptr;
  }
  return p;
}

void wgmma_check_operand(const char* name, const WgmmaOperand& op, int rows_mn, int k_extent) {
  const int rank = thread_index() % 128;
  std::string error;
  for (int e = rank; e < rows_mn * k_extent; e += 128) {
    const unsigned char* p = wgmma_element(op, e / k_extent, e % k_extent, &error);
    if (p == nullptr) fail_launch(std::string(name) + ": " + where() + ": " + error);
    check_tma_landed(p, op.element_bytes, name);
    // Read here, outside the runtime's lock, so that ThreadSanitizer sees this
    // thread read bytes other threads wrote: a missing barrier between the
    // writes and the product is a race it reports (the product itself reads
    // under the lock, which it ignores).
    unsigned char bytes[4];
    for (int byte = 0; byte < op.element_bytes; ++byte) {
      bytes[byte] = static_cast<const volatile unsigned char*>(p)[byte];
    }
    (void)bytes;
  }
}

void wgmma_access(WgmmaAccumulatorState& state, int element) {
  ThreadState& t = thread_state();
  if (state.block != t.block) {  // an accumulator of an earlier block: nothing pending
    state = WgmmaAccumulatorState{};
    state.block = t.block;
  }
  if (state.group != WgmmaAccumulatorState::kNone && state.group >= t.completed) {
    const bool committed = state.group < t.committed;
    fail_launch("wgmma accumulator: " + where() + " accesses element " + std::to_string(element) +
                " of an accumulator whose wgmma.mma_async is still pending: " +
                (committed ? "its commit group " + std::to_string(state.group) +
                                 " is not covered by a wgmma.wait_group yet (" +
                                 std::to_string(t.completed) + " of " +
                                 std::to_string(t.committed) + " groups waited for)"
                           : std::string("it was never committed (wgmma.commit_group)")));
  }
  state.group = WgmmaAccumulatorState::kNone;
  state.accessed_at_fence = t.fences;
}

void wgmma_fence() { ++thread_state().fences; }

void wgmma_commit_group() { ++thread_state().committed; }

void wgmma_wait_group(int pending) {
  ThreadState& t = thread_state();
  if (t.committed >= static_cast<uint64_t>(pending)) {
    t.completed = std::max(t.completed, t.committed - static_cast<uint64_t>(pending));
  }
}

void wgmma_collective(const char* name, WgmmaAccumulatorState& state, const WgmmaLane& in,
                      float* out, WgmmaCompleter complete) {
  ThreadState& t = thread_state();
  if (state.block != t.block) {
    state = WgmmaAccumulatorState{};
    state.block = t.block;
  }
  if (t.fences == 0) {
    fail_launch(std::string(name) + ": " + where() +
                " issues a wgmma.mma_async with no wgmma.fence before it");
  }
  if (state.accessed_at_fence == t.fences) {
    fail_launch(std::string(name) + ": " + where() +
                " issues a wgmma.mma_async on an accumulator it accessed after its last "
                "wgmma.fence (the fence must come between register accesses and the product)");
  }
  const int index = thread_index();
  const int group = index / 128, rank = index % 128;
  const ThreadContext& ctx = this_thread();
  const unsigned threads = ctx.block_dim.x * ctx.block_dim.y * ctx.block_dim.z;
  if (static_cast<unsigned>(group + 1) * 128 > threads) {
    fail_launch(std::string(name) + ": " + where() + " is in warpgroup " + std::to_string(group) +
                " of a block of " + std::to_string(threads) +
                " threads: a warpgroup is 4 whole warps (128 threads)");
  }
  Rendezvous& r = g_warpgroups[group];
  uint64_t generation = 0;
  block_update([&]() -> std::string {
    if (r.block != t.block) {
      r = Rendezvous{};
      r.block = t.block;
    }
    if (r.arrived == 0) {
      r.name = name;
      r.complete = complete;
      for (bool& p : r.present) p = false;
    } else if (r.complete != complete) {
      return std::string(name) + ": " + where() + " arrives while its warpgroup waits at " +
             r.name + " (another product or shape)";
    }
    generation = r.generation;
    r.in[rank] = &in;
    r.out[rank] = out;
    r.present[rank] = true;
    if (++r.arrived < 128) return {};
    r.arrived = 0;
    ++r.generation;
    return r.complete(r.in, r.out);
  });
  const std::function<bool()> done = [&] { return r.generation != generation; };
  const std::function<std::string()> detail = [&] {
    std::string missing;
    for (int w = 0; w < 4; ++w) {
      int absent = 0;
      for (int l = 0; l < 32; ++l) absent += !r.present[32 * w + l];
      if (absent > 0) {
        missing += " warp " + std::to_string(4 * group + w) + " (" + std::to_string(absent) +
                   " of its 32 threads)";
      }
    }
    return std::to_string(r.arrived) + " of the 128 threads of warpgroup " +
           std::to_string(group) + " arrived at " + name + "; missing:" + missing;
  };
  block_wait(name, Site::here(), done, false, detail);
  state.group = t.committed;
  state.accessed_at_fence = WgmmaAccumulatorState::kNone;
}

}  // namespace jaxops_harness

// Emulated wgmma.mma_async products so far on one operand type (0 f16, 1 bf16, 2 tf32).
extern "C" unsigned long long jaxops_harness_wgmmas(int kind) {
  return jaxops_harness::g_wgmmas[kind].load();
}
