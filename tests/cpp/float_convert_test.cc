// The row conversions of cpu/float_convert.h against Eigen's scalar ones:
// float -> bfloat16 and float -> float16 rounded to nearest even, bit for bit,
// on a sweep of the float bit patterns (every 997th, and around every
// rounding tie, zero, the denormals, infinities and NaNs); NaN stays a quiet
// NaN with the sign and the top payload bits of its input; every row length
// from 0 to 70 at 16 element offsets (the vector bodies and their scalar
// tails); widening back is exact. Built natively and for x86-64-v3
// (the AVX2 variant's own bfloat16 store) by tests/test_cpp_kernels.py.
// Build: g++ -std=c++17 -O2 -fopenmp -I. -isystem <eigen> tests/cpp/float_convert_test.cc
// Run: ./float_convert_test (prints "ALL PASSED" and exits 0 when every check passes)
#include "cpu/float_convert.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using jaxops::cpu::bfloat16;
using jaxops::cpu::float16;

int failures = 0;

void check(bool ok, const char* what, uint32_t bits) {
  if (!ok && ++failures <= 20) std::printf("FAIL: %s (input bits 0x%08x)\n", what, bits);
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
uint16_t bits_of(T v) {
  uint16_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

// The bit patterns checked: a coarse sweep, plus each rounding boundary's
// neighbourhood for bfloat16 (low half 0x7fff..0x8001) and the special values.
std::vector<uint32_t> patterns() {
  std::vector<uint32_t> out;
  for (uint64_t u = 0; u <= 0xffffffffu; u += 997) out.push_back(static_cast<uint32_t>(u));
  for (uint32_t high = 0; high < 0x10000; high += 7) {
    for (uint32_t low : {0x7ffeu, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0u, 1u}) {
      out.push_back(high << 16 | low);
    }
  }
  for (uint32_t special : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu,
                           0x7f7f8000u, 0x7f800000u, 0xff800000u, 0x7f800001u, 0x7fc00000u,
                           0xffffffffu, 0x7fffffffu, 0xff801234u, 0x7fbfffffu}) {
    out.push_back(special);
  }
  return out;
}

// src stored as T by the row conversion under test.
template <typename T>
std::vector<T> stored(const std::vector<float>& src) {
  std::vector<T> dst(src.size());
  jaxops::cpu::store_row(src.data(), dst.data(), static_cast<int64_t>(src.size()));
  return dst;
}

// inputs: the bit patterns of src (named in failures).
void check_bfloat16(const std::vector<uint32_t>& inputs, const std::vector<float>& src) {
  const std::vector<bfloat16> dst = stored<bfloat16>(src);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const uint32_t u = inputs[i];
    const uint16_t got = bits_of(dst[i]);
    if (std::isnan(src[i])) {
      check(got == static_cast<uint16_t>((u >> 16) | 0x40u), "bfloat16 NaN quieted in place", u);
    } else {
      check(got == bits_of(static_cast<bfloat16>(src[i])), "bfloat16 rounds as Eigen", u);
    }
  }
  std::vector<float> back(inputs.size());
  jaxops::cpu::load_row(dst.data(), back.data(), static_cast<int64_t>(dst.size()));
  for (size_t i = 0; i < inputs.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &back[i], sizeof(b));
    check(b == static_cast<uint32_t>(bits_of(dst[i])) << 16, "bfloat16 widens exactly", inputs[i]);
  }
}

void check_float16(const std::vector<uint32_t>& inputs, const std::vector<float>& src) {
  const std::vector<float16> dst = stored<float16>(src);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (std::isnan(src[i])) {
      check(std::isnan(static_cast<float>(dst[i])), "float16 NaN stays NaN", inputs[i]);
    } else {
      check(bits_of(dst[i]) == bits_of(static_cast<float16>(src[i])), "float16 rounds as Eigen",
            inputs[i]);
    }
  }
}

// Every length at every offset: the vector loop, its tail, and no write past n.
void check_lengths() {
  constexpr int kMax = 70, kSentinel = 0x5a5a;
  std::vector<float> src(kMax + 16);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 1.0f + 0.37f * static_cast<float>(i) - 9.0f;
  for (int offset = 0; offset < 16; ++offset) {
    for (int n = 0; n <= kMax; ++n) {
      std::vector<uint16_t> raw(kMax + 32, kSentinel);
      bfloat16* dst = reinterpret_cast<bfloat16*>(raw.data() + offset);
      jaxops::cpu::store_row(src.data() + offset, dst, n);
      for (int i = 0; i < n; ++i) {
        check(bits_of(dst[i]) == bits_of(static_cast<bfloat16>(src[offset + i])),
              "bfloat16 row of every length and offset", static_cast<uint32_t>(n));
      }
      for (size_t i = offset + n; i < raw.size(); ++i) {
        check(raw[i] == kSentinel, "no element written past the row", static_cast<uint32_t>(n));
      }
      for (int i = 0; i < offset; ++i) {
        check(raw[i] == kSentinel, "no element written before the row", static_cast<uint32_t>(n));
      }
    }
  }
}

}  // namespace

int main() {
  const std::vector<uint32_t> inputs = patterns();
  std::vector<float> src(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) src[i] = from_bits(inputs[i]);
  check_bfloat16(inputs, src);
  check_float16(inputs, src);
  check_lengths();
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ALL PASSED (%zu bit patterns)\n", inputs.size());
  return 0;
}
