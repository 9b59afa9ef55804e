// Test-only: the execution engine behind cuda_on_cpu.h. See that header for the
// model. Two ways to run the threads of a block:
//   fibers (default): one ucontext fiber per CUDA thread on the launching OS
//     thread; a scheduler runs them until they block at a barrier or a warp
//     collective, in thread order or, with a seed, in a random order;
//   threads (JAXOPS_HARNESS_MODE=threads): one OS thread per CUDA thread.
// TSan sees shared-memory races between the CUDA threads either way: as OS
// threads, or as TSan fibers (run_fibers), 3-10x faster (a barrier of 256 OS
// threads is 256 futex wake-ups).
// Both share the bookkeeping below (one state per block, guarded by a mutex in
// the threads mode), which turns every misuse it can see into a report: threads
// at different barriers, a thread exiting while others wait at a barrier or a
// warp collective, masks naming lanes
// that do not exist or have exited, and deadlock (every live thread waiting,
// which is also how lanes that never meet at a collective end).
#include "cuda_on_cpu.h"
#include "mma_emulation.h"
#include "tma_emulation.h"
#include "wgmma_emulation.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <dlfcn.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define JAXOPS_HARNESS_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define JAXOPS_HARNESS_TSAN 1
// The runtime's own locking would order every pair of CUDA threads for TSan
// (each shuffle takes the block's mutex), hiding the races it should find. So
// its critical sections are invisible to TSan, and the barriers add exactly the
// orderings CUDA guarantees: __syncthreads orders the block, __syncwarp its lanes.
extern "C" {
void AnnotateIgnoreSyncBegin(const char*, int);
void AnnotateIgnoreSyncEnd(const char*, int);
void AnnotateIgnoreReadsBegin(const char*, int);
void AnnotateIgnoreReadsEnd(const char*, int);
void AnnotateIgnoreWritesBegin(const char*, int);
void AnnotateIgnoreWritesEnd(const char*, int);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
}
// __tsan_switch_to_fiber's flag: the switch orders nothing.
constexpr unsigned kTsanSwitchNoSync = 1;
#endif

// Bounds of the section holding every static __shared__ variable of this binary.
extern "C" {
extern char __start_jaxops_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_jaxops_shared[] __attribute__((weak, visibility("hidden")));
}

