// Test-only: checks the layout functions of cuda/wgmma.cuh (the ones the kernels
// and the harness emulation use) against the records of cute_layout_oracle.cc,
// read from stdin (tests/test_cute_oracle.py pipes one into the other). Built
// with the harness's headers, as the kernels are for the harness.
//
// Prints "checked KIND COUNT" per record kind and one line per mismatch (the
// first 20); exit 0: all agree; 3: a mismatch.
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "cuda/wgmma.cuh"

namespace wg = jaxops::cuda::wgmma;

int main() {
  std::map<std::string, long> checked;
  long mismatches = 0;
  char line[256];
  const auto mismatch = [&](const char* text, const std::string& mine) {
    std::string record = text;
    if (!record.empty() && record.back() == '\n') record.pop_back();
    if (mismatches++ < 20) std::printf("mismatch: %s (wgmma.cuh: %s)\n", record.c_str(), mine.c_str());
  };
  while (std::fgets(line, sizeof line, stdin)) {
    char kind[16];
    if (std::sscanf(line, "%15s", kind) != 1) continue;
    const std::string k = kind;
    if (k == "acc" || k == "rega16" || k == "regatf32") {
      int n, t, v, row, col;
      if (k == "acc") {
        if (std::sscanf(line, "%*s %d %d %d %d %d", &n, &t, &v, &row, &col) != 5) continue;
      } else if (std::sscanf(line, "%*s %d %d %d %d", &t, &v, &row, &col) != 4) {
        continue;
      }
      const wg::RowCol rc = k == "acc"      ? wg::accumulator_coord(t, v)
                            : k == "rega16" ? wg::register_a_coord(t, v)
                                            : wg::register_a_tf32_coord(t, v);
      if (rc.row != row || rc.col != col) {
        mismatch(line, std::to_string(rc.row) + ", " + std::to_string(rc.col));
      }
    } else if (k == "desc") {
      unsigned start, lbo, sbo, base, layout;
      unsigned long long value;
      if (std::sscanf(line, "%*s %u %u %u %u %u %llu", &start, &lbo, &sbo, &base, &layout,
                      &value) != 6) {
        continue;
      }
      const uint64_t mine = wg::make_descriptor(start, static_cast<wg::Swizzle>(layout), lbo, sbo);
      const wg::DescriptorFields f = wg::decode_descriptor(value);
      if (mine != value || f.start_address != start || f.leading_byte_offset != lbo ||
          f.stride_byte_offset != sbo || f.base_offset != base ||
          static_cast<unsigned>(f.swizzle) != layout) {
        mismatch(line, std::to_string(mine));
      }
      // Advancing by 32 bytes moves only the start address.
      const uint64_t advanced = wg::advance_descriptor(mine, 32);
      if (wg::decode_descriptor(advanced).start_address != ((start + 32) & 0x3fff0u) ||
          (advanced & ~uint64_t{0x3fff}) != (mine & ~uint64_t{0x3fff})) {
        mismatch(line, "advance_descriptor");
      }
    } else if (k == "swz") {
      unsigned b, offset, value;
      if (std::sscanf(line, "%*s %u %u %u", &b, &offset, &value) != 3) continue;
      const wg::Swizzle s = b == 3 ? wg::Swizzle::k128B : b == 2 ? wg::Swizzle::k64B : wg::Swizzle::k32B;
      const uint32_t mine = wg::swizzled_offset(s, offset);
      if (mine != value) mismatch(line, std::to_string(mine));
    } else if (k == "canon") {
      char major[4];
      unsigned layout, bytes, lbo, sbo, mn, kk;
      long offset;
      if (std::sscanf(line, "%*s %3s %u %u %u %u %u %u %ld", major, &layout, &bytes, &lbo, &sbo,
                      &mn, &kk, &offset) != 8) {
        continue;
      }
      const wg::Swizzle s = static_cast<wg::Swizzle>(layout);
      const wg::Major m = std::strcmp(major, "mn") == 0 ? wg::Major::kMN : wg::Major::kK;
      const uint32_t mine = wg::swizzled_offset(s, wg::canonical_offset(m, s, bytes, lbo, sbo, mn, kk));
      if (mine != offset) mismatch(line, std::to_string(mine));
    } else {
      continue;  // CuTe's own chatter (its host stand-in for the shared-address cast)
    }
    ++checked[k];
  }
  for (const auto& [kind, count] : checked) std::printf("checked %s %ld\n", kind.c_str(), count);
  return mismatches ? 3 : 0;
}
