#include "cuda/norms.h"

#include <climits>
#include <cstdint>
#include <initializer_list>

#include "cuda/launch.cuh"
#include "cuda/row_tile.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_tile;

// Layout (cuda/row_tile.cuh): in the forward and the JVP a row per warp for
// short rows (kFwdRowsPerWarpBlock per block), else a row per block of up to
// kMaxRowThreads threads, each thread holding a few 16-byte packs of the row in
// registers; longer rows are processed in chunks and re-read. At most 64
// registers a thread (kMinBlocksPerSm blocks of kMaxRowThreads), so that an SM
// holds 1024 threads and, in the forward, 64 KiB (float32) or 32 KiB (16-bit)
// of rows in registers.
// docs/cuda.md, "Bandwidth-bound kernels", has the plan.
constexpr int kMaxRowThreads = 512;
constexpr int kMinBlocksPerSm = 2;
constexpr int kFwdRowsPerWarpBlock = 4;
// Elements a thread holds per chunk: the forward 16 of x (4 float32 or 2
// 16-bit packs), the JVP 8 of x and 8 of its tangent.
constexpr int kFwdElements = 16;
constexpr int kJvpElements = 8;
// The backward's blocks are the weight gradient's parts (the workspace's rows,
// a few per SM): a row group of up to kMaxBwdRowThreads threads (several
// one-warp groups sharing the part's rows for short rows), each holding
// kBwdElements elements of x, of dy, of the next row's x and dy (loaded while
// this row is reduced) and of the column sums, so that rows of up to 8192
// columns fit in one chunk and their column sums stay in registers: up to 128
// registers a thread, one block of 512 threads (two of 256) an SM.
constexpr int kMaxBwdRowThreads = 512;
constexpr int kBwdElements = 16;
constexpr int kBwdWarpsPerPart = 8;
constexpr int kSumPartsThreads = 256;
// Column indices are int; this bound keeps chunk arithmetic far from overflow.
constexpr int64_t kMaxCols = int64_t{1} << 30;

template <int kVec>
constexpr int kBwdCount = kItems<kVec, kBwdElements>;

// f32 workspace stores, at most 16 bytes per instruction.
template <int kVec>
__device__ __forceinline__ void store_f32(float* p, const float* in) {
  constexpr int kStep = kVec < 4 ? kVec : 4;
#pragma unroll
  for (int j = 0; j < kVec; j += kStep) store_pack<float, kStep>(p + j, in + j);
}

template <typename T, int kVec>
__device__ __forceinline__ void load_or_fill(const T* p, int col, float fill, float* out) {
  if (p != nullptr) {
    load_pack<T, kVec>(p + col, out);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = fill;
  }
}

// Count, mean and sum of squared deviations of a set of values; two sets merge
// with Chan et al.'s formula, which stays accurate when |mean| >> stddev, where
// E[x^2] - E[x]^2 would cancel.
struct MeanM2 {
  float count;
  float mean;
  float m2;
};

// An empty side returns the other as it is: its delta^2 * 0 would be NaN where
// the other's mean is large (a row holding 1e30, whose m2 is rightly inf).
__device__ __forceinline__ MeanM2 merge(const MeanM2& a, const MeanM2& b) {
  if (b.count == 0.f) return a;
  if (a.count == 0.f) return b;
  const float count = a.count + b.count;
  const float delta = b.mean - a.mean;
  const float b_share = __fdividef(b.count, count);
  return {count, a.mean + delta * b_share,
          a.m2 + b.m2 + delta * delta * a.count * b_share};
}

// merge is not symmetric in its arguments, so both lanes of a butterfly pair
// merge (lower lane, upper lane) to agree bit for bit.
__device__ __forceinline__ MeanM2 row_mean_m2(MeanM2 s) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const MeanM2 other{__shfl_xor_sync(kFullWarp, s.count, offset),
                       __shfl_xor_sync(kFullWarp, s.mean, offset),
                       __shfl_xor_sync(kFullWarp, s.m2, offset)};
    s = (lane & offset) ? merge(other, s) : merge(s, other);
  }
  if (blockDim.x > kWarpSize) {
    __shared__ MeanM2 warp_stats[kMaxRowThreads / kWarpSize];
    const int warp = threadIdx.x / kWarpSize;
    if (lane == 0) warp_stats[warp] = s;
    __syncthreads();
    const int warps = blockDim.x / kWarpSize;
    s = warp_stats[0];
    for (int w = 1; w < warps; ++w) s = merge(s, warp_stats[w]);
    __syncthreads();  // warp_stats is reused by the next call
  }
  return s;
}