namespace jaxops_harness {
namespace {

enum class Mode { kFibers, kThreads };

struct Settings {
  Mode mode = Mode::kFibers;
  uint64_t seed = 0;  // 0: thread and block order as numbered; else random with this seed
};

Settings settings_from_env() {
  Settings s;
  if (const char* mode = std::getenv("JAXOPS_HARNESS_MODE")) {
    if (std::string(mode) == "threads") s.mode = Mode::kThreads;
  }
  if (const char* seed = std::getenv("JAXOPS_HARNESS_SEED")) s.seed = std::strtoull(seed, nullptr, 10);
  return s;
}

Settings& settings() {
  static Settings s = settings_from_env();
  return s;
}

std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

uint64_t g_launches = 0;
thread_local cudaError_t tls_last_error = cudaSuccess;
thread_local std::string tls_last_report;

// Thrown into a waiting thread when its block failed, to unwind its kernel.
struct Aborted {};

// A cp.async in flight: its destination and the 16 bytes it will write there.
struct AsyncCopy {
  void* dst;
  unsigned char bytes[16];
};

struct Thread {
  ThreadContext ctx;
  int index = 0;
  int warp = 0;
  bool started = false;
  bool exited = false;
  bool blocked = false;
  bool at_barrier = false;
  uint64_t barriers_passed = 0;
  const char* wait_op = nullptr;
  Site wait_site{};
  ucontext_t context;
  void* fake_stack = nullptr;
  // cp.async: the copies issued since the last commit, and the committed
  // groups not yet waited for, oldest first.
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> copy_groups;
  // Threads mode: signalled when this thread is released. One per thread, not one
  // per block: a block-wide notify_all at every barrier woke all 256 threads to
  // re-check, and the futex traffic was most of a TSan driver's time.
  std::condition_variable released;
  // block_wait (include/tma_emulation.h): the condition this thread waits for
  // (an mbarrier phase, a named barrier), whether it may time out, whether it
  // did, and what a deadlock report says of it.
  const std::function<bool()>* condition = nullptr;
  bool may_time_out = false;
  bool timed_out = false;
  const std::function<std::string()>* wait_detail = nullptr;
};

struct Pending {
  Collective op;
  unsigned arrived;
};

struct Warp {
  char syncwarp_clock = 0;
  unsigned existing = 0;
  unsigned exited = 0;
  std::vector<Pending> pending;
};

struct Block {
  Mode mode;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int live = 0;
  int running = 0;
  bool any_exited = false;
  // The barrier being filled: its op, site, first arrival, arrivals, predicate count.
  const char* barrier_op = nullptr;
  Site barrier_site{};
  int barrier_first = -1;
  int barrier_arrived = 0;
  int barrier_count = 0;
  int barrier_result = 0;
  // Two, used in turn: a thread slow to leave one barrier must not be ordered
  // after the arrivals at the next.
  char barrier_clocks[2] = {};
  std::string error;
  std::mutex mutex;
  // Fibers.
  std::vector<int> ready;
  ucontext_t scheduler;
  std::mt19937_64 rng;
  bool random = false;
  void* scheduler_fake_stack = nullptr;
  void* scheduler_tsan_fiber = nullptr;
  char exit_clock = 0;  // TSan: every fiber's work, ordered before the block's end
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  const std::function<void()>* kernel = nullptr;
  void* dynamic_shared = nullptr;
  size_t dynamic_shared_bytes = 0;
  // The 16-byte destinations of cp.async copies not yet waited for, with the
  // thread that issued each.
  struct PendingCopy {
    int count;
    int thread;
  };
  std::unordered_map<uintptr_t, PendingCopy> pending_copies;
  // Asynchronous operations in flight (TMA copies; issue_async), oldest first;
  // updates and landings so far, and their count at the last timed-out stall.
  std::vector<std::pair<uint64_t, std::function<void()>>> async_ops;
  uint64_t next_async_id = 0;
  uint64_t progress = 0;
  uint64_t progress_at_timeout = ~uint64_t{0};
  uint64_t serial = 0;
};

thread_local Thread* tls_thread = nullptr;
thread_local Block* tls_block = nullptr;

Block& current_block() {
  if (tls_block == nullptr) {
    std::fprintf(stderr, "[cuda harness] a device function was called outside a kernel launch\n");
    std::abort();
  }
  return *tls_block;
}

// Holds the block's mutex in the threads mode; fibers share one OS thread.
struct Guard {
  std::unique_lock<std::mutex> lock;
  explicit Guard(Block& b) : lock(b.mutex, std::defer_lock) {
#ifdef JAXOPS_HARNESS_TSAN
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
    if (b.mode == Mode::kThreads) lock.lock();
  }
  ~Guard() {
    if (lock.owns_lock()) lock.unlock();
#ifdef JAXOPS_HARNESS_TSAN
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
#endif
  }
  Guard(const Guard&) = delete;
};

// The memory ordering of a barrier, for TSan (see the top of the file).
struct BarrierOrder {
  void* clock;
  explicit BarrierOrder(void* c) : clock(c) {
#ifdef JAXOPS_HARNESS_TSAN
    if (clock != nullptr) __tsan_release(clock);
#endif
  }
  ~BarrierOrder() {
#ifdef JAXOPS_HARNESS_TSAN
    if (clock != nullptr) __tsan_acquire(clock);
#endif
  }
};

std::string thread_name(const Block& b, int index) {
  const ThreadContext& c = b.threads[index].ctx;
  std::ostringstream out;
  out << "thread (" << c.thread_idx.x << "," << c.thread_idx.y << "," << c.thread_idx.z
      << ") [warp " << b.threads[index].warp << " lane " << c.lane << "]";
  return out.str();
}

std::string site_name(const char* op, Site site) {
  std::ostringstream out;
  out << op << " at " << site.file << ":" << site.line;
  return out.str();
}

std::string hex(unsigned mask) {
  char buffer[16];
  std::snprintf(buffer, sizeof(buffer), "0x%08x", mask);
  return buffer;
}

void wake(Block& b, Thread& t) {
  t.blocked = false;
  ++b.running;
  if (b.mode == Mode::kFibers) {
    b.ready.push_back(t.index);
  } else {
    t.released.notify_one();
  }
}

// Records the block's first error and releases every waiting thread (each then
// throws Aborted from the call it waits in).
void fail(Block& b, const std::string& message) {
  if (b.error.empty()) b.error = message;
  for (Thread& t : b.threads) {
    if (t.blocked) wake(b, t);
  }
}

std::string deadlock_report(const Block& b) {
  std::map<std::string, std::vector<int>> waits;
  for (const Thread& t : b.threads) {
    if (t.blocked) waits[site_name(t.wait_op, t.wait_site)].push_back(t.index);
  }
  std::ostringstream out;
  out << "deadlock: every live thread waits and none can proceed;";
  for (const auto& [where, indices] : waits) {
    out << " " << indices.size() << " thread(s) at " << where << " (first: "
        << thread_name(b, indices.front());
    const Thread& first = b.threads[indices.front()];
    if (first.wait_detail != nullptr) out << "; " << (*first.wait_detail)();
    out << ");";
  }
  int exited = 0;
  for (const Thread& t : b.threads) exited += t.exited;
  out << " " << exited << " thread(s) exited";
  return out.str();
}

#ifdef JAXOPS_HARNESS_ASAN
// ASan's swapcontext interceptor clears the shadow of the whole target stack at
// every switch (1 MiB of stack: an mmap and two madvise calls), which made the
// system time 85% of an ASan driver's run; and for a fiber being resumed it also
// erases the redzones of its live frames. The fiber switches are annotated
// (__sanitizer_start/finish_switch_fiber), so they call libc's swapcontext itself;
// a fiber's stack is cleared once, when a new fiber starts on it (run_fibers).
using SwapContext = int (*)(ucontext_t*, const ucontext_t*);
SwapContext libc_swapcontext() {
  static const SwapContext real = [] {
    void* libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    void* symbol = libc == nullptr ? nullptr : dlsym(libc, "swapcontext");
    return symbol == nullptr ? &swapcontext : reinterpret_cast<SwapContext>(symbol);
  }();
  return real;
}
#define JAXOPS_SWAPCONTEXT libc_swapcontext()
#else
#define JAXOPS_SWAPCONTEXT swapcontext
#endif

void switch_to_scheduler(Block& b, Thread& t) {
#ifdef JAXOPS_HARNESS_ASAN
  __sanitizer_start_switch_fiber(&t.fake_stack, b.scheduler_stack_bottom, b.scheduler_stack_size);
#endif
#ifdef JAXOPS_HARNESS_TSAN
  __tsan_switch_to_fiber(b.scheduler_tsan_fiber, kTsanSwitchNoSync);
#endif
  JAXOPS_SWAPCONTEXT(&t.context, &b.scheduler);
#ifdef JAXOPS_HARNESS_ASAN
  __sanitizer_finish_switch_fiber(t.fake_stack, nullptr, nullptr);
#endif
}

// Wakes the threads in block_wait whose condition now holds.
void wake_ready_conditions(Block& b) {
  for (Thread& t : b.threads) {
    if (t.blocked && t.condition != nullptr && (*t.condition)()) {
      t.condition = nullptr;
      wake(b, t);
    }
  }
}

void land_one(Block& b, size_t i) {
  std::function<void()> land = std::move(b.async_ops[i].second);
  b.async_ops.erase(b.async_ops.begin() + static_cast<std::ptrdiff_t>(i));
  land();
  ++b.progress;
}

// With a seed, each operation in flight lands here with probability 1/2.
void land_some(Block& b) {
  if (!b.random) return;
  for (size_t i = 0; i < b.async_ops.size();) {
    if (b.rng() & 1u) {
      land_one(b, i);
    } else {
      ++i;
    }
  }
  wake_ready_conditions(b);
}

// No live thread can run: the asynchronous operations in flight land (they may
// complete what the threads wait for); else the threads in a try_wait time
// out, once per stall with no progress since the last; else it is a deadlock.
void resolve_stall(Block& b) {
  while (!b.async_ops.empty()) land_one(b, 0);
  wake_ready_conditions(b);
  if (b.running > 0) return;
  if (b.progress != b.progress_at_timeout) {
    bool woke = false;
    for (Thread& t : b.threads) {
      if (t.blocked && t.condition != nullptr && t.may_time_out) {
        t.condition = nullptr;
        t.timed_out = true;
        wake(b, t);
        woke = true;
      }
    }
    if (woke) {
      b.progress_at_timeout = b.progress;
      return;
    }
  }
  fail(b, deadlock_report(b));
}

// Blocks the calling thread until another releases it (or the block fails).
void wait(Block& b, Thread& t, Guard& guard) {
  t.blocked = true;
  --b.running;
  if (b.running == 0 && b.error.empty()) resolve_stall(b);
  if (b.mode == Mode::kFibers && !t.blocked) {
    // The stall woke this thread itself (its condition holds, or it timed
    // out): it runs on, and must not be resumed from the ready list too.
    const auto self = std::find(b.ready.begin(), b.ready.end(), t.index);
    if (self != b.ready.end()) b.ready.erase(self);
  }
  if (b.mode == Mode::kFibers) {
    while (t.blocked) switch_to_scheduler(b, t);
  } else {
    t.released.wait(guard.lock, [&] { return !t.blocked; });
  }
  if (!b.error.empty()) throw Aborted{};
}

// Lets the other fibers run (a scheduling point after a completed collective).
// OS threads need none: wake() signalled the released ones.
void yield(Block& b, Thread& t) {
  if (b.mode == Mode::kThreads) return;
  b.ready.push_back(t.index);
  switch_to_scheduler(b, t);
  if (!b.error.empty()) throw Aborted{};
}

[[noreturn]] void misuse(Block& b, const std::string& message) {
  {
    Guard guard(b);
    fail(b, message);
  }
  throw Aborted{};
}

void thread_exited(Block& b, Thread& t) {
  Guard guard(b);
  t.exited = true;
  --b.live;
  --b.running;
  b.any_exited = true;
  Warp& w = b.warps[t.warp];
  w.exited |= 1u << t.ctx.lane;
  if (b.error.empty() && b.barrier_arrived > 0) {
    fail(b, "barrier divergence: " + thread_name(b, t.index) + " exited while " +
                std::to_string(b.barrier_arrived) + " thread(s) wait at " +
                site_name(b.barrier_op, b.barrier_site) + " (first: " +
                thread_name(b, b.barrier_first) + ")");
  }
  for (const Pending& p : w.pending) {
    if (b.error.empty() && (p.op.mask >> t.ctx.lane & 1u)) {
      fail(b, "warp divergence: " + thread_name(b, t.index) + " exited while lanes " +
                  hex(p.arrived) + " of its warp wait for it at " +
                  site_name(p.op.op, p.op.site) + " with mask " + hex(p.op.mask));
    }
  }
  if (b.error.empty() && b.live > 0 && b.running == 0) resolve_stall(b);
}

void run_thread(Block& b, Thread& t) {
  try {
    (*b.kernel)();
    const std::string left = tma_thread_exit_check(t.index);
    if (!left.empty()) misuse(b, left);
  } catch (const Aborted&) {
  } catch (const std::exception& e) {
    Guard guard(b);
    fail(b, thread_name(b, t.index) + " threw: " + e.what());
  } catch (...) {
    Guard guard(b);
    fail(b, thread_name(b, t.index) + " threw an exception");
  }
  thread_exited(b, t);
}

// -- fibers ------------------------------------------------------------------------------

#ifdef JAXOPS_HARNESS_ASAN
constexpr size_t kStackBytes = size_t{1} << 20;
#else
constexpr size_t kStackBytes = size_t{256} << 10;
#endif
constexpr size_t kGuardBytes = 4096;

// Fiber stacks, reused by every launch; a guard page below each turns an overflow
// into a fault.
char* fiber_stack(int index) {
  static std::vector<char*> stacks(kMaxThreadsPerBlock, nullptr);
  if (stacks[index] == nullptr) {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("[cuda harness] mmap of a fiber stack");
      std::abort();
    }
    mprotect(p, kGuardBytes, PROT_NONE);
    stacks[index] = static_cast<char*>(p) + kGuardBytes;
  }
  return stacks[index];
}

void fiber_main(unsigned high, unsigned low) {
  Thread& t = *reinterpret_cast<Thread*>((static_cast<uintptr_t>(high) << 32) | low);
  Block& b = current_block();
#ifdef JAXOPS_HARNESS_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack_bottom, &b.scheduler_stack_size);
#endif
  run_thread(b, t);
#ifdef JAXOPS_HARNESS_ASAN
  __sanitizer_start_switch_fiber(nullptr, b.scheduler_stack_bottom, b.scheduler_stack_size);
#endif
#ifdef JAXOPS_HARNESS_TSAN
  // The block's state is read before the release that orders this fiber's
  // accesses before the block's end (the next block reuses its memory).
  void* const scheduler_fiber = b.scheduler_tsan_fiber;
  __tsan_release(&b.exit_clock);
  __tsan_switch_to_fiber(scheduler_fiber, kTsanSwitchNoSync);
#endif
  setcontext(&b.scheduler);
}

// Under TSan each fiber is a TSan fiber, a thread of its own to the race
// detector: its switches order nothing (kTsanSwitchNoSync), so only the
// barriers' annotations order the CUDA threads, as OS threads would be ordered;
// except the scheduler's switches into a fiber, which order what the scheduler
// wrote (tls_thread) before the fiber's reads. The scheduler never takes a
// fiber's order until the block ends (exit_clock), so nothing orders two
// fibers through it.
#ifdef JAXOPS_HARNESS_TSAN
// TSan fibers, reused by every launch as the stacks are: creating and
// destroying one per CUDA thread and block cost an mmap and a munmap each, most
// of a TSan driver's time. A fiber of an earlier block is ordered before this
// block (exit_clock, and the scheduler's ordered switches), as a new one would be.
void* tsan_fiber(int index) {
  static std::vector<void*> fibers(kMaxThreadsPerBlock, nullptr);
  if (fibers[index] == nullptr) fibers[index] = __tsan_create_fiber(0);
  return fibers[index];
}
#endif

// The scheduler's write of the running fiber, unseen by TSan: the fibers read
// it, and the switch back to the scheduler orders nothing.
void set_running_fiber(Thread* t) {
#ifdef JAXOPS_HARNESS_TSAN
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
  tls_thread = t;
#ifdef JAXOPS_HARNESS_TSAN
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#endif
}

void run_fibers(Block& b) {
#ifdef JAXOPS_HARNESS_TSAN
  b.scheduler_tsan_fiber = __tsan_get_current_fiber();
#endif
  for (Thread& t : b.threads) b.ready.push_back(t.index);
  while (!b.ready.empty()) {
    size_t pick = 0;
    if (b.random) pick = std::uniform_int_distribution<size_t>(0, b.ready.size() - 1)(b.rng);
    Thread& t = b.threads[b.ready[pick]];
    b.ready.erase(b.ready.begin() + static_cast<std::ptrdiff_t>(pick));
    if (!t.started) {
      t.started = true;
      if (!b.error.empty()) {  // the block failed: threads that never ran stay so
        set_running_fiber(&t);
        thread_exited(b, t);
        continue;
      }
      getcontext(&t.context);
      t.context.uc_stack.ss_sp = fiber_stack(t.index);
      t.context.uc_stack.ss_size = kStackBytes;
      t.context.uc_link = nullptr;
      const uintptr_t self = reinterpret_cast<uintptr_t>(&t);
      makecontext(&t.context, reinterpret_cast<void (*)()>(&fiber_main), 2,
                  static_cast<unsigned>(self >> 32), static_cast<unsigned>(self & 0xffffffffu));
#ifdef JAXOPS_HARNESS_ASAN
      // The stack's last fiber left the redzones of the frames it never returned
      // from (fiber_main's, and any it threw through) poisoned.
      __asan_unpoison_memory_region(fiber_stack(t.index), kStackBytes);
#endif
    }
    set_running_fiber(&t);
#ifdef JAXOPS_HARNESS_ASAN
    __sanitizer_start_switch_fiber(&b.scheduler_fake_stack, fiber_stack(t.index), kStackBytes);
#endif
#ifdef JAXOPS_HARNESS_TSAN
    __tsan_switch_to_fiber(tsan_fiber(t.index), 0);
#endif
    JAXOPS_SWAPCONTEXT(&b.scheduler, &t.context);
#ifdef JAXOPS_HARNESS_ASAN
    __sanitizer_finish_switch_fiber(b.scheduler_fake_stack, nullptr, nullptr);
#endif
    set_running_fiber(nullptr);
  }
#ifdef JAXOPS_HARNESS_TSAN
  __tsan_acquire(&b.exit_clock);
#endif
}

// -- OS threads ------------------------------------------------------------------------------

void run_os_threads(Block& b) {
  std::vector<std::thread> threads;
  threads.reserve(b.threads.size());
  for (Thread& t : b.threads) {
    threads.emplace_back([&b, &t] {
      tls_block = &b;
      tls_thread = &t;
      {
        Guard guard(b);
        t.started = true;
      }
      run_thread(b, t);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// -- launch --------------------------------------------------------------------------------

std::string dims(dim3 d) {
  std::ostringstream out;
  out << "(" << d.x << "," << d.y << "," << d.z << ")";
  return out.str();
}

cudaError_t launch_error(cudaError_t error, const std::string& report) {
  tls_last_error = error;
  tls_last_report = report;
  return error;
}

// Byte by byte and uninstrumented: under AddressSanitizer the section also holds
// the redzones of the shared arrays, which only kernels must not touch.
__attribute__((no_sanitize_address)) void poison_static_shared() {
  if (+__start_jaxops_shared == nullptr) return;
  for (volatile char* p = __start_jaxops_shared; p < __stop_jaxops_shared; ++p) *p = '\xff';
}

// Runs one block; returns its error report (empty on success).
std::string run_block(const Settings& s, uint3 block_idx, dim3 grid, dim3 block_dim,
                      size_t shared_bytes, const std::function<void()>& kernel, uint64_t seed) {
  Block b;
  b.mode = s.mode;
  b.kernel = &kernel;
  b.random = s.seed != 0;
  b.rng.seed(seed);
  const int n = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  // Built in place: a Thread holds a condition variable, which cannot move.
  b.threads = std::vector<Thread>(n);
  b.warps.resize((n + 31) / 32);
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.index = i;
    t.warp = i / 32;
    t.ctx.thread_idx = {i % block_dim.x, i / block_dim.x % block_dim.y,
                        i / (block_dim.x * block_dim.y)};
    t.ctx.block_idx = block_idx;
    t.ctx.block_dim = block_dim;
    t.ctx.grid_dim = grid;
    t.ctx.lane = i % 32;
    b.warps[t.warp].existing |= 1u << t.ctx.lane;
  }
  b.live = b.running = n;
  static uint64_t serials = 0;
  b.serial = ++serials;
  poison_static_shared();
  // Exactly the requested bytes, so AddressSanitizer sees reads past the end.
  b.dynamic_shared = std::malloc(shared_bytes == 0 ? 1 : shared_bytes);
  b.dynamic_shared_bytes = shared_bytes;
  poison(b.dynamic_shared, shared_bytes);
  Block* saved_block = tls_block;
  Thread* saved_thread = tls_thread;
  tls_block = &b;
  if (s.mode == Mode::kFibers) {
    run_fibers(b);
  } else {
    run_os_threads(b);
  }
  tls_block = saved_block;
  tls_thread = saved_thread;
  std::free(b.dynamic_shared);
  return b.error;
}

}  // namespace

// -- the API of cuda_on_cpu.h ----------------------------------------------------------------

cudaError_t& last_error() { return tls_last_error; }

const char* error_name(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}

const char* error_string(cudaError_t error) {
  if (error == cudaErrorLaunchFailure && !tls_last_report.empty()) return tls_last_report.c_str();
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return error_name(error);
  }
}

ThreadContext& this_thread() {
  if (tls_thread == nullptr) {
    std::fprintf(stderr, "[cuda harness] threadIdx/blockIdx used outside a kernel launch\n");
    std::abort();
  }
  return tls_thread->ctx;
}

void* dynamic_shared_memory() { return current_block().dynamic_shared; }
size_t dynamic_shared_memory_bytes() { return current_block().dynamic_shared_bytes; }

// -- cp.async (include/mma_emulation.h) -------------------------------------------------------

namespace {
std::atomic<unsigned long long> g_cp_asyncs{0};

// A shared-memory address as the report names it: an offset into the
// block's dynamic shared memory when it is there.
std::string shared_location(const Block& b, uintptr_t address) {
  const auto base = reinterpret_cast<uintptr_t>(b.dynamic_shared);
  std::ostringstream out;
  if (address >= base && address - base < b.dynamic_shared_bytes) {
    out << "dynamic shared byte " << address - base;
  } else {
    out << "shared address 0x" << std::hex << address;
  }
  return out.str();
}
}  // namespace

void fail_launch(const std::string& message) { misuse(current_block(), message); }

void cp_async_16(void* dst, const void* src, int src_bytes, Site site) {
  Block& b = current_block();
  Thread& t = *tls_thread;
  const auto dst_address = reinterpret_cast<uintptr_t>(dst);
  if (dst_address % 16 != 0 || src_bytes < 0 || src_bytes > 16 ||
      (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16 != 0)) {
    misuse(b, site_name("cp.async.cg", site) + ": " + thread_name(b, t.index) +
                  " copies " + std::to_string(src_bytes) +
                  " bytes with a destination or source not 16-byte aligned (or more than 16)");
  }
  AsyncCopy copy{dst, {}};
  if (src_bytes > 0) std::memcpy(copy.bytes, src, static_cast<size_t>(src_bytes));
  poison(dst, sizeof copy.bytes);
  {
    Guard guard(b);
    Block::PendingCopy& pending = b.pending_copies[dst_address];
    ++pending.count;
    pending.thread = t.index;
  }
  t.uncommitted.push_back(copy);
  ++g_cp_asyncs;
}

void cp_async_commit() {
  Thread& t = *tls_thread;
  t.copy_groups.push_back(std::move(t.uncommitted));
  t.uncommitted.clear();
}

void cp_async_wait(int pending, Site) {
  Block& b = current_block();
  Thread& t = *tls_thread;
  while (static_cast<int>(t.copy_groups.size()) > pending) {
    const std::vector<AsyncCopy> group = std::move(t.copy_groups.front());
    t.copy_groups.pop_front();
    for (const AsyncCopy& copy : group) std::memcpy(copy.dst, copy.bytes, sizeof copy.bytes);
    Guard guard(b);
    for (const AsyncCopy& copy : group) {
      const auto it = b.pending_copies.find(reinterpret_cast<uintptr_t>(copy.dst));
      if (--it->second.count == 0) b.pending_copies.erase(it);
    }
  }
}

void check_not_pending(const void* row, const char* op, Site site) {
  Block& b = current_block();
  std::string message;
  {
    Guard guard(b);
    const auto it = b.pending_copies.find(reinterpret_cast<uintptr_t>(row));
    if (it != b.pending_copies.end()) {
      message = site_name(op, site) + ": " + thread_name(b, tls_thread->index) + " reads " +
                shared_location(b, it->first) + ", the destination of a cp.async of " +
                thread_name(b, it->second.thread) +
                " that no cp.async.wait_group has covered yet";
    }
  }
  if (!message.empty()) misuse(b, message);
  check_tma_landed(row, 16, op, site);
}

// -- waiting on conditions, asynchronous operations (include/tma_emulation.h) ---------------

uint64_t block_serial() { return current_block().serial; }

void block_update(const std::function<std::string()>& update) {
  Block& b = current_block();
  Guard guard(b);
  if (!b.error.empty()) throw Aborted{};
  const std::string error = update();
  if (!error.empty()) {
    fail(b, error);
    throw Aborted{};
  }
  ++b.progress;
  land_some(b);
  wake_ready_conditions(b);
}

bool block_wait(const char* op, Site site, const std::function<bool()>& ready, bool may_time_out,
                const std::function<std::string()>& detail) {
  Block& b = current_block();
  Thread& t = *tls_thread;
  Guard guard(b);
  if (!b.error.empty()) throw Aborted{};
  land_some(b);
  if (ready()) return true;
  t.condition = &ready;
  t.may_time_out = may_time_out;
  t.timed_out = false;
  t.wait_detail = &detail;
  t.wait_op = op;
  t.wait_site = site;
  try {
    wait(b, t, guard);
  } catch (const Aborted&) {
    t.condition = nullptr;
    t.wait_detail = nullptr;
    throw;
  }
  t.wait_detail = nullptr;
  return !t.timed_out;
}

uint64_t issue_async(std::function<void()> land) {
  Block& b = current_block();
  Guard guard(b);
  if (!b.error.empty()) throw Aborted{};
  const uint64_t id = ++b.next_async_id;
  b.async_ops.emplace_back(id, std::move(land));
  return id;
}

void land_async(uint64_t id) {
  Block& b = current_block();
  Guard guard(b);
  if (!b.error.empty()) throw Aborted{};
  for (size_t i = 0; i < b.async_ops.size(); ++i) {
    if (b.async_ops[i].first == id) {
      land_one(b, i);
      wake_ready_conditions(b);
      return;
    }
  }
}

int thread_index() { return tls_thread->index; }
std::string thread_description(int index) { return thread_name(current_block(), index); }
std::string shared_description(const void* p) {
  return shared_location(current_block(), reinterpret_cast<uintptr_t>(p));
}

unsigned live_lanes() {
  Block& b = current_block();
  Guard guard(b);
  const Warp& w = b.warps[tls_thread->warp];
  return w.existing & ~w.exited;
}

void check_shuffle_width(int width, Site site) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    Block& b = current_block();
    misuse(b, site_name("shuffle", site) + ": width " + std::to_string(width) +
                  " is not a power of 2 in [1, 32]");
  }
}

