// The explicit SIMD layer of the CPU kernels whose inner loops are written in
// vectors rather than left to `#pragma omp simd` (the attention kernels and
// their register-blocked products, cpu/gemm_microkernels.h): GCC/Clang vector
// types of the build's width (kLanes floats: 16 with AVX-512, 8 with AVX2 and
// FMA, 4 otherwise), with x86 intrinsics where they beat the generic lowering
// (fused multiply-add, max, exp2's rounding and scaling). Each CPU variant
// (docs/cpu_builds.md) compiles this with its own width.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// GCC 12 reports the deliberately undefined pass-through operand inside
// avx512fintrin.h's max/roundscale/scalef as maybe-uninitialized, or, once
// vmax is inlined into the products' epilogue, as uninitialized. The reports
// come from the including kernel's functions, hence file scope.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace jaxops::cpu::simd {

#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int kLanes = 8;
#else
inline constexpr int kLanes = 4;
#endif

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline VecF vload(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }
inline VecI vloadi(const int32_t* p) {
  VecI v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Broadcasts (not VecF{} + x: adding 0.0f is not an identity for -0.0f, so the
// compiler keeps an extra add in the inner loops).
inline VecF vsplat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)  // the condition of kLanes == 8
  return _mm256_set1_ps(x);
#else
  VecF v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}
inline VecI vsplati(int32_t x) {
  VecI v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
}

inline VecF vfma(VecF a, VecF b, VecF c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// 1 / d for d in [1, 2] (the soft cap's tanh): the hardware estimate and one
// Newton step (relative error ~2^-23 from AVX-512's 14-bit estimate, ~2^-22
// from AVX's 12-bit one), where a division would take 16+ cycles per vector
// against the products' 2 FMAs per cycle.
inline VecF vreciprocal_1_2(VecF d) {
#if defined(__AVX512F__)
  const VecF r = _mm512_rcp14_ps(d);
#elif defined(__AVX2__) && defined(__FMA__)
  const VecF r = _mm256_rcp_ps(d);
#else
  return 1.0f / d;
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return r * vfma(-d, r, vsplat(2.0f));
#endif
}

// max(a, b), as MAXPS computes it: b when either is NaN. A running max that
// must keep NaN passes the new value as `a` only if NaN is tracked otherwise;
// exp2 of a NaN score stays NaN (vexp2), which is what carries NaN on.
inline VecF vmax(VecF a, VecF b) {
#if defined(__AVX512F__)
  return _mm512_max_ps(a, b);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_max_ps(a, b);
#else
  return a > b ? a : b;
#endif
}

inline float vsum(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
#endif
}

// The largest of v's lanes, NaN lanes left out (-inf when all are). A tree
// of 4 shuffle-and-max steps where a scalar std::max over the lanes was a
// chain of 16 dependent maxes: decode's online softmax (int8, 4 rows, perf
// samples) went from 0.61 to 0.47 of the values pass's time.
inline float vmax_lanes(VecF v) {
#if defined(__AVX512F__)
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_reduce_max_ps(
      _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(-std::numeric_limits<float>::infinity())));
#else
  float largest = -std::numeric_limits<float>::infinity();
  // std::max(largest, NaN) keeps largest.
  for (int i = 0; i < kLanes; ++i) largest = std::max(largest, v[i]);
  return largest;
#endif
}

// 2^x for x <= ~0, exactly 0 below -126 (so masked -inf scores give 0); NaN for NaN.
// Relative error 2e-8 (near-minimax degree-6 polynomial on [-1/2, 1/2]).
inline VecF vexp2(VecF x) {
  const VecF c6 = vsplat(1.533758477307856e-4f), c5 = vsplat(1.3399870367720723e-3f),
             c4 = vsplat(9.618519805371761e-3f), c3 = vsplat(5.550329014658928e-2f),
             c2 = vsplat(0.24022646248340607f), c1 = vsplat(0.6931471824645996f),
             c0 = vsplat(1.0f);
#if defined(__AVX512F__)
  // MAXPS returns its second operand when either is NaN: x second keeps NaN.
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  VecF n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VecF f = x - n;
  VecF poly = vfma(vfma(vfma(vfma(vfma(vfma(c6, f, c5), f, c4), f, c3), f, c2), f, c1), f, c0);
  return _mm512_scalef_ps(poly, n);
#else
  VecI tiny = x < vsplat(-126.0f);
  x = vmax(vsplat(-126.0f), x);  // x second: a NaN x stays NaN (see vmax)
  const VecF round_magic = vsplat(12582912.0f);  // 1.5 * 2^23: adds round to integer
  VecF n = (x + round_magic) - round_magic;
  VecF f = x - n;
  VecF poly = vfma(vfma(vfma(vfma(vfma(vfma(c6, f, c5), f, c4), f, c3), f, c2), f, c1), f, c0);
  // Vector casts between same-sized vector types reinterpret the bits (a
  // reference cast would break strict aliasing, which GCC warns of at -O3).
  VecI bits = (VecI)poly + (__builtin_convertvector(n, VecI) << 23);
  bits &= ~tiny;
  return (VecF)bits;
#endif
}

// Prefetches the cache line holding p, as __builtin_prefetch(p, kForWrite,
// kLocality) asks, in a form the compiler cannot delete. GCC 12 deleted a
// loop of __builtin_prefetch calls as dead code where nothing else in the loop
// had an effect: the paged decode's next-tile loop, once written with a
// lambda, lost every prefetch and ran at half speed, with no warning. An asm
// volatile statement stays where it is written.
template <int kLocality = 3, bool kForWrite = false>
inline void prefetch(const void* p) {
#if defined(__x86_64__)
  const char& line = *static_cast<const char*>(p);  // the operand; never read
  if constexpr (kForWrite) {
#if defined(__PRFCHW__)
    asm volatile("prefetchw %0" : : "m"(line));
#else
    asm volatile("prefetcht0 %0" : : "m"(line));
#endif
  } else if constexpr (kLocality >= 3) {
    asm volatile("prefetcht0 %0" : : "m"(line));
  } else if constexpr (kLocality == 2) {
    asm volatile("prefetcht1 %0" : : "m"(line));
  } else if constexpr (kLocality == 1) {
    asm volatile("prefetcht2 %0" : : "m"(line));
  } else {
    asm volatile("prefetchnta %0" : : "m"(line));
  }
#elif defined(__aarch64__)
  // PRFM, for the same reason: with __builtin_prefetch, GCC 12's aarch64
  // objects of cpu/attention_forward.cc held 6 PRFMs where the x86 ones hold
  // 18 prefetches (cpu/attention_decode.cc: 6 against 12); as asm, 18 and 12.
  // P{LD,ST}L1KEEP for locality 3, L2 for 2, L3 for 1 (x86's T0/T1/T2),
  // PLDL1STRM for 0 (NTA); "Q": a base register only, which every PRFM takes.
  const char& line = *static_cast<const char*>(p);  // the operand; never read
  if constexpr (kForWrite) {
    asm volatile("prfm pstl1keep, %0" : : "Q"(line));
  } else if constexpr (kLocality >= 3) {
    asm volatile("prfm pldl1keep, %0" : : "Q"(line));
  } else if constexpr (kLocality == 2) {
    asm volatile("prfm pldl2keep, %0" : : "Q"(line));
  } else if constexpr (kLocality == 1) {
    asm volatile("prfm pldl3keep, %0" : : "Q"(line));
  } else {
    asm volatile("prfm pldl1strm, %0" : : "Q"(line));
  }
#else
  __builtin_prefetch(p, kForWrite, kLocality);
#endif
}

}  // namespace jaxops::cpu::simd
