#include "cpu/sparse.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/gemm_microkernels.h"
#include "cpu/row_buffer.h"
#include "cpu/simd.h"
#include "cpu/sparse_gemv_avx2.h"
#include "cpu/sparse_row_lanes_avx2.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxops::cpu {
namespace {

using ::jaxops::params::kSparseGroup;
using ::jaxops::params::sparse_column;
using ::jaxops::params::sparse_kept_positions;
using ::jaxops::params::sparse_metadata_cols;
using ::jaxops::params::sparse_values_cols;
using microkernels::Update;
using simd::kLanes;

// Rows of x per register block of the GEMV path.
constexpr int kMaxGemvRows = 8;

// Decode-shaped calls (x of at most this many rows) take the GEMV path, which
// reads every packed weight byte once for all rows of x; larger ones
// decompress weight panels and run the dense micro-kernels (each panel's
// decompression pays off over many rows).
constexpr int64_t kMaxGemvPathRows = 64;

// Values per vector step of the AVX-512 paths: 16 kept values are 8 groups,
// 32 input columns (two registers of x) and 4 metadata bytes.
constexpr int64_t kValuesPerStep = 16;

// The whole array as float32: itself when T is float, else a converted copy.
template <typename T>
class FloatCopy {
 public:
  FloatCopy(const T* src, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      data_ = src;
    } else {
      copy_.resize(n);
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
      for (int64_t i = 0; i < n; i += 4096) load_row(src + i, copy_.data() + i, std::min<int64_t>(4096, n - i));
      data_ = copy_.data();
    }
  }
  const float* data() const { return data_; }

 private:
  const float* data_ = nullptr;
  std::vector<float> copy_;
};

#if defined(__AVX512F__)
// The x-column index of each of 16 values k .. k + 15 relative to the first
// column of their 8 groups (4 * (k / 2)): a permute index into two registers
// of x. `word` is the 4 metadata bytes of those values.
inline __m512i permute_index(uint32_t word) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i group_starts =
      _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i positions =
      _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts),
                       _mm512_set1_epi32(3));
  return _mm512_add_epi32(positions, group_starts);
}

inline uint32_t metadata_word(const uint8_t* metadata_row, int64_t k) {
  uint32_t word;
  std::memcpy(&word, metadata_row + k / 4, sizeof(word));
  return word;
}

#endif

// Calls f(std::integral_constant<int, R>()) for R = rows, 1 .. kMaxGemvRows:
// a register block's row count as a compile-time constant.
template <typename F>
inline void with_row_count(int rows, F&& f) {
  switch (rows) {
#define JAXOPS_SPARSE_ROW_COUNT(R) \
  case R:                          \
    return f(std::integral_constant<int, R>());
    JAXOPS_SPARSE_ROW_COUNT(1)
    JAXOPS_SPARSE_ROW_COUNT(2)
    JAXOPS_SPARSE_ROW_COUNT(3)
    JAXOPS_SPARSE_ROW_COUNT(4)
    JAXOPS_SPARSE_ROW_COUNT(5)
    JAXOPS_SPARSE_ROW_COUNT(6)
    JAXOPS_SPARSE_ROW_COUNT(7)
    JAXOPS_SPARSE_ROW_COUNT(8)
#undef JAXOPS_SPARSE_ROW_COUNT
    default:
      return;
  }
}

#if defined(__AVX512F__)
// The AVX-512 GEMV. Expanding x against the values (a two-register permute per
// 16 kept values and row of x) costs the same for every output row, so what
// decides the speed is where x and the weight come from: a row-at-a-time loop
// re-reads all of x (128 KB at 8 rows of 4096) from L2 for every output row
// and ran at L2 bandwidth, below the dense dot at 8 rows. Here each OpenMP
// task owns a block of output rows and walks k in chunks small enough that the
// chunk of x (every row) stays in L1 while all outputs of the block read it;
// register blocks of 3 outputs x 4 rows of x load each x vector once for
// three permutes. Partial sums of the chunks stay 16 lanes wide in a per-task
// buffer and are reduced once per output at the end. (Expanding the weight to
// dense vectors with vexpandps instead of permuting x measured 3-4x slower on
// Zen: the expand costs more than the permute it saves.)

// Output rows per task (a multiple of kGemvOuts): the task's partial sums
// (outputs x rows vectors, 9 KB at 8 rows) stay in L1 next to the x chunk.
constexpr int64_t kGemvBlockOuts = 18;
// Floats of x (all rows) per k-chunk: 16 KB, a third of a 48 KB L1 (Zen 5),
// half of a 32 KB one (Zen 4).
constexpr int64_t kGemvChunkFloats = 4096;
// Outputs x rows of x per register block (12 accumulators): kGemvOuts
// permutes share each loaded pair of x vectors. 2 x 8 and 4 x 4 measured
// 5-20% slower at 1-8 rows of 4096 (Zen 5, one thread).
constexpr int kGemvOuts = 3;
constexpr int kGemvRows = 4;
static_assert(kGemvBlockOuts % kGemvOuts == 0 && kGemvRows <= kMaxGemvRows);

