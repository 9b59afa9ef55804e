// The huge-page advice on fresh outputs (cpu/fresh_memory.h): the parsing of
// JAXOPS_HUGE_PAGES and of the virtio balloon's feature bits that decide it,
// the override winning over the detection, and the advice on buffers of every
// alignment and size (it must never fail or touch the contents); the
// write-ahead populating (MADV_POPULATE_WRITE) on fresh and on written
// memory, which must leave every byte as it was.
// Build: g++ -std=c++17 -O2 -I. tests/cpp/fresh_memory_test.cc -o fresh_memory_test
// Run: ./fresh_memory_test (prints "ALL PASSED" and exits 0 when every check passes)
#include "cpu/fresh_memory.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  using namespace jaxops::cpu;
  check(huge_pages_override(nullptr) == -1, "unset JAXOPS_HUGE_PAGES is no override");
  check(huge_pages_override("") == -1, "empty JAXOPS_HUGE_PAGES is no override");
  check(huge_pages_override("1") == 1, "JAXOPS_HUGE_PAGES=1 asks for the advice");
  check(huge_pages_override("0") == 0, "JAXOPS_HUGE_PAGES=0 asks against it");
  check(huge_pages_override("yes") == -1 && huge_pages_override("10") == -1,
        "other values are no override");

  // The features of the Firecracker guest's balloon (bit 5 set), and others.
  check(balloon_features_report_free_pages("0110010100000000"), "bit 5 set: reporting");
  check(!balloon_features_report_free_pages("0110000100000000"), "bit 5 clear: none");
  check(!balloon_features_report_free_pages("01100"), "a short string: none");
  check(!balloon_features_report_free_pages(""), "no features: none");
  host_reclaims_free_pages();  // reads sysfs where it exists; must not fail elsewhere

  // The override decides, whatever the machine (read once, at the first call).
  setenv("JAXOPS_HUGE_PAGES", "0", 1);
  check(!huge_pages_pay_off(), "JAXOPS_HUGE_PAGES=0 turns the advice off");

  // The advice leaves contents alone at any size and offset (here: given
  // nothing, as the override is off; the madvise path is taken by the kernels'
  // own tests wherever the detection allows it).
  std::vector<unsigned char> buffer((8u << 20) + 3, 7);
  for (size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
    for (size_t bytes : {size_t{0}, size_t{4096}, size_t{4u << 20}, buffer.size() - offset}) {
      advise_huge_pages(buffer.data() + offset, bytes);
    }
  }
  bool intact = true;
  for (unsigned char b : buffer) intact &= b == 7;
  check(intact, "the contents are unchanged");

  // Populating: on written heap memory at odd offsets and sizes (contents
  // kept), and a WriteAhead walking a fresh anonymous mapping row by row
  // (reads back zeros where nothing was written, the rows where they were).
  populate_for_write(buffer.data() + 1, buffer.size() - 1);
  populate_for_write(buffer.data() + 4095, 2);
  populate_for_write(buffer.data(), 0);
  intact = true;
  for (unsigned char b : buffer) intact &= b == 7;
  check(intact, "populating written memory leaves its contents");

  const size_t mapped = size_t{6} << 20;
  void* fresh = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  check(fresh != MAP_FAILED, "a fresh mapping");
  if (fresh != MAP_FAILED) {
    auto* bytes = static_cast<unsigned char*>(fresh);
    // The writes cover the odd rows of 1000 bytes only, from byte 3 on.
    WriteAhead ahead(bytes + 3, mapped - 3);
    for (size_t row = 0; 3 + (row + 1) * 1000 <= mapped; ++row) {
      unsigned char* at = bytes + 3 + row * 1000;
      ahead.before_write(at, 1000);
      if (row % 2 == 1) std::memset(at, static_cast<int>(row % 251) + 1, 1000);
    }
    bool rows_right = true;
    for (size_t i = 0; i < mapped; ++i) {
      const size_t row = (i - 3) / 1000;
      const bool written = i >= 3 && 3 + (row + 1) * 1000 <= mapped && row % 2 == 1;
      rows_right &= bytes[i] == (written ? static_cast<unsigned char>(row % 251 + 1) : 0);
    }
    check(rows_right, "a fresh mapping holds its writes and zeros elsewhere");
    munmap(fresh, mapped);
  }
  // A default WriteAhead, and one on a small buffer, do nothing.
  WriteAhead none;
  none.before_write(buffer.data(), 16);
  WriteAhead small(buffer.data(), 4096);
  small.before_write(buffer.data(), 4096);

  // JAXOPS_POPULATE_OUTPUTS=0 (read at the first call) would have turned it
  // off; unset, populating is on unless the kernel lacks the advice.
  if (failures == 0) std::printf("ALL PASSED\n");
  return failures == 0 ? 0 : 1;
}
