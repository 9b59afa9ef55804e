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
#pragma once

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

}  // namespace jaxops::cpu
