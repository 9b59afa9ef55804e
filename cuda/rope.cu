#include "cuda/rope.h"

#include <climits>

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"
#include "cuda/pack_io.cuh"
#include "params/rope_math.h"

namespace jaxops::cuda {
namespace {

using namespace elementwise;
using namespace pack_io;

// sin and cos of a float32 angle, in double, by the reduction and polynomials
// of params/rope_math.h (shared with cpu/vector_math.h's sincos, so both
// platforms build the same table). CUDA's own sincos(double) would need local
// memory for its large-argument path.
__device__ __forceinline__ void sincos_of_float(float angle, float* sin_out, float* cos_out) {
  const double a = angle;
  const double k = rint(a * rope_math::kTwoOverPi);
  const int quadrant = static_cast<int>(static_cast<long long>(k) & 3);
  const double r = rope_math::reduce_quarter_turns(a, k);
  const double s = rope_math::sin_reduced(r);
  const double c = rope_math::cos_reduced(r);
  // sin(r + q pi/2), cos(r + q pi/2): an odd q swaps them, q = 2, 3 negate sin
  // and q = 1, 2 negate cos.
  const double sin_abs = (quadrant & 1) ? c : s;
  const double cos_abs = (quadrant & 1) ? s : c;
  *sin_out = static_cast<float>((quadrant & 2) ? -sin_abs : sin_abs);
  *cos_out = static_cast<float>(((quadrant + 1) & 2) ? -cos_abs : cos_abs);
}

// Row r of the table holds cos[half] then (signed) sin[half] of position row r.
__global__ void rope_table_kernel(const int32_t* positions, float* table, int64_t rows,
                                  int64_t half, int64_t rotary_dim, double theta, float sign) {
  for (int64_t k = global_thread(); k < rows * half; k += grid_threads()) {
    const int64_t r = k / half, i = k % half;
    const float frequency = static_cast<float>(
        pow(theta, -(2.0 * static_cast<double>(i)) / static_cast<double>(rotary_dim)));
    const float angle = static_cast<float>(positions[r]) * frequency;
    float s, c;
    sincos_of_float(angle, &s, &c);
    table[r * 2 * half + i] = c;
    table[r * 2 * half + half + i] = sign * s;
  }
}

// Loads kN consecutive floats of the cos/sin table with the widest aligned
// loads (the callers' offsets are multiples of kN) when kVector, else one by one.
template <int kN, bool kVector>
__device__ __forceinline__ void load_table(const float* p, float (&out)[kN]) {
  constexpr int kStep = !kVector ? 1 : (kN % 4 == 0 ? 4 : (kN % 2 == 0 ? 2 : 1));
#pragma unroll
  for (int k = 0; k < kN; k += kStep) load_pack<float, kStep>(p + k, &out[k]);
}

// kVec elements of T: one 16-byte pack when kVector, else element by element.
template <typename T, int kVec, bool kVector>
__device__ __forceinline__ void load_elements(const T* p, float (&out)[kVec]) {
  if constexpr (kVector) {
    load_pack<T, kVec>(p, out);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = to_float(p[j]);
  }
}

template <typename T, int kVec, bool kVector>
__device__ __forceinline__ void store_elements(T* p, const float (&in)[kVec]) {
  if constexpr (kVector) {
    store_pack<T, kVec>(p, in);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) p[j] = from_float<T>(in[j]);
  }
}

// A (token, head) row of head_dim features per row of threads (threadIdx.y),
// its units spread over threadIdx.x. A unit is kVec features: with neox
// (!kInterleaved) a rotated unit u holds features [u kVec, (u + 1) kVec) and
// their partners half further (both are written: y1 = x1 c - x2 s,
// y2 = x2 c + x1 s); with gptj the pairs are adjacent inside the unit. The
// units past the rotated ones copy the features past rotary_dim. kVector:
// 16-byte packs (kVec = 16 / sizeof(T)); else kVec is 1 (neox) or 2 (gptj) and
// every element is loaded alone.
template <typename T, int kVec, bool kInterleaved, bool kVector>
__global__ void rope_kernel(const T* __restrict__ x, T* __restrict__ y,
                            const float* __restrict__ table, RopeShape shape, int rotate_units,
                            int row_units) {
  constexpr int kPairs = kInterleaved ? kVec / 2 : kVec;
  const int64_t rows = shape.batch * shape.seq * shape.heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int64_t token = row / shape.heads;
  const int64_t b = token / shape.seq, s = token % shape.seq;
  const int64_t half = shape.rotary_dim / 2;
  const float* cos_row = table + ((shape.position_rows == 1 ? 0 : b) * shape.seq + s) * 2 * half;
  const float* sin_row = cos_row + half;
  const T* x_row = x + row * shape.head_dim;
  T* y_row = y + row * shape.head_dim;
  for (int u = threadIdx.x; u < row_units; u += blockDim.x) {
    if (u >= rotate_units) {
      // Features past rotary_dim: copied, kVec at a time (one at a time on the
      // scalar path, where head_dim - rotary_dim may be odd).
      constexpr int kCopy = kVector ? kVec : 1;
      const int64_t f = shape.rotary_dim + static_cast<int64_t>(u - rotate_units) * kCopy;
      float v[kCopy];
      load_elements<T, kCopy, kVector>(x_row + f, v);
      store_elements<T, kCopy, kVector>(y_row + f, v);
      continue;
    }
    const int64_t first = static_cast<int64_t>(u) * kVec;
    const int64_t pair = kInterleaved ? first / 2 : first;
    float c[kPairs], sn[kPairs], a[kVec], partner[kVec];
    load_elements<T, kVec, kVector>(x_row + first, a);
    if constexpr (!kInterleaved) load_elements<T, kVec, kVector>(x_row + first + half, partner);
    load_table<kPairs, kVector>(cos_row + pair, c);
    load_table<kPairs, kVector>(sin_row + pair, sn);
    if constexpr (kInterleaved) {
#pragma unroll
      for (int p = 0; p < kPairs; ++p) {
        const float x1 = a[2 * p], x2 = a[2 * p + 1];
        a[2 * p] = x1 * c[p] - x2 * sn[p];
        a[2 * p + 1] = x2 * c[p] + x1 * sn[p];
      }
    } else {
#pragma unroll
      for (int p = 0; p < kPairs; ++p) {
        const float x1 = a[p], x2 = partner[p];
        a[p] = x1 * c[p] - x2 * sn[p];
        partner[p] = x2 * c[p] + x1 * sn[p];
      }
      store_elements<T, kVec, kVector>(y_row + first + half, partner);
    }
    store_elements<T, kVec, kVector>(y_row + first, a);
  }
}

// Launches rope_kernel for one (pack width, style): rotate_units and the copy
// units of a row, rows of threads filling blocks of about kThreads.
template <typename T, int kVec, bool kInterleaved, bool kVector>
cudaError_t launch_rope(cudaStream_t stream, const T* x, T* y, const float* table,
                        const RopeShape& shape) {
  constexpr int kCopy = kVector ? kVec : 1;
  const int64_t rotate_units = kInterleaved ? shape.rotary_dim / kVec : shape.rotary_dim / 2 / kVec;
  const int64_t row_units = rotate_units + (shape.head_dim - shape.rotary_dim) / kCopy;
  const int64_t rows = shape.batch * shape.seq * shape.heads;
  if (row_units > INT_MAX) return cudaErrorInvalidValue;
  const int threads_x = static_cast<int>(row_units < kThreads ? row_units : kThreads);
  const int rows_per_block = kThreads / threads_x;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  return launch_kernel(rope_kernel<T, kVec, kInterleaved, kVector>,
                       dim3(static_cast<unsigned>(blocks)), dim3(threads_x, rows_per_block),
                       stream, x, y, table, shape, static_cast<int>(rotate_units),
                       static_cast<int>(row_units));
}

// 16-byte packs when x, y and the table are aligned and every unit (kVec features, and a
// neox unit's partner half a rotary_dim further) starts on a pack.
template <typename T>
bool rope_vectorizable(const T* x, const T* y, const float* table, const RopeShape& shape,
                       bool interleaved) {
  constexpr int64_t kVec = kPackElements<T>;
  const int64_t unit_alignment = interleaved ? kVec : 2 * kVec;
  return aligned({x, y, table}) && shape.head_dim % kVec == 0 &&
         shape.rotary_dim % unit_alignment == 0;
}

}  // namespace