int block_barrier(const char* op, Site site, int predicate) {
  Block& b = current_block();
  Thread& t = *tls_thread;
  BarrierOrder order(&b.barrier_clocks[t.barriers_passed++ % 2]);
  Guard guard(b);
  if (!b.error.empty()) throw Aborted{};
  if (b.any_exited) {
    int exited = 0;
    while (!b.threads[exited].exited) ++exited;
    fail(b, "barrier divergence: " + thread_name(b, t.index) + " reached " + site_name(op, site) +
                " after " + thread_name(b, exited) + " exited");
    throw Aborted{};
  }
  if (b.barrier_arrived == 0) {
    b.barrier_op = op;
    b.barrier_site = site;
    b.barrier_first = t.index;
    b.barrier_count = 0;
  } else if (b.barrier_site.line != site.line || std::strcmp(b.barrier_site.file, site.file) != 0 ||
             std::strcmp(b.barrier_op, op) != 0) {
    fail(b, "barrier divergence: " + thread_name(b, t.index) + " waits at " + site_name(op, site) +
                " while " + thread_name(b, b.barrier_first) + " waits at " +
                site_name(b.barrier_op, b.barrier_site));
    throw Aborted{};
  }
  ++b.barrier_arrived;
  b.barrier_count += predicate;
  t.wait_op = op;
  t.wait_site = site;
  if (b.barrier_arrived == b.live) {
    b.barrier_result = b.barrier_count;
    b.barrier_arrived = 0;
    for (Thread& other : b.threads) {
      if (other.blocked && other.at_barrier) {
        other.at_barrier = false;
        wake(b, other);
      }
    }
    const int result = b.barrier_result;
    yield(b, t);
    return result;
  }
  t.at_barrier = true;
  wait(b, t, guard);
  return b.barrier_result;
}