// Exact two-pass statistics of the values this thread holds for one chunk.
template <int kVec, int kCount>
__device__ __forceinline__ MeanM2 chunk_mean_m2(const float (&v)[kCount * kVec], int base,
                                                int cols) {
  float count = 0.f;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    if (item_col<kVec>(base, i) < cols) {
      count += kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += v[i * kVec + j];
    }
  }
  const float mean = count > 0.f ? __fdividef(sum, count) : 0.f;
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    if (item_col<kVec>(base, i) < cols) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = v[i * kVec + j] - mean;
        m2 += d * d;
      }
    }
  }
  return {count, mean, m2};
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    layer_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                          const T* __restrict__ bias, T* __restrict__ y,
                          float* __restrict__ mean, float* __restrict__ rstd,
                          int64_t rows, int cols, float inv_cols, float epsilon) {
  constexpr int kCount = kItems<kVec, kFwdElements>;
  constexpr int kElems = kCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const T* x_row = x + row * cols;
  T* y_row = y + row * cols;
  const int chunk = blockDim.x * kElems;
  const int chunks = (cols + chunk - 1) / chunk;

  float v[kElems];
  MeanM2 stats{0.f, 0.f, 0.f};
  for (int c = 0; c < chunks; ++c) {
    load_chunk<T, kVec, kCount>(x_row, c * chunk, cols, v);
    stats = merge(stats, chunk_mean_m2<kVec, kCount>(v, c * chunk, cols));
  }
  stats = row_mean_m2(stats);
  const float row_mean = stats.mean;
  const float row_rstd = rsqrtf(stats.m2 * inv_cols + epsilon);
  if (threadIdx.x == 0) {
    mean[row] = row_mean;
    rstd[row] = row_rstd;
  }

  // The last chunk is still in registers: write it first, re-read the others.
  for (int c = chunks - 1; c >= 0; --c) {
    if (c != chunks - 1) load_chunk<T, kVec, kCount>(x_row, c * chunk, cols, v);
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(c * chunk, i);
      if (col >= cols) continue;
      float w[kVec], b[kVec];
      load_or_fill<T, kVec>(weight, col, 1.f, w);
      load_or_fill<T, kVec>(bias, col, 0.f, b);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[i * kVec + j] = (v[i * kVec + j] - row_mean) * row_rstd * w[j] + b[j];
      }
    }
    store_chunk<T, kVec, kCount>(y_row, c * chunk, cols, v);
  }
}

// rms_norm, and add_rms_norm when residual is not null: then the normalised row
// is h = x + residual rounded to T, which is also written out. x, residual and h
// are not __restrict__: h may alias either input (each thread reads its own
// columns of both before it writes them).
template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    rms_norm_fwd_kernel(const T* x, const T* residual, const T* __restrict__ weight,
                        T* __restrict__ y, T* h, float* __restrict__ rstd,
                        int64_t rows, int cols, float inv_cols, float epsilon) {
  constexpr int kCount = kItems<kVec, kFwdElements>;
  constexpr int kElems = kCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const T* x_row = x + row * cols;
  T* y_row = y + row * cols;
  T* h_row = residual != nullptr ? h + row * cols : nullptr;
  const int chunk = blockDim.x * kElems;
  const int chunks = (cols + chunk - 1) / chunk;

  float v[kElems];
  float sum_sq[1] = {0.f};
  for (int c = 0; c < chunks; ++c) {
    load_chunk<T, kVec, kCount>(x_row, c * chunk, cols, v);
    if (residual != nullptr) {
      float r[kElems];
      load_chunk<T, kVec, kCount>(residual + row * cols, c * chunk, cols, r);
#pragma unroll
      for (int e = 0; e < kElems; ++e) v[e] = to_float(from_float<T>(v[e] + r[e]));
      store_chunk<T, kVec, kCount>(h_row, c * chunk, cols, v);
    }
#pragma unroll
    for (int e = 0; e < kElems; ++e) sum_sq[0] += v[e] * v[e];
  }
  row_sum(sum_sq);
  const float row_rstd = rsqrtf(sum_sq[0] * inv_cols + epsilon);
  if (threadIdx.x == 0) rstd[row] = row_rstd;

  // The last chunk is still in registers: write it first, re-read the others
  // (from h, which this thread wrote above).
  for (int c = chunks - 1; c >= 0; --c) {
    if (c != chunks - 1) {
      load_chunk<T, kVec, kCount>(h_row != nullptr ? h_row : x_row, c * chunk, cols, v);
    }
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(c * chunk, i);
      if (col >= cols) continue;
      float w[kVec];
      load_or_fill<T, kVec>(weight, col, 1.f, w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[i * kVec + j] = v[i * kVec + j] * row_rstd * w[j];
    }
    store_chunk<T, kVec, kCount>(y_row, c * chunk, cols, v);
  }
}