// The kept values per k-chunk for `rows` rows of x: whole vector steps, at
// least 4 of them (so the partial sums' load and store stay a small share).
inline int64_t gemv_chunk_values(int64_t rows) {
  const int64_t fit = kGemvChunkFloats / (2 * rows) / kValuesPerStep * kValuesPerStep;
  return std::max<int64_t>(fit, 4 * kValuesPerStep);
}

// sums[o][r] (the 16 floats at acc + (o * acc_stride + r) * 16) += the
// products of `steps` vector steps of output row o's values v[o] (float32, at
// the chunk's first value) with rows r of x (x at the chunk's first column,
// row stride ldx); meta[o] is o's metadata at the chunk's first value.
template <int R, int O>
inline void gemv_chunk(const float* x, int64_t ldx, const float* const* v,
                       const uint8_t* const* meta, int64_t steps, float* acc,
                       int64_t acc_stride) {
  __m512 sums[O][R];
  for (int o = 0; o < O; ++o) {
    for (int r = 0; r < R; ++r) sums[o][r] = _mm512_setzero_ps();
  }
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t k = step * kValuesPerStep;
    __m512i index[O];
    __m512 values[O];
    for (int o = 0; o < O; ++o) {
      index[o] = permute_index(metadata_word(meta[o], k));
      values[o] = _mm512_loadu_ps(v[o] + k);
    }
    const float* xk = x + 2 * k;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 lo = _mm512_loadu_ps(xk + r * ldx), hi = _mm512_loadu_ps(xk + r * ldx + 16);
      for (int o = 0; o < O; ++o) {
        sums[o][r] = _mm512_fmadd_ps(values[o], _mm512_permutex2var_ps(lo, index[o], hi), sums[o][r]);
      }
    }
  }
  for (int o = 0; o < O; ++o) {
    for (int r = 0; r < R; ++r) {
      float* a = acc + (o * acc_stride + r) * kValuesPerStep;
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), sums[o][r]));
    }
  }
}

// y = x W^T + bias: every packed weight byte is read once for all rows of x.
template <typename T>
void sparse_gemv(const float* xf, const T* values, const uint8_t* metadata, const T* bias, T* y,
                 SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t vector_end = half / kValuesPerStep * kValuesPerStep;
  const int64_t chunk = gemv_chunk_values(s.rows);
  const int64_t blocks = (s.out + kGemvBlockOuts - 1) / kGemvBlockOuts;
#pragma omp parallel
  {
    // acc + (o * rows + r) * 16: the 16-lane partial sums of output o0 + o
    // and row r.
    std::vector<float> acc(kGemvBlockOuts * s.rows * kValuesPerStep);
    // The register block's values of one chunk as float32 (unused for float).
    std::vector<float> converted(kGemvOuts * chunk);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t o0 = b * kGemvBlockOuts, outs = std::min(kGemvBlockOuts, s.out - o0);
      std::fill(acc.begin(), acc.begin() + outs * s.rows * kValuesPerStep, 0.f);
      for (int64_t k0 = 0; k0 < vector_end; k0 += chunk) {
        const int64_t kc = std::min(chunk, vector_end - k0), steps = kc / kValuesPerStep;
        for (int64_t o = 0; o < outs; o += kGemvOuts) {
          const int n = static_cast<int>(std::min<int64_t>(kGemvOuts, outs - o));
          const float* v[kGemvOuts];
          const uint8_t* meta[kGemvOuts];
          for (int j = 0; j < n; ++j) {
            const int64_t row = o0 + o + j;
            v[j] = read_as_float(values + row * half + k0, kc, converted.data() + j * chunk);
            meta[j] = metadata + row * mcols + k0 / 4;
          }
          // The chunk of the next register block's rows: each is a short
          // stream of its own, which the hardware prefetchers pick up late
          // (this prefetch measured 10-25% faster at 1-8 rows).
          const int64_t next_end = std::min(o0 + o + 2 * kGemvOuts, s.out);
          for (int64_t row = o0 + o + kGemvOuts; row < next_end; ++row) {
            const char* p = reinterpret_cast<const char*>(values + row * half + k0);
            for (int64_t byte = 0; byte < kc * int64_t{sizeof(T)}; byte += 64) {
              simd::prefetch<3>(p + byte);
            }
            simd::prefetch<3>(metadata + row * mcols + k0 / 4);
          }
          for (int64_t r = 0; r < s.rows; r += kGemvRows) {
            const int rb = static_cast<int>(std::min<int64_t>(kGemvRows, s.rows - r));
            const float* xr = xf + r * s.in + 2 * k0;
            float* a = acc.data() + (o * s.rows + r) * kValuesPerStep;
            with_row_count(rb, [&](auto rows) {
              if (n == kGemvOuts) {
                gemv_chunk<rows, kGemvOuts>(xr, s.in, v, meta, steps, a, s.rows);
              } else {
                for (int j = 0; j < n; ++j) {
                  gemv_chunk<rows, 1>(xr, s.in, v + j, meta + j, steps,
                                      a + j * s.rows * kValuesPerStep, s.rows);
                }
              }
            });
          }
        }
      }
      for (int64_t o = 0; o < outs; ++o) {
        const int64_t row = o0 + o;
        const float b = bias ? to_float(bias[row]) : 0.f;
        for (int64_t r = 0; r < s.rows; ++r) {
          float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(acc.data() + (o * s.rows + r) * kValuesPerStep));
          // The values past the last whole vector step (in not a multiple of 32).
          for (int64_t k = vector_end; k < half; ++k) {
            sum += to_float(values[row * half + k]) *
                   xf[r * s.in + sparse_column(metadata + row * mcols, k)];
          }
          y[r * s.out + row] = from_float<T>(sum + b);
        }
      }
    }
  }
}

