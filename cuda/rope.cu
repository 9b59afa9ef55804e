#include "cuda/rope.h"

#include "cuda/elementwise.cuh"
#include "cuda/launch.cuh"
#include "params/rope_math.h"

namespace jaxops::cuda {
namespace {

using namespace elementwise;

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

// One thread per output element: a rotated feature combines itself with its
// pair partner; the features past rotary_dim are copied.
template <typename T>
__global__ void rope_kernel(const T* x, T* y, const float* table, RopeShape shape,
                            bool interleaved) {
  const int64_t half = shape.rotary_dim / 2;
  const int64_t total = shape.batch * shape.seq * shape.heads * shape.head_dim;
  for (int64_t k = global_thread(); k < total; k += grid_threads()) {
    const int64_t j = k % shape.head_dim;
    if (j >= shape.rotary_dim) {
      y[k] = x[k];
      continue;
    }
    const int64_t token = k / (shape.heads * shape.head_dim);
    const int64_t b = token / shape.seq, s = token % shape.seq;
    const int64_t row = (shape.position_rows == 1 ? 0 : b) * shape.seq + s;
    // Pair i, and whether j is its first member (y1 = x1 c - x2 s) or its
    // second (y2 = x2 c + x1 s).
    const bool first = interleaved ? (j % 2 == 0) : (j < half);
    const int64_t i = interleaved ? j / 2 : (first ? j : j - half);
    const int64_t partner = interleaved ? (first ? k + 1 : k - 1) : (first ? k + half : k - half);
    const float c = table[row * 2 * half + i];
    const float sn = table[row * 2 * half + half + i];
    const float own = to_float(x[k]), other = to_float(x[partner]);
    y[k] = from_float<T>(first ? own * c - other * sn : own * c + other * sn);
  }
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
  return launch_kernel(rope_kernel<T>, grid_for(total), kThreads, stream, x, y,
                       static_cast<const float*>(workspace), shape, interleaved);
}

#define JAXOPS_CUDA_ROPE_INSTANTIATE(T)                                                   \
  template cudaError_t rope<T>(cudaStream_t, const T*, const int32_t*, T*, float*,        \
                               RopeShape, double, bool, bool);

JAXOPS_CUDA_ROPE_INSTANTIATE(float)
JAXOPS_CUDA_ROPE_INSTANTIATE(__half)
JAXOPS_CUDA_ROPE_INSTANTIATE(__nv_bfloat16)

}  // namespace jaxops::cuda