// Backward of layer_norm (kCentered) and rms_norm. Block b handles part b: the
// rows [row_begin, row_end) of one group, one row per row group at a time (rows
// interleaved over the block's one-warp row groups for short rows). For every
// row it computes dx from two (one) row sums. The part's column sums of
// dy * xhat (and dy) go to workspace[part][0] (and [1]): when the row fits in
// one chunk they accumulate in registers while the rows stream by (each row's
// x and dy loaded while the previous row is reduced), and the warps of a block
// add theirs in warp order; otherwise a final pass over the part, chunk by
// chunk, accumulates them. dresidual may alias dx; dx must not alias dy or x.
template <typename T, int kVec, bool kCentered>
__global__ void __launch_bounds__(kMaxBwdRowThreads, 1)
    norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                    const T* __restrict__ weight, const float* __restrict__ mean,
                    const float* __restrict__ rstd, const T* dresidual, T* dx,
                    float* __restrict__ workspace, int64_t rows, int cols,
                    int64_t groups, int64_t parts_per_group, float inv_cols) {
  constexpr int kSums = kCentered ? 2 : 1;
  constexpr int kCount = kBwdCount<kVec>;
  constexpr int kElems = kCount * kVec;
  const int64_t part = blockIdx.x;
  const int64_t rows_per_group = rows / groups;
  const int64_t group_begin = part / parts_per_group * rows_per_group;
  const int64_t index = part % parts_per_group;
  const int64_t row_begin = group_begin + rows_per_group * index / parts_per_group;
  const int64_t row_end = group_begin + rows_per_group * (index + 1) / parts_per_group;
  float* part_sums = workspace != nullptr ? workspace + part * kSums * cols : nullptr;
  const int chunk = blockDim.x * kElems;
  const int chunks = (cols + chunk - 1) / chunk;

  float x_v[kElems], dy_v[kElems];
  float dweight_sum[kElems], dbias_sum[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) dweight_sum[e] = dbias_sum[e] = 0.f;
  const auto load_row_chunk = [&](int64_t row, int base, float (&x_out)[kElems],
                                  float (&dy_out)[kElems]) {
    load_chunk<T, kVec, kCount>(x + row * cols, base, cols, x_out);
    load_chunk<T, kVec, kCount>(dy + row * cols, base, cols, dy_out);
  };
  // Adds the chunk in x_v/dy_v of `row` to the column sums.
  const auto add_column_sums = [&](float row_mean, float row_rstd) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      dweight_sum[e] += dy_v[e] * ((x_v[e] - row_mean) * row_rstd);
      if (kCentered) dbias_sum[e] += dy_v[e];
    }
  };
  const auto store_column_sums = [&](int base) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(base, i);
      if (col >= cols) continue;
      store_f32<kVec>(part_sums + col, &dweight_sum[i * kVec]);
      if (kCentered) store_f32<kVec>(part_sums + cols + col, &dbias_sum[i * kVec]);
    }
  };
  // sums[0] += sum of g * xhat, sums[1] += sum of g over the chunk in x_v/dy_v.
  // g = dy * w is rounded once, here and below (__fmul_rn is never contracted
  // into an FMA): nvcc would otherwise fuse the product into g - mean_g, whose
  // operands then differ by its rounding error, and dx where they cancel
  // (every column of a one-column row of layer_norm, exactly 0) would be that
  // error times rstd: 1e-5 at rstd = 316, as the first GPU run found.
  const auto add_row_sums = [&](int base, float row_mean, float row_rstd,
                                float (&sums)[kSums]) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(base, i);
      if (col >= cols) continue;
      float w[kVec];
      load_or_fill<T, kVec>(weight, col, 1.f, w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float g = __fmul_rn(dy_v[i * kVec + j], w[j]);
        sums[0] += g * ((x_v[i * kVec + j] - row_mean) * row_rstd);
        if (kCentered) sums[kSums - 1] += g;
      }
    }
  };
  const auto store_dx = [&](int64_t row, int base, float row_mean, float row_rstd,
                            float mean_g, float mean_gx) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(base, i);
      if (col >= cols) continue;
      float w[kVec], extra[kVec], out[kVec];
      load_or_fill<T, kVec>(weight, col, 1.f, w);
      load_or_fill<T, kVec>(dresidual == nullptr ? nullptr : dresidual + row * cols, col, 0.f,
                            extra);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (x_v[i * kVec + j] - row_mean) * row_rstd;
        const float g = __fmul_rn(dy_v[i * kVec + j], w[j]);
        out[j] = (g - mean_g - xhat * mean_gx) * row_rstd + extra[j];
      }
      store_pack<T, kVec>(dx + row * cols + col, out);
    }
  };

  if (chunks == 1) {
    float x_next[kElems], dy_next[kElems];
    int64_t row = row_begin + threadIdx.y;
    if (row < row_end) load_row_chunk(row, 0, x_v, dy_v);
    for (; row < row_end; row += blockDim.y) {
      const int64_t next = row + blockDim.y;
      if (next < row_end) load_row_chunk(next, 0, x_next, dy_next);
      const float row_mean = kCentered ? mean[row] : 0.f;
      const float row_rstd = rstd[row];
      float sums[kSums] = {};
      add_row_sums(0, row_mean, row_rstd, sums);
      row_sum(sums);
      store_dx(row, 0, row_mean, row_rstd, kCentered ? sums[kSums - 1] * inv_cols : 0.f,
               sums[0] * inv_cols);
      if (part_sums != nullptr) add_column_sums(row_mean, row_rstd);
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        x_v[e] = x_next[e];
        dy_v[e] = dy_next[e];
      }
    }
    if (part_sums == nullptr) return;
    if (blockDim.y > 1) {
      // One-warp row groups (a row fits in one warp's registers): warp y adds
      // the running total of warps 0..y-1 to its own sums, and the last warp
      // holds the part's.
      __shared__ float running[kSums][kWarpSize * kElems];
      for (int y = 0; y < static_cast<int>(blockDim.y); ++y) {
        if (threadIdx.y == y) {
#pragma unroll
          for (int i = 0; i < kCount; ++i) {
            const int col = item_col<kVec>(0, i);
            if (col >= cols) continue;
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              float* total = &running[0][col + j];
              if (y > 0) dweight_sum[i * kVec + j] += total[0];
              total[0] = dweight_sum[i * kVec + j];
              if (kCentered) {
                total = &running[kSums - 1][col + j];
                if (y > 0) dbias_sum[i * kVec + j] += total[0];
                total[0] = dbias_sum[i * kVec + j];
              }
            }
          }
        }
        __syncthreads();
      }
      if (threadIdx.y != blockDim.y - 1) return;
    }
    store_column_sums(0);
    return;
  }

  // Rows longer than a chunk: each row's sums chunk by chunk, then dx with the
  // last chunk still in registers and the others re-read.
  for (int64_t row = row_begin + threadIdx.y; row < row_end; row += blockDim.y) {
    const float row_mean = kCentered ? mean[row] : 0.f;
    const float row_rstd = rstd[row];
    float sums[kSums] = {};
    for (int c = 0; c < chunks; ++c) {
      load_row_chunk(row, c * chunk, x_v, dy_v);
      add_row_sums(c * chunk, row_mean, row_rstd, sums);
    }
    row_sum(sums);
    for (int c = chunks - 1; c >= 0; --c) {
      if (c != chunks - 1) load_row_chunk(row, c * chunk, x_v, dy_v);
      store_dx(row, c * chunk, row_mean, row_rstd, kCentered ? sums[kSums - 1] * inv_cols : 0.f,
               sums[0] * inv_cols);
    }
  }
  if (part_sums == nullptr) return;
  for (int c = 0; c < chunks; ++c) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) dweight_sum[e] = dbias_sum[e] = 0.f;
    for (int64_t row = row_begin; row < row_end; ++row) {
      load_row_chunk(row, c * chunk, x_v, dy_v);
      add_column_sums(kCentered ? mean[row] : 0.f, rstd[row]);
    }
    store_column_sums(c * chunk);
  }
}