#endif  // __AVX512F__

// The GEMV with the rows of x along the vector lanes instead of the input
// columns (every ISA: GCC vector types of P lanes, split into the build's
// registers). x is transposed once per call into xt (column c's rows at xt +
// c * P, zero-padded to P = 1, 4, 8 or 16 lanes), and each kept value is one
// FMA: its weight broadcast against the column's P rows. The expensive part
// of the AVX-512 path above (a two-register permute per 16 kept values *and
// row of x*) is gone, and so is its need to keep a chunk of x in L1: each
// thread walks whole packed rows of RowLaneOuts<P> outputs side by side, so
// the weight is read as a few sequential streams that the hardware
// prefetchers follow, and the columns of xt that those outputs read are the
// same (an 8-column window per metadata byte). Measured on Zen 4 from memory,
// w [11008, 4096] float32, 2 threads (this file's kernel alone, two rounds):
// 4 rows 8.3/6.6 -> 5.6/6.4 ms, 8 rows 10.7/9.1 -> 7.0/6.5, 16 rows 14.9/15.5
// -> 10.8/9.3; over 16 rows in blocks of 16 (each reads the whole weight), 24
// to 64 rows 1.9-2.4x faster (32 rows 43 -> 17-20 ms, 64 rows 70-75 -> 35-39);
// at 2 rows the two paths take the same time, at 1 row the path above is
// faster (three quarters of the lanes would idle). With AVX-512,
// bfloat16/float16 weights keep the path above (already several times XLA's
// dense product). Without AVX-512 this path takes every dtype from 3 rows on
// (and on the generic variant from 1 row, P = 1: scalar FMAs whose metadata
// is decoded a byte at a time, the vector lanes having nothing to share):
// bfloat16/float16 packed rows are converted to float32 a block of outputs
// at a time into a buffer the thread owns (vectorised conversion, the rows
// then read from L1/L2), since a scalar conversion per broadcast value would
// cost more than the FMA. On AVX2 the permute alternative (two vpermps and a
// blend per 8 values and row of x, cpu/sparse_gemv_avx2.h) issues three
// shuffles per FMA against this path's scalar index arithmetic, which the
// four integer ALUs absorb: it is kept for 1 and 2 rows only.
constexpr int64_t kMaxRowLaneRows = kMaxGemvPathRows;
#if defined(__AVX512F__)
constexpr int64_t kMinRowLaneRows = 3;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kMinRowLaneRows = 3;
#else
constexpr int64_t kMinRowLaneRows = 1;
#endif

// Outputs side by side per block: 2 accumulators (even and odd values) of P
// lanes each per output, at most 8 vector registers of the build's width (of
// 16 with AVX2 and SSE, 32 with AVX-512), and at most 4 outputs.
template <int P>
inline constexpr int kRowLaneOuts =
    std::min(4, std::max(1, 4 * simd::kLanes / P));

// P lanes of float32 (xmm, ymm or zmm, or a scalar): the x-rows of one input
// column. GCC's vector extension, so one definition serves every width (a * b
// + c contracts to an FMA).
template <int P>
struct RowLanes {
  typedef float V __attribute__((vector_size(P * sizeof(float))));
  // (acc by reference: a function returning a vector wider than the build's
  // registers draws GCC's ABI note, -Wpsabi.)
  static void fma(float w, const float* x, V& acc) {
    V v;
    std::memcpy(&v, x, sizeof(V));
    acc += w * v;
  }
};
template <>
struct RowLanes<1> {
  using V = float;
  static void fma(float w, const float* x, V& acc) { acc += w * *x; }
};