template <typename T>
cudaError_t rope(cudaStream_t stream, const T* x, const int32_t* positions, T* y,
                 float* workspace, RopeShape shape, double theta, bool interleaved,
                 bool inverse) {
  const int64_t half = shape.rotary_dim / 2;
  const int64_t rows = shape.position_rows * shape.seq;
  const int64_t total = shape.batch * shape.seq * shape.heads * shape.head_dim;
  if (total == 0) return cudaGetLastError();
  cudaError_t status =
      launch_kernel(rope_table_kernel, grid_for(rows * half), kThreads, stream, positions,
                    workspace, rows, half, shape.rotary_dim, theta, inverse ? -1.0f : 1.0f);
  if (status != cudaSuccess) return status;
  const float* table = workspace;
  if (rope_vectorizable(x, y, table, shape, interleaved)) {
    constexpr int kVec = kPackElements<T>;
    return interleaved ? launch_rope<T, kVec, true, true>(stream, x, y, table, shape)
                       : launch_rope<T, kVec, false, true>(stream, x, y, table, shape);
  }
  return interleaved ? launch_rope<T, 2, true, false>(stream, x, y, table, shape)
                     : launch_rope<T, 1, false, false>(stream, x, y, table, shape);
}

#define JAXOPS_CUDA_ROPE_INSTANTIATE(T)                                                   \
  template cudaError_t rope<T>(cudaStream_t, const T*, const int32_t*, T*, float*,        \
                               RopeShape, double, bool, bool);

JAXOPS_CUDA_ROPE_INSTANTIATE(float)
JAXOPS_CUDA_ROPE_INSTANTIATE(__half)
JAXOPS_CUDA_ROPE_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