// The JVP of layer_norm (kCentered) and of rms_norm, in the forward's layout:
// the row sums of xhat * dx (and dx) chunk by chunk, then dy, the last chunk
// still in registers and the others re-read. An absent dx (null) is zero.
template <typename T, int kVec, bool kCentered>
__global__ void __launch_bounds__(kMaxRowThreads, kMinBlocksPerSm)
    norm_jvp_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                    const float* __restrict__ mean, const float* __restrict__ rstd,
                    const T* __restrict__ dx, const T* __restrict__ dweight,
                    const T* __restrict__ dbias, T* __restrict__ dy, int64_t rows, int cols,
                    float inv_cols) {
  constexpr int kSums = kCentered ? 2 : 1;
  constexpr int kCount = kItems<kVec, kJvpElements>;
  constexpr int kElems = kCount * kVec;
  const int64_t row = group_row();
  if (row >= rows) return;
  const float row_mean = kCentered ? mean[row] : 0.f;
  const float row_rstd = rstd[row];
  const int chunk = blockDim.x * kElems;
  const int chunks = (cols + chunk - 1) / chunk;

  float x_v[kElems], dx_v[kElems];
  // Columns past the row's end read as x = dx = 0, and add nothing to the sums.
  const auto load_row_chunk = [&](int base) {
    load_chunk<T, kVec, kCount>(x + row * cols, base, cols, x_v);
    if (dx != nullptr) {
      load_chunk<T, kVec, kCount>(dx + row * cols, base, cols, dx_v);
    } else {
#pragma unroll
      for (int e = 0; e < kElems; ++e) dx_v[e] = 0.f;
    }
  };

  // sums[0] = sum of xhat * dx, sums[1] = sum of dx.
  float sums[kSums] = {};
  for (int c = 0; c < chunks; ++c) {
    load_row_chunk(c * chunk);
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      sums[0] += (x_v[e] - row_mean) * row_rstd * dx_v[e];
      if (kCentered) sums[kSums - 1] += dx_v[e];
    }
  }
  row_sum(sums);
  const float mean_xhat_dx = sums[0] * inv_cols;
  const float mean_dx = kCentered ? sums[kSums - 1] * inv_cols : 0.f;

  for (int c = chunks - 1; c >= 0; --c) {
    if (c != chunks - 1) load_row_chunk(c * chunk);
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int col = item_col<kVec>(c * chunk, i);
      if (col >= cols) continue;
      float w[kVec], dw[kVec], db[kVec], out[kVec];
      load_or_fill<T, kVec>(weight, col, 1.f, w);
      load_or_fill<T, kVec>(dweight, col, 0.f, dw);
      load_or_fill<T, kVec>(dbias, col, 0.f, db);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (x_v[i * kVec + j] - row_mean) * row_rstd;
        const float dxhat = (dx_v[i * kVec + j] - mean_dx - xhat * mean_xhat_dx) * row_rstd;
        out[j] = dxhat * w[j] + xhat * dw[j] + db[j];
      }
      store_pack<T, kVec>(dy + row * cols + col, out);
    }
  }
}

