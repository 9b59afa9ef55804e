// Output buffers that XLA allocates fresh are faulted in page by page on their
// first write; on the 2-core machines this costs ~0.2-0.35 ms per MiB, more than
// streaming the data. Where transparent huge pages are in "madvise" mode (the
// common default), asking for them on a large output before the first write
// makes the kernel fault it in 2 MiB pieces instead of 4 KiB ones (a fresh
// 64 MiB buffer: 5-9 ms against 22). The advice changes only how the memory is
// backed, never its contents, and is ignored where huge pages are unavailable.
//
// Except in a virtual machine whose balloon device reports free pages to the
// host (virtio-balloon's free page reporting, as Firecracker guests have): the
// guest hands its free 2 MiB blocks back to the host, which discards them, so
// a huge-page fault usually lands on a block the host must back again (the
// same 64 MiB: 120-148 ms), while 4 KiB faults reuse pages freed a moment
// before. There the advice is not given (measured: docs/bench-results/notes.md).
// JAXOPS_HUGE_PAGES=1 or =0 overrides the detection.
//
// Whatever the page size, each thread populates the part of an output it is
// about to write (WriteAhead below; RowBuffer writers, cpu/row_buffer.h, hold
// one) with MADV_POPULATE_WRITE, a chunk at a time: one system call faults in
// a chunk's pages, without a trap per page (docs/cpu_builds.md has the
// measurements). JAXOPS_POPULATE_OUTPUTS=0 turns it off.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__linux__)
#include <dirent.h>
#include <sys/mman.h>

#include <fstream>
#endif

namespace jaxops::cpu {

// VIRTIO_BALLOON_F_REPORTING, the feature bit of free page reporting: bit 5 of
// the device's sysfs `features` string (one '0'/'1' character per bit, bit 0
// first).
inline constexpr size_t kBalloonReportingBit = 5;

inline bool balloon_features_report_free_pages(const std::string& features) {
  return features.size() > kBalloonReportingBit && features[kBalloonReportingBit] == '1';
}

// Whether an explicit JAXOPS_HUGE_PAGES (unset or empty: -1) asks for the
// advice (1) or against it (0); anything else counts as unset.
inline int huge_pages_override(const char* value) {
  if (value == nullptr || value[0] == '\0' || value[1] != '\0') return -1;
  return value[0] == '1' ? 1 : value[0] == '0' ? 0 : -1;
}

// Whether a virtio balloon bound to its driver reports free pages.
inline bool host_reclaims_free_pages() {
#if defined(__linux__)
  const char* kDriver = "/sys/bus/virtio/drivers/virtio_balloon";
  DIR* dir = opendir(kDriver);
  if (dir == nullptr) return false;
  bool reporting = false;
  while (const dirent* entry = readdir(dir)) {
    if (std::strncmp(entry->d_name, "virtio", 6) != 0) continue;
    std::ifstream file(std::string(kDriver) + "/" + entry->d_name + "/features");
    std::string features;
    if (file >> features && balloon_features_report_free_pages(features)) reporting = true;
  }
  closedir(dir);
  return reporting;
#else
  return false;
#endif
}

// Decided once per process (per library).
inline bool huge_pages_pay_off() {
  static const bool pay_off = [] {
    const int forced = huge_pages_override(std::getenv("JAXOPS_HUGE_PAGES"));
    return forced >= 0 ? forced == 1 : !host_reclaims_free_pages();
  }();
  return pay_off;
}

inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  if (bytes < 2 * kHugePage || !huge_pages_pay_off()) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// Linux's MADV_POPULATE_WRITE (5.14+; the same value on every architecture),
// which older C libraries do not name.
inline constexpr int kMadvPopulateWrite = 23;

// A thread populates this much of an output ahead of its writes. The chunk's
// zeroed lines are still in L2 when the kernel overwrites them, and the call
// costs ~3 us where the pages are already present (1.3 ms per 128 MiB, against
// 1.25 ms in one call: chunks of 64 KiB cost 1.6 ms).
inline constexpr size_t kWriteAheadBytes = size_t{256} << 10;

// Outputs below this are not populated: they are usually heap memory XLA
// reuses, already present, and fault in a few pages at most.
inline constexpr size_t kMinPopulateBytes = size_t{1} << 20;

// Whether JAXOPS_POPULATE_OUTPUTS (=0 or =1, as JAXOPS_HUGE_PAGES) allows the
// populating (the default), read once per process (per library); cleared for
// good by the first call the kernel does not know.
inline std::atomic<bool>& populate_enabled() {
  static std::atomic<bool> enabled{huge_pages_override(std::getenv("JAXOPS_POPULATE_OUTPUTS")) != 0};
  return enabled;
}

// Faults in the pages overlapping [data, data + bytes) as a write would,
// without writing: on private anonymous memory a page not yet present comes in
// zero-filled, and a present one is left as it is (a shared zero page or a
// copy-on-write page gets its private copy of the same bytes), so no content
// ever changes. Returns whether it ran. Where the kernel predates the advice
// (EINVAL, ENOSYS) it turns itself off; any other failure (a range not mapped,
// out of memory) leaves the writes to fault the pages in page by page, as
// without it.
inline bool populate_for_write(const void* data, size_t bytes) {
#if defined(__linux__)
  if (bytes == 0 || !populate_enabled().load(std::memory_order_relaxed)) return false;
  constexpr uintptr_t kPage = 4096;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes + kPage - 1) & ~(kPage - 1);
  if (madvise(reinterpret_cast<void*>(begin), end - begin, kMadvPopulateWrite) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS) populate_enabled().store(false, std::memory_order_relaxed);
  return false;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

// One thread's writes into one fresh output [buffer, buffer + bytes): before
// each write, the next kWriteAheadBytes from it (within the buffer) are
// populated unless an earlier call covered the write. Faulting a fresh 64 MiB
// buffer this way and writing it took 11-12 ms, against 22.5 ms for the
// writes alone (page by page); 2 threads, each its half: 15-17 ms against 25.
// A default-constructed one, or one on a buffer under kMinPopulateBytes,
// does nothing.
class WriteAhead {
 public:
  WriteAhead() = default;
  WriteAhead(const void* buffer, size_t bytes)
      : end_(reinterpret_cast<uintptr_t>(buffer) + bytes), enabled_(bytes >= kMinPopulateBytes) {}

  void before_write(const void* data, size_t bytes) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
    if (!enabled_ || (begin >= populated_begin_ && begin + bytes <= populated_end_)) return;
    populated_begin_ = begin;
    populated_end_ = std::min(end_, std::max(begin + bytes, begin + kWriteAheadBytes));
    enabled_ = populate_for_write(data, populated_end_ - begin) ||
               populate_enabled().load(std::memory_order_relaxed);
  }

 private:
  uintptr_t end_ = 0;
  uintptr_t populated_begin_ = 0;
  uintptr_t populated_end_ = 0;
  bool enabled_ = false;
};

}  // namespace jaxops::cpu