// sums[o * P + r] = sum over the kept values of packed rows v[o] (O of them):
// v[o][k] x[r, column(o, k)], x given as xt (P lanes per column). Two
// accumulators per output (even and odd values) keep 2 * O FMA chains apart.
template <int P, int O>
inline void row_lane_dots(const float* xt, const float* const* v, const uint8_t* const* meta,
                          int64_t in, float* sums) {
  using L = RowLanes<P>;
  typename L::V even[O] = {}, odd[O] = {};
  // Whole metadata bytes: 4 values, 2 groups, 8 input columns. The byte is
  // loaded once and its four 2-bit positions (params/sparse.h) taken apart
  // here: sparse_position per value (an index and a shift each) measured ~25%
  // slower with the weight in cache.
  const int64_t bytes = in / 8;
  int64_t q = 0;
#if defined(JAXOPS_SPARSE_ROW_LANES_AVX2)
  // AVX2, 8 lanes: whole pairs of metadata bytes with the index arithmetic
  // cut to ~1.5 uops a value (cpu/sparse_row_lanes_avx2.h): the kernel 1.26x
  // faster at 8 rows of 4096 with the weight in cache (w [11008, 4096]
  // float32, 2 threads, 4.84 -> 3.85 ms); the whole op, streaming the weight,
  // 1.42-1.58x -> 1.55-1.66x the dense dot's CPU time (alternated runs). The
  // loop below takes the odd last byte and half byte.
  if constexpr (P == sparse_avx2::kRowLanes) {
    q = sparse_avx2::row_lane_byte_pairs<O>(xt, v, meta, bytes, even, odd);
  }
#endif
  for (; q < bytes; ++q) {
    const float* window = xt + 8 * q * P;
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const unsigned b = meta[o][q];
      const float* w = v[o] + 4 * q;
      L::fma(w[0], window + (b & 3) * P, even[o]);
      L::fma(w[1], window + ((b >> 2) & 3) * P, odd[o]);
      L::fma(w[2], window + (4 + ((b >> 4) & 3)) * P, even[o]);
      L::fma(w[3], window + (4 + (b >> 6)) * P, odd[o]);
    }
  }
  // in / 4 odd: the last group's two values, in the low nibble of the last byte.
  if (in % 8 != 0) {
    const float* window = xt + 8 * bytes * P;
    for (int o = 0; o < O; ++o) {
      const unsigned b = meta[o][bytes];
      const float* w = v[o] + 4 * bytes;
      L::fma(w[0], window + (b & 3) * P, even[o]);
      L::fma(w[1], window + ((b >> 2) & 3) * P, odd[o]);
    }
  }
  for (int o = 0; o < O; ++o) {
    const typename L::V sum = even[o] + odd[o];
    std::memcpy(sums + o * P, &sum, sizeof(sum));
  }
}

template <int P, typename T>
void row_lane_gemv(const float* xf, const T* values, const uint8_t* metadata, const T* bias,
                   T* y, SparseLinearShape s) {
  constexpr int kOuts = kRowLaneOuts<P>;
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  std::vector<float> xt(s.in * P, 0.f);
  for (int64_t c = 0; c < s.in; ++c) {
    for (int64_t r = 0; r < s.rows; ++r) xt[c * P + r] = xf[r * s.in + c];
  }
  const int64_t blocks = (s.out + kOuts - 1) / kOuts;
#pragma omp parallel
  {
    // The block's packed rows as float32 (bfloat16/float16 weights only).
    std::vector<float> converted(std::is_same_v<T, float> ? 0 : kOuts * half);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t o0 = b * kOuts;
      const int n = static_cast<int>(std::min<int64_t>(kOuts, s.out - o0));
      const float* v[kOuts];
      const uint8_t* meta[kOuts];
      for (int j = 0; j < n; ++j) {
        v[j] = read_as_float(values + (o0 + j) * half, half, converted.data() + j * half);
        meta[j] = metadata + (o0 + j) * mcols;
      }
      alignas(64) float sums[kOuts * P];
      if (n == kOuts) {
        row_lane_dots<P, kOuts>(xt.data(), v, meta, s.in, sums);
      } else {
        for (int j = 0; j < n; ++j) row_lane_dots<P, 1>(xt.data(), v + j, meta + j, s.in, sums + j * P);
      }
      for (int j = 0; j < n; ++j) {
        const float add = bias ? to_float(bias[o0 + j]) : 0.f;
        for (int64_t r = 0; r < s.rows; ++r) y[r * s.out + o0 + j] = from_float<T>(sums[j * P + r] + add);
      }
    }
  }
}