// out_k[g][c] = sum over the parts p of group g of workspace[g * parts + p][k][c],
// in part order; out_k may be null (k = blockIdx.y).
template <typename T>
__global__ void __launch_bounds__(kSumPartsThreads)
    sum_parts_kernel(const float* __restrict__ workspace, T* __restrict__ out0,
                     T* __restrict__ out1, int64_t groups, int64_t parts_per_group,
                     int sums, int cols) {
  T* out = blockIdx.y == 0 ? out0 : out1;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (out == nullptr || index >= groups * cols) return;
  const int64_t group = index / cols;
  const int64_t col = index % cols;
  const float* p = workspace + (group * parts_per_group * sums + blockIdx.y) * cols + col;
  const int64_t stride = static_cast<int64_t>(sums) * cols;
  float sum = 0.f;
  for (int64_t t = 0; t < parts_per_group; ++t) sum += p[t * stride];
  out[index] = from_float<T>(sum);
}

bool valid_shape(NormShape shape) {
  return shape.rows >= 0 && shape.cols > 0 && shape.cols <= kMaxCols;
}

// Launches over the rows of `shape` in the forward's layout (launch_row_groups).
template <typename T, int kElements, typename LaunchWith>
cudaError_t launch_rows(NormShape shape, std::initializer_list<const void*> buffers,
                        LaunchWith&& launch_with) {
  if (!valid_shape(shape)) return cudaErrorInvalidValue;
  return launch_row_groups<T, kElements>(shape.rows, shape.cols, buffers,
                                         kFwdRowsPerWarpBlock, kMaxRowThreads, launch_with);
}

