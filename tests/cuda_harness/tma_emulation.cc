// Test-only: the emulation of cuda/tma.cuh's sm_90 instructions (the semantics
// and hazards are listed in include/tma_emulation.h). The state of a block
// (its mbarriers, pending TMA destinations, named barriers, warpgroups, bulk
// groups) lives here, is created afresh for every block (block_serial), and is
// touched only under the block's lock: inside block_update / block_wait
// conditions, or in an asynchronous operation's landing.
#include "tma_emulation.h"

#include <atomic>
#include <cstdio>
#include <deque>
#include <map>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "cuda/tma.cuh"
#include "mma_emulation.h"

#if defined(__SANITIZE_THREAD__)
extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#define JAXOPS_TSAN_RELEASE(p) __tsan_release(const_cast<void*>(static_cast<const void*>(p)))
#define JAXOPS_TSAN_ACQUIRE(p) __tsan_acquire(const_cast<void*>(static_cast<const void*>(p)))
#else
#define JAXOPS_TSAN_RELEASE(p) ((void)(p))
#define JAXOPS_TSAN_ACQUIRE(p) ((void)(p))
#endif

namespace jaxops_harness {
namespace {

using jaxops::cuda::tma::Swizzle;
using jaxops::cuda::tma::swizzle_repeat_bytes;
using jaxops::cuda::tma::swizzled_offset;

constexpr int64_t kMaxTxCount = (int64_t{1} << 20) - 1;  // the ISA's tx-count range
constexpr uint32_t kMaxArrivals = (1u << 20) - 1;
constexpr int kRegisterFile = 65536;

enum Counter { kLoads, kStores, kReductions, kNamedBarriers, kSetmaxnregs, kCounters };
std::atomic<unsigned long long> g_counts[kCounters];

struct Mbarrier {
  uint32_t expected = 0;
  uint32_t pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;  // phases completed so far; the current one's parity is phase & 1
};

// A TMA load's destination, pending until phase `phase` of barrier `bar` completes.
struct PendingRegion {
  uintptr_t begin, end;
  uintptr_t bar;
  uint64_t phase;
  int thread;
};

struct NamedBarrier {
  uint32_t count = 0;
  uint32_t arrived = 0;
  uint64_t generation = 0;
  int first_thread = -1;
  std::map<int, unsigned> warp_lanes;
  char clocks[2] = {};  // TSan: the ordering of one generation, used in turn
};

struct Warpgroup {
  uint32_t arrived = 0;
  uint32_t value = 0;
  bool increase = false;
  uint64_t generation = 0;
  int first_thread = -1;
  int plan = 0;
};

struct ThreadBulk {
  std::vector<uint64_t> uncommitted;
  std::deque<std::vector<uint64_t>> groups;
  uint64_t fences_at_last_store = 0;
};

struct State {
  uint64_t serial = 0;
  std::unordered_map<uintptr_t, Mbarrier> barriers;
  std::vector<PendingRegion> regions;
  NamedBarrier named[16];
  std::vector<Warpgroup> warpgroups;
  uint64_t fences = 0;
  std::unordered_map<int, ThreadBulk> bulk;
};

// The running block's state (blocks run one at a time); the last block's
// stays readable after its launch (setmaxnreg_plan).
State g_state;
// The serials of the last blocks that issued a TMA load and a bulk store: the
// checks every ldmatrix lane and every thread exit run return at once, without
// the block's lock, in a block that used neither (every sm_80 kernel).
std::atomic<uint64_t> g_serial_with_loads{0}, g_serial_with_stores{0};

State& state() {
  const uint64_t serial = block_serial();
  if (g_state.serial != serial) {
    g_state.~State();
    new (&g_state) State();
    g_state.serial = serial;
  }
  return g_state;
}

std::string where(const char* op, Site site) {
  return std::string(op) + " at " + site.file + ":" + std::to_string(site.line) + ": " +
         thread_description(thread_index());
}

std::string barrier_state(uintptr_t address, const Mbarrier& m) {
  std::ostringstream out;
  out << "mbarrier at " << shared_description(reinterpret_cast<const void*>(address))
      << " in phase " << m.phase << " (parity " << (m.phase & 1) << "): " << m.pending << " of "
      << m.expected << " arrivals and " << m.tx << " transaction bytes pending";
  return out.str();
}

// Completes the barrier's phase when its arrivals and transactions are done:
// the TMA destinations that waited for it become readable.
void complete_if_done(uintptr_t address, Mbarrier& m) {
  if (m.pending != 0 || m.tx != 0) return;
  auto& regions = g_state.regions;
  for (size_t i = 0; i < regions.size();) {
    if (regions[i].bar == address && regions[i].phase <= m.phase) {
      regions.erase(regions.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  ++m.phase;
  m.pending = m.expected;
}

std::string add_tx(uintptr_t address, Mbarrier& m, int64_t bytes) {
  m.tx += bytes;
  if (m.tx > kMaxTxCount || m.tx < -kMaxTxCount) {
    return "the transaction count of the " + barrier_state(address, m) +
           " is out of the ISA's range [-(2^20 - 1), 2^20 - 1]";
  }
  return "";
}

const TensorMapParams& params_of(const CUtensorMap* map, int rank, const char* op, Site site) {
  const TensorMapParams* p = tensor_map_params(map);
  if (p == nullptr) {
    fail_launch(where(op, site) + " names a tensor map that cuTensorMapEncodeTiled did not encode");
  }
  if (p->rank != rank) {
    fail_launch(where(op, site) + " is a " + std::to_string(rank) + "D copy with a " +
                std::to_string(p->rank) + "D tensor map");
  }
  return *p;
}

// The box's extent in elements along each dimension (element strides applied)
// and its bytes in shared memory.
size_t box_extents(const TensorMapParams& p, uint32_t (&extent)[5]) {
  size_t elements = 1;
  for (int i = 0; i < p.rank; ++i) {
    extent[i] = (p.box[i] + p.element_strides[i] - 1) / p.element_strides[i];
    elements *= extent[i];
  }
  return elements * p.element_bytes;
}

void check_shared_alignment(const void* smem, const TensorMapParams& p, const char* op,
                            Site site) {
  const auto address = reinterpret_cast<uintptr_t>(smem);
  const uint32_t repeat = swizzle_repeat_bytes(static_cast<Swizzle>(p.swizzle));
  if (address % 128 != 0 || address % repeat != 0) {
    fail_launch(where(op, site) + ": its shared-memory box at " + shared_description(smem) +
                " is not aligned to " + std::to_string(repeat > 128 ? repeat : 128) +
                " bytes (128, and the swizzle pattern's repeat, as the tiles assume)");
  }
}

// Visits every element of the box: `visit(shared byte offset (swizzled),
// global address or null when out of bounds)`.
template <typename Visit>
void for_each_box_element(const TensorMapParams& p, const int32_t* coords, Visit visit) {
  uint32_t extent[5];
  const size_t bytes = box_extents(p, extent);
  const auto swizzle = static_cast<Swizzle>(p.swizzle);
  const size_t elements = bytes / p.element_bytes;
  for (size_t e = 0; e < elements; ++e) {
    size_t rest = e;
    bool inside = true;
    uint64_t offset = 0;
    for (int d = 0; d < p.rank; ++d) {
      const int64_t index = static_cast<int64_t>(rest % extent[d]);
      rest /= extent[d];
      const int64_t coordinate = int64_t{coords[d]} + index * p.element_strides[d];
      if (coordinate < 0 || coordinate >= static_cast<int64_t>(p.dims[d])) inside = false;
      offset += static_cast<uint64_t>(coordinate) * p.byte_strides[d];
    }
    const auto shared = static_cast<uint32_t>(e * p.element_bytes);
    visit(swizzled_offset(swizzle, shared), inside ? p.global + offset : nullptr);
  }
}

// global += shared for one float32 element of a .add reduction (the dQ
// accumulation; the other types the ISA reduces are not emulated).
void reduce_add_element(unsigned char* global, const unsigned char* shared) {
  float a, b;
  std::memcpy(&a, global, 4);
  std::memcpy(&b, shared, 4);
  a += b;
  std::memcpy(global, &a, 4);
}

int block_threads() {
  const dim3 d = this_thread().block_dim;
  return static_cast<int>(d.x * d.y * d.z);
}

void complete_elect(const Collective& op) {
  const int leader = __builtin_ctz(op.mask);
  for (int lane = 0; lane < 32; ++lane) {
    if (op.mask >> lane & 1u) *static_cast<int*>(op.out[lane]) = lane == leader;
  }
}

}  // namespace

// -- mbarrier ------------------------------------------------------------------------------

void mbarrier_init(uint64_t* bar, uint32_t count, Site site) {
  const auto address = reinterpret_cast<uintptr_t>(bar);
  if (address % 8 != 0) fail_launch(where("mbarrier.init", site) + ": the barrier is not 8-byte aligned");
  if (count < 1 || count > kMaxArrivals) {
    fail_launch(where("mbarrier.init", site) + ": arrival count " + std::to_string(count) +
                " is not in [1, 2^20 - 1]");
  }
  block_update([&] {
    Mbarrier& m = state().barriers[address];
    m = Mbarrier{count, count, 0, 0};
    return std::string();
  });
}

// The emulated barrier state is visible to every thread as soon as it is
// written; the fence orders nothing more here.
void mbarrier_fence_init() {}

void mbarrier_invalidate(uint64_t* bar, Site site) {
  block_update([&] {
    if (state().barriers.erase(reinterpret_cast<uintptr_t>(bar)) == 0) {
      return where("mbarrier.inval", site) + ": " +
             shared_description(bar) + " is not an initialised mbarrier";
    }
    return std::string();
  });
}

uint64_t mbarrier_arrive(uint64_t* bar, uint32_t tx_bytes, Site site) {
  const char* op = tx_bytes != 0 ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive";
  const auto address = reinterpret_cast<uintptr_t>(bar);
  uint64_t token = 0;
  JAXOPS_TSAN_RELEASE(bar);
  block_update([&] {
    const auto it = state().barriers.find(address);
    if (it == g_state.barriers.end()) {
      return where(op, site) + ": " + shared_description(bar) + " is not an initialised mbarrier";
    }
    Mbarrier& m = it->second;
    if (tx_bytes != 0) {
      std::string error = add_tx(address, m, tx_bytes);
      if (!error.empty()) return where(op, site) + ": " + error;
    }
    if (m.pending == 0) {
      return where(op, site) + ": an arrival beyond the arrival count on the " +
             barrier_state(address, m);
    }
    --m.pending;
    token = m.phase & 1;
    complete_if_done(address, m);
    return std::string();
  });
  return token;
}

void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes, Site site) {
  const auto address = reinterpret_cast<uintptr_t>(bar);
  block_update([&] {
    const auto it = state().barriers.find(address);
    if (it == g_state.barriers.end()) {
      return where("mbarrier.expect_tx", site) + ": " + shared_description(bar) +
             " is not an initialised mbarrier";
    }
    std::string error = add_tx(address, it->second, tx_bytes);
    return error.empty() ? error : where("mbarrier.expect_tx", site) + ": " + error;
  });
}

bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity, Site site) {
  const auto address = reinterpret_cast<uintptr_t>(bar);
  bool missing = false;
  const std::function<bool()> ready = [&] {
    const auto it = state().barriers.find(address);
    if (it == g_state.barriers.end()) return missing = true;
    return (it->second.phase & 1) != (parity & 1);
  };
  const std::function<std::string()> detail = [&] {
    const auto it = g_state.barriers.find(address);
    return it == g_state.barriers.end() ? std::string("an invalidated mbarrier")
                                        : barrier_state(address, it->second) +
                                              ", waiting for parity " + std::to_string(parity & 1);
  };
  const bool done = block_wait("mbarrier.try_wait.parity", site, ready, true, detail);
  if (missing) {
    fail_launch(where("mbarrier.try_wait.parity", site) + ": " + shared_description(bar) +
                " is not an initialised mbarrier");
  }
  if (done) JAXOPS_TSAN_ACQUIRE(bar);
  return done;
}

// -- TMA --------------------------------------------------------------------------------------

void tma_prefetch(const CUtensorMap* map, Site site) {
  if (tensor_map_params(map) == nullptr) {
    fail_launch(where("prefetch.tensormap", site) +
                " names a tensor map that cuTensorMapEncodeTiled did not encode");
  }
}

void tma_load(void* dst, const CUtensorMap* map, int rank, const int32_t* coords, uint64_t* bar,
              Site site) {
  const char* op = "cp.async.bulk.tensor (load)";
  const TensorMapParams p = params_of(map, rank, op, site);
  check_shared_alignment(dst, p, op, site);
  uint32_t extent[5];
  const size_t bytes = box_extents(p, extent);
  const auto begin = reinterpret_cast<uintptr_t>(dst), address = reinterpret_cast<uintptr_t>(bar);
  const int thread = thread_index();
  // The poison is the copy's first write, seen by TSan as this thread's; the
  // release on the barrier orders it (and the landing, which TSan does not
  // see) before the reads of the threads that pass the phase's wait. Readers
  // of the previous contents must be ordered before it (an `empty` barrier).
  poison(dst, bytes);
  JAXOPS_TSAN_RELEASE(bar);
  g_serial_with_loads = block_serial();
  block_update([&] {
    State& s = state();
    const auto it = s.barriers.find(address);
    if (it == s.barriers.end()) {
      return where(op, site) + ": its mbarrier " + shared_description(bar) +
             " is not initialised";
    }
    for (const PendingRegion& r : s.regions) {
      if (r.begin < begin + bytes && begin < r.end) {
        return where(op, site) + ": it loads into " + shared_description(dst) +
               ", where a TMA load of " + thread_description(r.thread) +
               " is still pending (its mbarrier phase has not completed)";
      }
    }
    s.regions.push_back({begin, begin + bytes, address, it->second.phase, thread});
    return std::string();
  });
  int32_t at[5] = {};
  for (int d = 0; d < rank; ++d) at[d] = coords[d];
  auto* smem = static_cast<unsigned char*>(dst);
  issue_async([p, at, smem, address, bytes] {
    for_each_box_element(p, at, [&](uint32_t shared, const unsigned char* global) {
      if (global != nullptr) {
        std::memcpy(smem + shared, global, p.element_bytes);
      } else {
        std::memset(smem + shared, 0, p.element_bytes);
      }
    });
    const auto it = g_state.barriers.find(address);
    if (it == g_state.barriers.end()) return;  // invalidated: the bytes complete nothing
    it->second.tx -= static_cast<int64_t>(bytes);
    complete_if_done(address, it->second);
  });
  ++g_counts[kLoads];
}

void tma_store(const CUtensorMap* map, int rank, const int32_t* coords, const void* src,
               bool reduce_add, Site site) {
  const char* op = reduce_add ? "cp.reduce.async.bulk.tensor.add" : "cp.async.bulk.tensor (store)";
  const TensorMapParams p = params_of(map, rank, op, site);
  check_shared_alignment(src, p, op, site);
  for (int d = 1; d < rank; ++d) {
    if (p.element_strides[d] != 1) {
      fail_launch(where(op, site) + ": the harness stores only with element strides of 1");
    }
  }
  if (reduce_add && p.data_type != CU_TENSOR_MAP_DATA_TYPE_FLOAT32) {
    fail_launch(where(op, site) + ": the harness emulates .add reductions of float32 tensors only");
  }
  uint32_t extent[5];
  const size_t bytes = box_extents(p, extent);
  check_tma_landed(src, bytes, op, site);
  const int thread = thread_index();
  g_serial_with_stores = block_serial();
  block_update([&] {
    State& s = state();
    ThreadBulk& t = s.bulk[thread];
    if (s.fences == t.fences_at_last_store) {
      return where(op, site) + ": no fence.proxy.async since " +
             (t.groups.empty() && t.uncommitted.empty() && t.fences_at_last_store == 0
                  ? std::string("the block started")
                  : std::string("this thread's previous bulk store")) +
             ": the generic-proxy writes of its shared-memory source are not ordered before "
             "the async proxy reads them";
    }
    t.fences_at_last_store = s.fences;
    return std::string();
  });
  int32_t at[5] = {};
  for (int d = 0; d < rank; ++d) at[d] = coords[d];
  const auto* smem = static_cast<const unsigned char*>(src);
  const uint64_t id = issue_async([p, at, smem, reduce_add] {
    for_each_box_element(p, at, [&](uint32_t shared, const unsigned char* global) {
      if (global == nullptr) return;
      auto* out = const_cast<unsigned char*>(global);
      if (reduce_add) {
        reduce_add_element(out, smem + shared);
      } else {
        std::memcpy(out, smem + shared, p.element_bytes);
      }
    });
  });
  block_update([&] {
    state().bulk[thread].uncommitted.push_back(id);
    return std::string();
  });
  ++g_counts[reduce_add ? kReductions : kStores];
}

void bulk_commit_group() {
  const int thread = thread_index();
  block_update([&] {
    ThreadBulk& t = state().bulk[thread];
    t.groups.push_back(std::move(t.uncommitted));
    t.uncommitted.clear();
    return std::string();
  });
}

void bulk_wait_group(int pending, Site) {
  const int thread = thread_index();
  std::vector<uint64_t> due;
  block_update([&] {
    ThreadBulk& t = state().bulk[thread];
    while (static_cast<int>(t.groups.size()) > pending) {
      due.insert(due.end(), t.groups.front().begin(), t.groups.front().end());
      t.groups.pop_front();
    }
    return std::string();
  });
  for (const uint64_t id : due) land_async(id);
}

std::string tma_thread_exit_check(int thread) {
  std::string message;
  if (g_serial_with_stores != block_serial()) return message;
  block_update([&] {
    const auto it = state().bulk.find(thread);
    if (it != g_state.bulk.end() && (!it->second.groups.empty() || !it->second.uncommitted.empty())) {
      message = thread_description(thread) + " exited with " +
                std::to_string(it->second.groups.size()) + " bulk async-group(s) and " +
                std::to_string(it->second.uncommitted.size()) +
                " uncommitted bulk store(s) not waited for (cp.async.bulk.wait_group): their "
                "shared-memory sources may be gone before they are read";
    }
    return std::string();
  });
  return message;
}

void check_tma_landed(const void* p, size_t bytes, const char* op, Site site) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  if (g_serial_with_loads != block_serial()) return;
  block_update([&] {
    for (const PendingRegion& r : state().regions) {
      if (r.begin < begin + bytes && begin < r.end) {
        const uintptr_t first = begin > r.begin ? begin : r.begin;
        const auto it = g_state.barriers.find(r.bar);
        return where(op, site) + " reads " + shared_description(reinterpret_cast<const void*>(first)) +
               ", the destination of a TMA load of " + thread_description(r.thread) +
               " whose mbarrier phase has not completed (" +
               (it == g_state.barriers.end() ? std::string("invalidated mbarrier")
                                             : barrier_state(r.bar, it->second)) +
               ")";
      }
    }
    return std::string();
  });
}

// -- named barriers, setmaxnreg, fences, elect ----------------------------------------------

void named_barrier(uint32_t id, uint32_t threads, bool wait, Site site) {
  const char* op = wait ? "bar.sync" : "bar.arrive";
  const int block = block_threads();
  if (id >= 16 || threads == 0 || threads % 32 != 0 || static_cast<int>(threads) > block) {
    fail_launch(where(op, site) + ": barrier " + std::to_string(id) + " with " +
                std::to_string(threads) + " threads (ids 0..15; a nonzero multiple of 32 "
                "threads, at most the block's " + std::to_string(block) + ")");
  }
  const int thread = thread_index();
  uint64_t generation = 0;
  bool completed = false;
  char* clock = nullptr;
  block_update([&] {
    NamedBarrier& nb = state().named[id];
    clock = &nb.clocks[nb.generation % 2];
    if (nb.arrived == 0) {
      nb.count = threads;
      nb.first_thread = thread;
    } else if (nb.count != threads) {
      return where(op, site) + ": barrier " + std::to_string(id) + " with " +
             std::to_string(threads) + " threads, while " + thread_description(nb.first_thread) +
             " arrived at it with " + std::to_string(nb.count);
    }
    ++nb.arrived;
    nb.warp_lanes[thread / 32] |= 1u << (thread % 32);
    generation = nb.generation;
    if (nb.arrived < nb.count) return std::string();
    for (const auto& [warp, lanes] : nb.warp_lanes) {
      const int in_warp = std::min(32, block - warp * 32);
      const unsigned all = in_warp == 32 ? 0xffffffffu : (1u << in_warp) - 1u;
      if (lanes != all) {
        std::ostringstream out;
        out << where(op, site) << ": barrier " << id << " completed with " << threads
            << " threads, of which warp " << warp << " only lanes 0x" << std::hex << lanes
            << " (bar is .aligned: whole warps arrive)";
        return out.str();
      }
    }
    nb.arrived = 0;
    nb.warp_lanes.clear();
    ++nb.generation;
    completed = true;
    return std::string();
  });
  ++g_counts[kNamedBarriers];
  JAXOPS_TSAN_RELEASE(clock);
  if (!wait) return;
  if (!completed) {
    const std::function<bool()> ready = [&] { return g_state.named[id].generation != generation; };
    const std::function<std::string()> detail = [&] {
      const NamedBarrier& nb = g_state.named[id];
      return "named barrier " + std::to_string(id) + ": " + std::to_string(nb.arrived) + " of " +
             std::to_string(nb.count) + " threads arrived";
    };
    block_wait(op, site, ready, false, detail);
  }
  JAXOPS_TSAN_ACQUIRE(clock);
}

void setmaxnreg(uint32_t registers, bool increase, Site site) {
  const char* op = increase ? "setmaxnreg.inc.sync.aligned" : "setmaxnreg.dec.sync.aligned";
  const int block = block_threads();
  if (registers < 24 || registers > 256 || registers % 8 != 0) {
    fail_launch(where(op, site) + ": " + std::to_string(registers) +
                " registers (a multiple of 8 in [24, 256])");
  }
  if (block % 128 != 0) {
    fail_launch(where(op, site) + ": the block's " + std::to_string(block) +
                " threads are not whole warpgroups of 128");
  }
  const int thread = thread_index(), group = thread / 128;
  uint64_t generation = 0;
  bool completed = false;
  block_update([&] {
    State& s = state();
    s.warpgroups.resize(static_cast<size_t>(block / 128));
    Warpgroup& w = s.warpgroups[static_cast<size_t>(group)];
    if (w.arrived == 0) {
      w.value = registers;
      w.increase = increase;
      w.first_thread = thread;
    } else if (w.value != registers || w.increase != increase) {
      return where(op, site) + ": " + std::to_string(registers) + " registers, while " +
             thread_description(w.first_thread) + " of its warpgroup executed setmaxnreg." +
             (w.increase ? "inc " : "dec ") + std::to_string(w.value);
    }
    generation = w.generation;
    if (++w.arrived < 128) return std::string();
    if (w.plan != 0 && (increase ? static_cast<int>(registers) < w.plan
                                 : static_cast<int>(registers) > w.plan)) {
      return where(op, site) + ": warpgroup " + std::to_string(group) + " goes from " +
             std::to_string(w.plan) + " to " + std::to_string(registers) + " registers";
    }
    w.plan = static_cast<int>(registers);
    int total = 0;
    for (const Warpgroup& other : s.warpgroups) total += other.plan * 128;
    if (total > kRegisterFile) {
      return where(op, site) + ": the warpgroups' register counts need " +
             std::to_string(total) + " registers, more than the SM's " +
             std::to_string(kRegisterFile);
    }
    w.arrived = 0;
    ++w.generation;
    completed = true;
    return std::string();
  });
  ++g_counts[kSetmaxnregs];
  if (completed) return;
  const std::function<bool()> ready = [&] {
    return g_state.warpgroups[static_cast<size_t>(group)].generation != generation;
  };
  const std::function<std::string()> detail = [&] {
    return "warpgroup " + std::to_string(group) + ": " +
           std::to_string(g_state.warpgroups[static_cast<size_t>(group)].arrived) +
           " of its 128 threads arrived";
  };
  block_wait(op, site, ready, false, detail);
}

void fence_proxy_async() {
  block_update([] {
    ++state().fences;
    return std::string();
  });
}

bool elect_one(Site site) {
  int elected = 0;
  const int in = 0;
  warp_collective("elect.sync", site, 0xffffffffu, &in, &elected, &complete_elect);
  return elected != 0;
}

int setmaxnreg_plan(int warpgroup) {
  if (warpgroup < 0 || static_cast<size_t>(warpgroup) >= g_state.warpgroups.size()) return 0;
  return g_state.warpgroups[static_cast<size_t>(warpgroup)].plan;
}

}  // namespace jaxops_harness

// TMA loads, stores, .add reductions, named-barrier arrivals and setmaxnreg
// executions so far (by `which`, in that order), so a test can tell that a
// kernel took the sm_90 path.
extern "C" unsigned long long jaxops_harness_tma_counts(int which) {
  if (which < 0 || which >= jaxops_harness::kCounters) return 0;
  return jaxops_harness::g_counts[which].load();
}