// y = x W^T + bias for x of kMinRowLaneRows .. kMaxRowLaneRows rows (x as
// float32).
template <typename T>
inline void row_lane_gemv_any(const float* xf, const T* values, const uint8_t* metadata,
                              const T* bias, T* y, SparseLinearShape s) {
  if constexpr (kMinRowLaneRows == 1) {
    if (s.rows == 1) return row_lane_gemv<1>(xf, values, metadata, bias, y, s);
  }
  if (s.rows <= 4) return row_lane_gemv<4>(xf, values, metadata, bias, y, s);
  if (s.rows <= 8) return row_lane_gemv<8>(xf, values, metadata, bias, y, s);
  // Blocks of 16 rows, each reading the whole packed weight (more lanes per
  // block, as 32 or 64 floats per column, ran 1.4-1.8x slower: the
  // accumulators no longer fit the registers).
  for (int64_t r0 = 0; r0 < s.rows; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, s.rows - r0);
    row_lane_gemv<16>(xf + r0 * s.in, values, metadata, bias, y + r0 * s.out, {rows, s.in, s.out});
  }
}

// The storage bits of T and the exponent field that is all ones in a NaN or
// an infinity.
template <typename T>
struct ExponentBits {
  using Bits = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint16_t>;
  static constexpr Bits kMask = std::is_same_v<T, float>      ? 0x7f800000u
                                : std::is_same_v<T, bfloat16> ? 0x7f80u
                                                              : 0x7c00u;
};

// Whether any of x[0, n) is a NaN or an infinity: an OR over the exponent
// bits that vectorises (a loop of isfinite calls ran scalar, ~0.7 ns a value).
template <typename T>
bool any_non_finite(const T* x, int64_t n) {
  using E = ExponentBits<T>;
  const auto* bits = reinterpret_cast<const typename E::Bits*>(x);
  unsigned found = 0;
#pragma omp simd reduction(| : found)
  for (int64_t i = 0; i < n; ++i) found |= (bits[i] & E::kMask) == E::kMask;
  return found != 0;
}

// The dense product x W^T has 0 * x[r, c] for every column c that output o
// prunes, and that is NaN when x[r, c] is a NaN or an infinity; the GEMV paths
// multiply only the kept values, so after them this sets those y[r, o] to NaN
// (the panel GEMM multiplies the decompressed zeros itself). A healthy x costs
// one read of x; only the rows holding non-finite values are matched, group by
// group, against every output's metadata.
template <typename T>
void mark_pruned_non_finite(const T* x, const uint8_t* metadata, T* y, SparseLinearShape s) {
  const int64_t groups = s.in / kSparseGroup, mcols = sparse_metadata_cols(s.in);
  const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  std::vector<std::pair<int64_t, unsigned>> bad;  // (group, its non-finite positions)
  for (int64_t r = 0; r < s.rows; ++r) {
    const T* xr = x + r * s.in;
    if (!any_non_finite(xr, s.in)) continue;
    bad.clear();
    for (int64_t g = 0; g < groups; ++g) {
      unsigned positions = 0;
      for (int p = 0; p < kSparseGroup; ++p) {
        positions |= unsigned{any_non_finite(xr + kSparseGroup * g + p, 1)} << p;
      }
      if (positions != 0) bad.emplace_back(g, positions);
    }
#pragma omp parallel for schedule(static) if (s.out * static_cast<int64_t>(bad.size()) >= (1 << 16))
    for (int64_t o = 0; o < s.out; ++o) {
      for (const auto& [g, positions] : bad) {
        if ((positions & ~sparse_kept_positions(metadata + o * mcols, g)) != 0) {
          y[r * s.out + o] = nan;
          break;
        }
      }
    }
  }
}

// The dense product C[m, n] = A[m, K] B[K, n] with B given in packed sparse
// form: each thread decompresses whole column panels of B (NB columns, all K
// rows, zero-padded to whole vectors) once, then runs the float32
// micro-kernels over row blocks of A and K blocks of the panel, so the inner
// loops are those of a dense GEMM. fill(n0, nc, panel, ldb) scatters B[:, n0 ..
// n0 + nc) into the zeroed panel; store(m0, mc, n0, nc, c, ldc) writes a block
// of the result.
constexpr int64_t kPanelCols = 128;  // B panel width: A is streamed once per panel
constexpr int64_t kBlockRows = 128;  // rows of A (and of the C block) per pass
constexpr int64_t kBlockDepth = 256; // K per micro-kernel call (a B block stays in L2)