bool valid_layout(NormShape shape, WeightGradLayout layout) {
  return layout.groups > 0 && shape.rows % layout.groups == 0 && layout.parts > 0 &&
         layout.groups <= INT_MAX / layout.parts;
}

template <typename T, bool kCentered>
cudaError_t norm_bwd(cudaStream_t stream, const T* dy, const T* x, const T* weight,
                     const float* mean, const float* rstd, const T* dresidual, T* dx,
                     T* dweight, T* dbias, float* workspace, NormShape shape,
                     WeightGradLayout layout) {
  if (!valid_shape(shape) || !valid_layout(shape, layout)) return cudaErrorInvalidValue;
  const bool column_sums = dweight != nullptr || dbias != nullptr;
  if (column_sums && workspace == nullptr) return cudaErrorInvalidValue;
  if (!column_sums) workspace = nullptr;
  const int cols = static_cast<int>(shape.cols);
  const int64_t parts = layout.groups * layout.parts;
  const bool vectorize = can_vectorize<T>(cols, {dy, x, weight, dresidual, dx, workspace});
  const cudaError_t status = with_pack_width<T>(vectorize, [&](auto pack_width) {
    constexpr int kVec = decltype(pack_width)::value;
    RowLaunch launch;
    const cudaError_t shaped = row_launch<kVec, kBwdCount<kVec>>(
        cols, parts, true, kBwdWarpsPerPart, kMaxBwdRowThreads, &launch);
    if (shaped != cudaSuccess) return shaped;
    return launch_kernel(norm_bwd_kernel<T, kVec, kCentered>, launch.grid, launch.block, stream,
                         dy, x, weight, mean, rstd, dresidual, dx, workspace, shape.rows, cols,
                         layout.groups, layout.parts, 1.f / static_cast<float>(cols));
  });
  if (status != cudaSuccess || !column_sums) return status;
  constexpr int kSums = kCentered ? 2 : 1;
  const int64_t blocks = (layout.groups * cols + kSumPartsThreads - 1) / kSumPartsThreads;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  return launch_kernel(sum_parts_kernel<T>, dim3(static_cast<unsigned>(blocks), kSums),
                       dim3(kSumPartsThreads), stream, workspace, dweight, dbias, layout.groups,
                       layout.parts, kSums, cols);
}

// rms_norm when residual is null, else add_rms_norm.
template <typename T>
cudaError_t rms_norm_fwd_launch(cudaStream_t stream, const T* x, const T* residual,
                                const T* weight, T* y, T* h, float* rstd, NormShape shape,
                                float epsilon) {
  return launch_rows<T, kFwdElements>(shape, {x, residual, weight, y, h},
                                   [&](auto pack_width, RowLaunch launch) {
    return launch_kernel(rms_norm_fwd_kernel<T, decltype(pack_width)::value>, launch.grid,
                         launch.block, stream, x, residual, weight, y, h, rstd, shape.rows,
                         static_cast<int>(shape.cols), 1.f / static_cast<float>(shape.cols),
                         epsilon);
  });
}

template <typename T, bool kCentered>
cudaError_t norm_jvp(cudaStream_t stream, const T* x, const T* weight, const float* mean,
                     const float* rstd, const T* dx, const T* dweight, const T* dbias, T* dy,
                     NormShape shape) {
  return launch_rows<T, kJvpElements>(shape, {x, weight, dx, dweight, dbias, dy},
                                   [&](auto pack_width, RowLaunch launch) {
    return launch_kernel(norm_jvp_kernel<T, decltype(pack_width)::value, kCentered>,
                         launch.grid, launch.block, stream, x, weight, mean, rstd, dx, dweight,
                         dbias, dy, shape.rows, static_cast<int>(shape.cols),
                         1.f / static_cast<float>(shape.cols));
  });
}

}  // namespace

template <typename T>
cudaError_t layer_norm_fwd(cudaStream_t stream, const T* x, const T* weight, const T* bias, T* y,
                           float* mean, float* rstd, NormShape shape, float epsilon) {
  return launch_rows<T, kFwdElements>(shape, {x, weight, bias, y},
                                   [&](auto pack_width, RowLaunch launch) {
    return launch_kernel(layer_norm_fwd_kernel<T, decltype(pack_width)::value>, launch.grid,
                         launch.block, stream, x, weight, bias, y, mean, rstd, shape.rows,
                         static_cast<int>(shape.cols), 1.f / static_cast<float>(shape.cols),
                         epsilon);
  });
}