void warp_collective(const char* op, Site site, unsigned mask, const void* in, void* out,
                     Completer complete) {
  Block& b = current_block();
  Thread& t = *tls_thread;
  const bool orders_memory = complete == &complete_nothing && std::strcmp(op, "__syncwarp") == 0;
  BarrierOrder order(orders_memory ? &b.warps[t.warp].syncwarp_clock : nullptr);
  Guard guard(b);
  if (!b.error.empty()) throw Aborted{};
  Warp& w = b.warps[t.warp];
  const unsigned self = 1u << t.ctx.lane;
  const auto where = [&] {
    return thread_name(b, t.index) + " at " + site_name(op, site) + " with mask " + hex(mask);
  };
  const auto misuse_locked = [&](const std::string& message) {
    fail(b, message);
    throw Aborted{};
  };
  if (!(mask & self)) misuse_locked(where() + ": the calling lane is not in the mask");
  if (mask & ~w.existing) {
    misuse_locked(where() + ": the mask names lanes " + hex(mask & ~w.existing) +
                  " that do not exist (the block has " + std::to_string(b.threads.size()) +
                  " threads)");
  }
  if (mask & w.exited) {
    misuse_locked(where() + ": the mask names lanes " + hex(mask & w.exited) + " that have exited");
  }
  // Lanes meet at the same intrinsic with the same mask, wherever it is in the
  // source; other collectives of the warp may be pending meanwhile (disjoint
  // masks, or lanes that get to this one later). Lanes that never meet end in
  // a deadlock report.
  Pending* pending = nullptr;
  for (Pending& p : w.pending) {
    if (p.op.mask == mask && p.op.complete == complete && !(p.arrived & self) &&
        std::strcmp(p.op.op, op) == 0) {
      pending = &p;
      break;
    }
  }
  if (pending == nullptr) {
    w.pending.push_back(Pending{Collective{op, site, mask, {}, {}, complete}, 0u});
    pending = &w.pending.back();
  }
  pending->op.in[t.ctx.lane] = in;
  pending->op.out[t.ctx.lane] = out;
  pending->arrived |= self;
  t.wait_op = op;
  t.wait_site = site;
  if (pending->arrived == mask) {
    const Collective done = pending->op;
    w.pending.erase(w.pending.begin() + (pending - w.pending.data()));
    done.complete(done);
    for (int lane = 0; lane < 32; ++lane) {
      if ((mask >> lane & 1u) && lane != t.ctx.lane) wake(b, b.threads[t.warp * 32 + lane]);
    }
    yield(b, t);
    return;
  }
  wait(b, t, guard);
}