template <typename Fill, typename Store>
void decompressed_panel_gemm(int64_t m, int64_t n, int64_t kdim, const float* a, int64_t lda,
                             Fill&& fill, Store&& store) {
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
#pragma omp parallel
  {
    std::vector<float> panel(kdim * kPanelCols), c(kBlockRows * kPanelCols);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanelCols, nc = std::min(kPanelCols, n - n0);
      const int64_t ldb = (nc + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
      std::fill(panel.begin(), panel.begin() + kdim * ldb, 0.f);
      fill(n0, nc, panel.data(), ldb);
      for (int64_t m0 = 0; m0 < m; m0 += kBlockRows) {
        const int64_t mc = std::min(kBlockRows, m - m0);
        for (int64_t k0 = 0; k0 < kdim; k0 += kBlockDepth) {
          const int64_t kc = std::min(kBlockDepth, kdim - k0);
          const float* ab = a + m0 * lda + k0;
          const float* bb = panel.data() + k0 * ldb;
          if (k0 == 0) {
            microkernels::gemm<Update::kOverwrite>(mc, ldb, kc, ab, lda, 1, bb, ldb, c.data(), ldb);
          } else {
            microkernels::gemm<Update::kAdd>(mc, ldb, kc, ab, lda, 1, bb, ldb, c.data(), ldb);
          }
        }
        store(m0, mc, n0, nc, c.data(), ldb);
      }
    }
  }
}

}  // namespace