template <typename T>
cudaError_t layer_norm_bwd(cudaStream_t stream, const T* dy, const T* x, const T* weight,
                           const float* mean, const float* rstd, T* dx, T* dweight, T* dbias,
                           float* workspace, NormShape shape, WeightGradLayout layout) {
  return norm_bwd<T, true>(stream, dy, x, weight, mean, rstd, nullptr, dx, dweight, dbias,
                           workspace, shape, layout);
}

template <typename T>
cudaError_t rms_norm_fwd(cudaStream_t stream, const T* x, const T* weight, T* y, float* rstd,
                         NormShape shape, float epsilon) {
  return rms_norm_fwd_launch<T>(stream, x, nullptr, weight, y, nullptr, rstd, shape, epsilon);
}

template <typename T>
cudaError_t rms_norm_bwd(cudaStream_t stream, const T* dy, const T* x, const T* weight,
                         const float* rstd, const T* dresidual, T* dx, T* dweight,
                         float* workspace, NormShape shape, WeightGradLayout layout) {
  return norm_bwd<T, false>(stream, dy, x, weight, nullptr, rstd, dresidual, dx, dweight,
                            nullptr, workspace, shape, layout);
}

template <typename T>
cudaError_t add_rms_norm_fwd(cudaStream_t stream, const T* x, const T* residual, const T* weight,
                             T* y, T* h, float* rstd, NormShape shape, float epsilon) {
  if (shape.rows > 0 && (residual == nullptr || h == nullptr)) return cudaErrorInvalidValue;
  return rms_norm_fwd_launch<T>(stream, x, residual, weight, y, h, rstd, shape, epsilon);
}

template <typename T>
cudaError_t layer_norm_jvp(cudaStream_t stream, const T* x, const T* weight, const float* mean,
                           const float* rstd, const T* dx, const T* dweight, const T* dbias,
                           T* dy, NormShape shape) {
  return norm_jvp<T, true>(stream, x, weight, mean, rstd, dx, dweight, dbias, dy, shape);
}

template <typename T>
cudaError_t rms_norm_jvp(cudaStream_t stream, const T* x, const T* weight, const float* rstd,
                         const T* dx, const T* dweight, T* dy, NormShape shape) {
  return norm_jvp<T, false>(stream, x, weight, nullptr, rstd, dx, dweight, nullptr, dy, shape);
}

#define JAXOPS_CUDA_NORMS_INSTANTIATE(T)                                                        \
  template cudaError_t layer_norm_fwd<T>(cudaStream_t, const T*, const T*, const T*, T*,       \
                                         float*, float*, NormShape, float);                     \
  template cudaError_t layer_norm_bwd<T>(cudaStream_t, const T*, const T*, const T*,           \
                                         const float*, const float*, T*, T*, T*, float*,        \
                                         NormShape, WeightGradLayout);                          \
  template cudaError_t rms_norm_fwd<T>(cudaStream_t, const T*, const T*, T*, float*, NormShape, \
                                       float);                                                  \
  template cudaError_t rms_norm_bwd<T>(cudaStream_t, const T*, const T*, const T*, const float*, \
                                       const T*, T*, T*, float*, NormShape, WeightGradLayout);   \
  template cudaError_t add_rms_norm_fwd<T>(cudaStream_t, const T*, const T*, const T*, T*, T*,  \
                                           float*, NormShape, float);                           \
  template cudaError_t layer_norm_jvp<T>(cudaStream_t, const T*, const T*, const float*,        \
                                         const float*, const T*, const T*, const T*, T*,        \
                                         NormShape);                                            \
  template cudaError_t rms_norm_jvp<T>(cudaStream_t, const T*, const T*, const float*,          \
                                       const T*, const T*, T*, NormShape);

JAXOPS_CUDA_NORMS_INSTANTIATE(float)
JAXOPS_CUDA_NORMS_INSTANTIATE(__half)
JAXOPS_CUDA_NORMS_INSTANTIATE(__nv_bfloat16)

#undef JAXOPS_CUDA_NORMS_INSTANTIATE

}  // namespace jaxops::cuda