cudaError_t launch(const char* kernel_name, dim3 grid, dim3 block, size_t shared_bytes,
                   const std::function<void()>& kernel) {
  const std::string config = std::string(kernel_name) + "<<<" + dims(grid) + ", " + dims(block) +
                             ", " + std::to_string(shared_bytes) + ">>>";
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 ||
      grid.x > 0x7fffffffu || grid.y == 0 || grid.y > 65535 || grid.z == 0 || grid.z > 65535) {
    return launch_error(cudaErrorInvalidConfiguration, config + ": invalid configuration");
  }
  if (shared_bytes > static_cast<size_t>(kMaxDynamicSharedBytes)) {
    return launch_error(cudaErrorInvalidValue, config + ": too much dynamic shared memory");
  }
  std::lock_guard<std::mutex> lock(launch_mutex());
  const Settings s = settings();
  std::vector<uint3> blocks;
  blocks.reserve(uint64_t{grid.x} * grid.y * grid.z);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back({x, y, z});
    }
  }
  std::mt19937_64 rng(s.seed + g_launches);
  if (s.seed != 0) std::shuffle(blocks.begin(), blocks.end(), rng);
  ++g_launches;
  for (const uint3& block_idx : blocks) {
    const std::string error = run_block(s, block_idx, grid, block, shared_bytes, kernel, rng());
    if (!error.empty()) {
      const std::string report = "[cuda harness] " + config + ", block " +
                                 dims(dim3(block_idx)) + ": " + error;
      std::fprintf(stderr, "%s\n", report.c_str());
      return launch_error(cudaErrorLaunchFailure, report);
    }
  }
  return cudaSuccess;
}

}  // namespace jaxops_harness