template <typename T>
void sparse_linear_fwd(const T* x, const T* values, const uint8_t* metadata, const T* bias, T* y,
                       SparseLinearShape s) {
  if (s.rows == 0 || s.out == 0) return;
  advise_huge_pages(y, sizeof(T) * s.rows * s.out);
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const FloatCopy<T> xf(x, s.rows * s.in);
  if (s.rows <= kMaxGemvPathRows) {
#if defined(__AVX512F__)
    if (std::is_same_v<T, float> && s.rows >= kMinRowLaneRows) {
      row_lane_gemv_any(xf.data(), values, metadata, bias, y, s);
    } else {
      sparse_gemv(xf.data(), values, metadata, bias, y, s);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (s.rows >= kMinRowLaneRows) {
      row_lane_gemv_any(xf.data(), values, metadata, bias, y, s);
    } else {
      sparse_avx2::sparse_gemv(xf.data(), values, metadata, bias, y, s);
    }
#else
    row_lane_gemv_any(xf.data(), values, metadata, bias, y, s);
#endif
    return mark_pruned_non_finite(x, metadata, y, s);
  }
  // B = W^T: panel row k, column j holds W[n0 + j, k].
  auto fill = [&](int64_t n0, int64_t nc, float* panel, int64_t ldb) {
    for (int64_t j = 0; j < nc; ++j) {
      const T* v = values + (n0 + j) * half;
      const uint8_t* meta = metadata + (n0 + j) * mcols;
      for (int64_t k = 0; k < half; ++k) panel[sparse_column(meta, k) * ldb + j] += to_float(v[k]);
    }
  };
  auto store = [&](int64_t m0, int64_t mc, int64_t n0, int64_t nc, const float* c, int64_t ldc) {
    for (int64_t i = 0; i < mc; ++i) {
      T* dst = y + (m0 + i) * s.out + n0;
      const float* src = c + i * ldc;
      for (int64_t j = 0; j < nc; ++j) {
        dst[j] = from_float<T>(src[j] + (bias ? to_float(bias[n0 + j]) : 0.f));
      }
    }
  };
  decompressed_panel_gemm(s.rows, s.out, s.in, xf.data(), s.in, fill, store);
}

template <typename T>
void sparse_linear_dx(const T* dy, const T* values, const uint8_t* metadata, T* dx,
                      SparseLinearShape s) {
  if (s.rows == 0) return;
  advise_huge_pages(dx, sizeof(T) * s.rows * s.in);
  if (s.out == 0) {
    std::fill(dx, dx + s.rows * s.in, from_float<T>(0.f));
    return;
  }
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const FloatCopy<T> dyf(dy, s.rows * s.out);
  // B = W: panel row o holds W[o, n0 .. n0 + nc); panels start on a group
  // boundary (kPanelCols is a multiple of 4), so they own whole groups.
  auto fill = [&](int64_t n0, int64_t nc, float* panel, int64_t ldb) {
    for (int64_t o = 0; o < s.out; ++o) {
      const T* v = values + o * half;
      const uint8_t* meta = metadata + o * mcols;
      for (int64_t k = n0 / 2; k < (n0 + nc) / 2; ++k) {
        panel[o * ldb + sparse_column(meta, k) - n0] += to_float(v[k]);
      }
    }
  };
  auto store = [&](int64_t m0, int64_t mc, int64_t n0, int64_t nc, const float* c, int64_t ldc) {
    for (int64_t i = 0; i < mc; ++i) {
      T* dst = dx + (m0 + i) * s.in + n0;
      const float* src = c + i * ldc;
      for (int64_t j = 0; j < nc; ++j) dst[j] = from_float<T>(src[j]);
    }
  };
  decompressed_panel_gemm(s.rows, s.in, s.out, dyf.data(), s.out, fill, store);
}

namespace {

// Outputs per block of the sampled product: a block's float32 copy of dy's
// columns (rows x kOutBlock) and a 32-column strip of x stay in L2 while every
// output of the block reads them.
constexpr int64_t kOutBlock = 64;

// A block's dy columns converted to float32: element (r, j) (row r of dy,
// output o0 + j) at data[r * row_stride + j * out_stride].
struct DyBlock {
  float* data;
  int64_t row_stride;
  int64_t out_stride;
};

// The value gradient dvalues[o, k] = sum_r dy[r, o] x[r, column(o, k)] is
// computed a block of outputs at a time. The AVX-512 path gathers each
// output's kept columns of x in registers (one two-register permute per 16
// values); the other ISAs take the block's dense product (below).
#if defined(__AVX512F__)
// The first columns of x the vector path covers.
inline int64_t sampled_vector_cols(int64_t in) { return 2 * (sparse_values_cols(in) / kValuesPerStep * kValuesPerStep); }

// The block's dy columns as the vector path reads them: a row of kOutBlock
// outputs per row of x (each output's broadcast, next to its neighbours').
inline DyBlock dy_block_layout(float* data, int64_t /*rows*/) { return {data, kOutBlock, 1}; }

// Outputs o0 .. o0 + n (n <= kOutBlock) of a block whose dy columns are dyb
// [rows, kOutBlock], values k < sampled_vector_cols / 2.
template <typename T>
void sampled_block_vector(DyBlock dy, const float* x, const uint8_t* metadata, T* dvalues,
                          int64_t o0, int64_t n, SparseLinearShape s) {
  const float* dyb = dy.data;
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t k_vector_end = sampled_vector_cols(s.in) / 2;
  constexpr int kOuts = 4;  // outputs sharing each loaded strip of x
  for (int64_t k = 0; k < k_vector_end; k += kValuesPerStep) {
    const float* xk = x + 2 * k;
    for (int64_t j0 = 0; j0 < n; j0 += kOuts) {
      const int outs = static_cast<int>(std::min<int64_t>(kOuts, n - j0));
      __m512i index[kOuts];
      __m512 sums[kOuts];
      for (int j = 0; j < kOuts; ++j) {
        index[j] = permute_index(metadata_word(metadata + (o0 + j0 + std::min(j, outs - 1)) * mcols, k));
        sums[j] = _mm512_setzero_ps();
      }
      for (int64_t r = 0; r < s.rows; ++r) {
        const __m512 lo = _mm512_loadu_ps(xk + r * s.in), hi = _mm512_loadu_ps(xk + r * s.in + 16);
        const float* d = dyb + r * kOutBlock + j0;
#pragma GCC unroll 4
        for (int j = 0; j < kOuts; ++j) {
          sums[j] = _mm512_fmadd_ps(_mm512_set1_ps(d[j]),
                                    _mm512_permutex2var_ps(lo, index[j], hi), sums[j]);
        }
      }
      for (int j = 0; j < outs; ++j) {
        alignas(64) float out[kValuesPerStep];
        _mm512_store_ps(out, sums[j]);
        T* dst = dvalues + (o0 + j0 + j) * half + k;
        for (int i = 0; i < kValuesPerStep; ++i) dst[i] = from_float<T>(out[i]);
      }
    }
  }
}

// x as the vector path reads it: float32, row-major.
template <typename T>
using SampledColumns = FloatCopy<T>;
#else
// Without AVX-512's two-register permute, gathering each output's kept
// columns of x costs two in-register permutes and a blend per 8 values beside
// each FMA, so the shuffle port, not the FMA pipes, would set the pace. The
// block's dense product dy_b^T x (twice the multiply-adds) runs in the
// register-blocked micro-kernels at close to the FMA rate instead, and each
// output keeps the two values per group its metadata names. Read in place,
// x's rows are s.in floats apart (16 KB at 4096): a micro-kernel walking a
// column strip through that stride touches a new page and the same few cache
// sets every row (it ran at 0.25x XLA's dense product). So x is packed once
// per call into strips of columns whose rows are contiguous, and each strip's
// product runs over all rows with its accumulators in registers.
constexpr int64_t kStrip = microkernels::kMaxVecsPerStrip * kLanes;
static_assert(kStrip % kSparseGroup == 0, "a strip holds whole groups");

// Strips per dense product of a block: its float32 result (kOutBlock x 128
// floats, 32 KB) stays in L1/L2 until the block's outputs keep their values.
constexpr int64_t kStripsPerProduct = 128 / kStrip;

inline int64_t sampled_vector_cols(int64_t in) { return in / kStrip * kStrip; }

// The block's dy columns as the micro-kernels read their A operand: each
// output's rows contiguous, so a register block's broadcasts are MR
// sequential streams (with a row of outputs per row of x instead, every
// broadcast step reads a new line at a stride that maps to a few L1 sets).
inline DyBlock dy_block_layout(float* data, int64_t rows) { return {data, 1, rows}; }

// x's first sampled_vector_cols(in) columns as float32 strips [strip][row][kStrip].
template <typename T>
class SampledColumns {
 public:
  SampledColumns(const T* x, SparseLinearShape s) : data_(sampled_vector_cols(s.in) * s.rows) {
    const int64_t strips = sampled_vector_cols(s.in) / kStrip;
#pragma omp parallel for schedule(static) if (s.rows * strips * kStrip >= (int64_t{1} << 16))
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t strip = 0; strip < strips; ++strip) {
        load_row(x + r * s.in + strip * kStrip, data_.data() + (strip * s.rows + r) * kStrip, kStrip);
      }
    }
  }
  const float* data() const { return data_.data(); }

 private:
  std::vector<float> data_;
};

