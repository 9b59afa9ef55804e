// The huge-page advice on fresh outputs (cpu/fresh_memory.h): the parsing of
// JAXOPS_HUGE_PAGES and of the virtio balloon's feature bits that decide it,
// the override winning over the detection, and the advice on buffers of every
// alignment and size (it must never fail or touch the contents).
// Build: g++ -std=c++17 -O2 -I. tests/cpp/fresh_memory_test.cc -o fresh_memory_test
// Run: ./fresh_memory_test (prints "ALL PASSED" and exits 0 when every check passes)
#include "cpu/fresh_memory.h"

#include <cstdio>
#include <cstdlib>
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

  if (failures == 0) std::printf("ALL PASSED\n");
  return failures == 0 ? 0 : 1;
}