// -- control from tests (ctypes) -----------------------------------------------------------

extern "C" {

// mode: 0 fibers, 1 OS threads (always OS threads under TSan); seed 0: ordered.
void jaxops_harness_configure(int mode, unsigned long long seed) {
  std::lock_guard<std::mutex> lock(jaxops_harness::launch_mutex());
  auto& s = jaxops_harness::settings();
  s.mode = mode == 1 ? jaxops_harness::Mode::kThreads : jaxops_harness::Mode::kFibers;
#ifdef JAXOPS_HARNESS_TSAN
  s.mode = jaxops_harness::Mode::kThreads;
#endif
  s.seed = seed;
}

unsigned long long jaxops_harness_launches() {
  std::lock_guard<std::mutex> lock(jaxops_harness::launch_mutex());
  return jaxops_harness::g_launches;
}

}  // extern "C"

// -- the sparse tensor-core emulation (include/sparse_mma_emulation.h) ----------------------

namespace jaxops_harness {
namespace {
std::atomic<unsigned long long> g_sparse_mmas{0};
}  // namespace
void count_sparse_mma() { ++g_sparse_mmas; }
}  // namespace jaxops_harness

// Emulated mma.sp instructions so far (a test checks that a kernel took that path).
extern "C" unsigned long long jaxops_harness_sparse_mmas() {
  return jaxops_harness::g_sparse_mmas.load();
}