template <typename T>
void sampled_block_vector(DyBlock dy, const float* strips, const uint8_t* metadata,
                          T* dvalues, int64_t o0, int64_t n, SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  const int64_t total_strips = sampled_vector_cols(s.in) / kStrip;
  alignas(64) float dense[kOutBlock * kStripsPerProduct * kStrip];
  constexpr int64_t ldc = kStripsPerProduct * kStrip;
  for (int64_t first = 0; first < total_strips; first += kStripsPerProduct) {
    const int64_t count = std::min(kStripsPerProduct, total_strips - first);
    for (int64_t strip = 0; strip < count; ++strip) {
      microkernels::gemm<Update::kOverwrite>(n, kStrip, s.rows, dy.data, dy.out_stride, dy.row_stride,
                                             strips + (first + strip) * s.rows * kStrip, kStrip,
                                             dense + strip * kStrip, ldc);
    }
    const int64_t c0 = first * kStrip, c1 = (first + count) * kStrip;
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* meta = metadata + (o0 + j) * mcols;
      const float* row = dense + j * ldc - c0;
      T* dst = dvalues + (o0 + j) * half;
      for (int64_t k = c0 / 2; k < c1 / 2; ++k) dst[k] = from_float<T>(row[sparse_column(meta, k)]);
    }
  }
}
#endif

// The values past the vector path's columns, one dot product over the rows each.
template <typename T>
void sampled_block_tail(DyBlock dy, const T* x, const uint8_t* metadata, T* dvalues,
                        int64_t o0, int64_t n, SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in), mcols = sparse_metadata_cols(s.in);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* meta = metadata + (o0 + j) * mcols;
    for (int64_t k = sampled_vector_cols(s.in) / 2; k < half; ++k) {
      const int64_t col = sparse_column(meta, k);
      float sum = 0.f;
      for (int64_t r = 0; r < s.rows; ++r) {
        sum += dy.data[r * dy.row_stride + j * dy.out_stride] * to_float(x[r * s.in + col]);
      }
      dvalues[(o0 + j) * half + k] = from_float<T>(sum);
    }
  }
}

}  // namespace

template <typename T>
void sparse_linear_dvalues(const T* dy, const T* x, const uint8_t* metadata, T* dvalues,
                           SparseLinearShape s) {
  const int64_t half = sparse_values_cols(s.in);
  if (s.out == 0 || half == 0) return;
  advise_huge_pages(dvalues, sizeof(T) * s.out * half);
#if defined(__AVX512F__)
  const SampledColumns<T> columns(x, s.rows * s.in);
#else
  const SampledColumns<T> columns(x, s);
#endif
  const int64_t blocks = (s.out + kOutBlock - 1) / kOutBlock;
  // dyb is a whole block wide even for a short last block: the AVX-512 path
  // reads (and discards) up to 3 columns past its last output.
#pragma omp parallel
  {
    std::vector<float> dyb(std::max<int64_t>(s.rows, 1) * kOutBlock, 0.f);
    const DyBlock block = dy_block_layout(dyb.data(), s.rows);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t o0 = b * kOutBlock, n = std::min(kOutBlock, s.out - o0);
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          dyb[r * block.row_stride + j * block.out_stride] = to_float(dy[r * s.out + o0 + j]);
        }
      }
      sampled_block_vector(block, columns.data(), metadata, dvalues, o0, n, s);
      sampled_block_tail(block, x, metadata, dvalues, o0, n, s);
    }
  }
}

#define JAXOPS_INSTANTIATE_SPARSE(T)                                                             \
  template void sparse_linear_fwd<T>(const T*, const T*, const uint8_t*, const T*, T*,             \
                                     SparseLinearShape);                                           \
  template void sparse_linear_dx<T>(const T*, const T*, const uint8_t*, T*, SparseLinearShape);    \
  template void sparse_linear_dvalues<T>(const T*, const T*, const uint8_t*, T*, SparseLinearShape);

JAXOPS_INSTANTIATE_SPARSE(float)
JAXOPS_INSTANTIATE_SPARSE(bfloat16)
JAXOPS_INSTANTIATE_SPARSE(float16)

}  // namespace jaxops::cpu