// -- the wmma emulation (include/cuda_on_cpu.h) -----------------------------------------------

namespace jaxops_harness {
namespace {
std::atomic<unsigned long long> g_wmma_mmas[3];
}  // namespace
void count_wmma_mma(WmmaOperand operand) { ++g_wmma_mmas[static_cast<int>(operand)]; }
}  // namespace jaxops_harness

// Emulated wmma::mma_sync instructions so far on operands of one type
// (WmmaOperand: 0 half, 1 bfloat16, 2 tf32): a test checks which precision a
// kernel's products took.
extern "C" unsigned long long jaxops_harness_wmma_mmas(int operand) {
  return jaxops_harness::g_wmma_mmas[operand].load();
}

// wmma::__float_to_tf32 as the kernels call it, for a test against its definition.
extern "C" float jaxops_harness_float_to_tf32(float x) { return nvcuda::wmma::__float_to_tf32(x); }

// -- the sm_80 instruction emulation (include/mma_emulation.h) ----------------------------------

namespace jaxops_harness {
namespace {
std::atomic<unsigned long long> g_mma_syncs[3];
std::atomic<unsigned long long> g_ldmatrices{0};
}  // namespace
void count_mma_sync(MmaOperand operand) { ++g_mma_syncs[static_cast<int>(operand)]; }
void count_ldmatrix() { ++g_ldmatrices; }
}  // namespace jaxops_harness

// Emulated mma.sync instructions so far on operands of one type (MmaOperand:
// 0 half, 1 bfloat16, 2 tf32), ldmatrix and cp.async instructions so far: a
// test checks which instructions a kernel's path took.
extern "C" unsigned long long jaxops_harness_mma_syncs(int operand) {
  return jaxops_harness::g_mma_syncs[operand].load();
}
extern "C" unsigned long long jaxops_harness_ldmatrices() {
  return jaxops_harness::g_ldmatrices.load();
}
extern "C" unsigned long long jaxops_harness_cp_asyncs() {
  return jaxops_harness::g_cp_asyncs.load();
}
