#include "cuda/sampling.h"

#include <algorithm>
#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/row_reduce.cuh"

namespace jaxops::cuda {
namespace {

using namespace row_reduce;
using ::jaxops::params::key_value;
using ::jaxops::params::order_key;
using ::jaxops::params::sample_row_params;
using ::jaxops::params::SampleRow;
using ::jaxops::params::top_p_ties_kept;
using ::jaxops::params::weight_is_indicator;

constexpr int kMaxRowThreads = 256;
// Rows beyond the grid are taken by the same blocks in turn.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr long long kNone = 0x7fffffffffffffffLL;

struct Max {
  float value;
  __device__ __forceinline__ Max shuffled(int offset) const {
    return {__shfl_xor_sync(kFullWarp, value, offset)};
  }
};

struct Count {
  long long value;
  __device__ __forceinline__ Count shuffled(int offset) const {
    return {__shfl_xor_sync(kFullWarp, value, offset)};
  }
};

__device__ __forceinline__ float block_max(float value) {
  __shared__ Max scratch[kMaxWarps];
  return block_reduce(Max{value}, [](Max a, Max b) { return Max{fmaxf(a.value, b.value)}; },
                      scratch).value;
}

__device__ __forceinline__ long long block_count(long long value) {
  __shared__ Count scratch[kMaxWarps];
  return block_reduce(Count{value}, [](Count a, Count b) { return Count{a.value + b.value}; },
                      scratch).value;
}

__device__ __forceinline__ long long block_min(long long value) {
  __shared__ Count scratch[kMaxWarps];
  return block_reduce(Count{value},
                      [](Count a, Count b) { return Count{a.value < b.value ? a.value : b.value}; },
                      scratch).value;
}

__device__ __forceinline__ long long block_max_index(long long value) {
  __shared__ Count scratch[kMaxWarps];
  return block_reduce(Count{value},
                      [](Count a, Count b) { return Count{a.value > b.value ? a.value : b.value}; },
                      scratch).value;
}

// One row as the kernel sees it: z = logits / temperature (recomputed on every
// pass, bit-identical each time), its keys and weights, and the current prefix
// of the keep order: tokens with key > `key`, and those at `key` up to index `last`.
template <typename T>
struct Row {
  const T* logits;
  int64_t vocab;
  SampleRow params;
  float top;
  uint32_t key = 0;
  int64_t last = 0;

  __device__ __forceinline__ float z(int64_t i) const {
    return to_float(logits[i]) / params.temperature;
  }
  __device__ __forceinline__ float weight(float z_value) const {
    if (weight_is_indicator(top)) return z_value == top ? 1.f : 0.f;
    return expf(z_value - top);
  }
  __device__ __forceinline__ bool kept(int64_t i, uint32_t k) const {
    return k > key || (k == key && i <= last);
  }

  // Tokens of the current prefix with key >= at_least: their count, or their weight.
  __device__ __forceinline__ long long count_at_least(uint32_t at_least) const {
    long long count = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const uint32_t k = order_key(z(i));
      count += (kept(i, k) && k >= at_least) ? 1 : 0;
    }
    return block_count(count);
  }
  __device__ __forceinline__ float mass_at_least(uint32_t at_least) const {
    float mass = 0.f;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float zi = z(i);
      const uint32_t k = order_key(zi);
      if (kept(i, k) && k >= at_least) mass += weight(zi);
    }
    return block_sum(mass);
  }
};

// The largest key t such that measure(key >= t) >= goal, bit by bit from the top.
template <typename Measure, typename Value>
__device__ uint32_t largest_key_reaching(Measure measure, Value goal) {
  uint32_t key = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = key | (1u << bit);
    if (measure(candidate) >= goal) key = candidate;
  }
  return key;
}

// The index of the `rank`-th (1-based) token of the current prefix whose key
// is `key`, in index order: each thread counts them in its contiguous chunk,
// thread 0 finds the chunk that holds it, and that chunk's thread finds it.
template <typename T>
__device__ int64_t tied_index(const Row<T>& row, uint32_t key, long long rank) {
  __shared__ long long counts[kMaxRowThreads];
  __shared__ long long owner_rank[2];  // the chunk that holds it, its rank there
  __shared__ long long found;
  const int64_t chunk = (row.vocab + blockDim.x - 1) / blockDim.x;
  const int64_t begin = threadIdx.x * chunk;
  const int64_t end = min(row.vocab, begin + chunk);
  long long count = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t k = order_key(row.z(i));
    count += (k == key && row.kept(i, k)) ? 1 : 0;
  }
  counts[threadIdx.x] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long before = 0;
    unsigned owner = blockDim.x - 1;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      if (before + counts[t] >= rank) {
        owner = t;
        break;
      }
      before += counts[t];
    }
    owner_rank[0] = owner;
    owner_rank[1] = rank - before;
  }
  __syncthreads();
  if (threadIdx.x == owner_rank[0]) {
    long long seen = 0;
    int64_t index = end - 1;
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t k = order_key(row.z(i));
      if (k == key && row.kept(i, k) && ++seen == owner_rank[1]) {
        index = i;
        break;
      }
    }
    found = index;
  }
  __syncthreads();
  const int64_t index = found;
  __syncthreads();  // owner_rank and found are reused by the next call
  return index;
}

// The inverse CDF over the kept tokens (the prefix, and weight >= min_p) in
// index order: chunk sums scanned by thread 0, then each thread walks its
// chunk from its prefix; the first chunk whose running sum passes the target wins.
template <typename T>
__device__ int64_t draw(const Row<T>& row) {
  __shared__ float sums[kMaxRowThreads];
  __shared__ float scanned[kMaxRowThreads + 1];
  const int64_t chunk = (row.vocab + blockDim.x - 1) / blockDim.x;
  const int64_t begin = threadIdx.x * chunk;
  const int64_t end = min(row.vocab, begin + chunk);
  float sum = 0.f;
  long long last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float zi = row.z(i);
    const float w = row.weight(zi);
    if (row.kept(i, order_key(zi)) && w >= row.params.min_p) sum += w, last = i;
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      scanned[t] = total;
      total += sums[t];
    }
    scanned[blockDim.x] = total;
  }
  __syncthreads();
  const float target = row.params.uniform * scanned[blockDim.x];
  float cumulative = scanned[threadIdx.x];
  long long hit = kNone;
  if (cumulative + sum > target || threadIdx.x == blockDim.x - 1) {
    for (int64_t i = begin; i < end; ++i) {
      const float zi = row.z(i);
      const float w = row.weight(zi);
      if (!row.kept(i, order_key(zi)) || w < row.params.min_p) continue;
      cumulative += w;
      if (cumulative > target) {
        hit = i;
        break;
      }
    }
  }
  const long long first = block_min(hit);
  const long long last_kept = block_max_index(last);
  return first != kNone ? first : last_kept;
}

template <typename T>
__global__ void __launch_bounds__(kMaxRowThreads)
    sample_kernel(const T* __restrict__ logits, const float* __restrict__ row_floats,
                  const int32_t* __restrict__ top_k, int32_t* __restrict__ tokens, int64_t batch,
                  int64_t vocab) {
  for (int64_t r = blockIdx.x; r < batch; r += gridDim.x) {
    Row<T> row{logits + r * vocab, vocab,
               sample_row_params(row_floats + r * ::jaxops::params::kRowFloats, top_k[r], vocab),
               0.f};
    float top = -CUDART_INF_F;
    bool has_nan = false;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float zi = row.z(i);
      has_nan = has_nan || zi != zi;
      top = fmaxf(top, zi);
    }
    has_nan = __syncthreads_or(has_nan);
    top = block_max(top);
    if (has_nan || top == -CUDART_INF_F) {
      if (threadIdx.x == 0) tokens[r] = -1;
      continue;
    }
    row.top = top;
    long long first_top = kNone;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      if (row.z(i) == top) {
        first_top = i;
        break;
      }
    }
    const int64_t argmax = block_min(first_top);
    if (row.params.greedy) {
      if (threadIdx.x == 0) tokens[r] = static_cast<int32_t>(argmax);
      continue;
    }
    // The prefix starts as the whole row.
    row.key = 0;
    row.last = vocab - 1;
    if (row.params.top_k < vocab) {
      const uint32_t key = largest_key_reaching(
          [&](uint32_t t) { return row.count_at_least(t); }, static_cast<long long>(row.params.top_k));
      const long long above = key == 0xffffffffu ? 0 : row.count_at_least(key + 1);
      const int64_t last = tied_index(row, key, row.params.top_k - above);
      row.key = key;
      row.last = last;
    }
    if (row.params.top_p < 1.f) {
      const float limit = row.params.top_p * row.mass_at_least(0);
      if (!(limit > 0.f)) {
        row.key = order_key(top);
        row.last = argmax;
      } else {
        const uint32_t key =
            largest_key_reaching([&](uint32_t t) { return row.mass_at_least(t); }, limit);
        const float above = key == 0xffffffffu ? 0.f : row.mass_at_least(key + 1);
        const long long ties = row.count_at_least(key) -
                               (key == 0xffffffffu ? 0 : row.count_at_least(key + 1));
        const long long kept =
            top_p_ties_kept(above, row.weight(key_value(key)), limit, ties);
        const int64_t last = tied_index(row, key, kept);
        row.key = key;
        row.last = last;
      }
    }
    const int64_t token = draw(row);
    if (threadIdx.x == 0) tokens[r] = static_cast<int32_t>(token);
  }
}

}  // namespace

template <typename T>
cudaError_t sample(cudaStream_t stream, const T* logits, const float* row_floats,
                   const int32_t* top_k, int32_t* tokens, SampleShape shape) {
  if (shape.vocab < 1 || shape.batch < 0) return cudaErrorInvalidValue;
  if (shape.batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(std::min(shape.batch, kMaxBlocks)));
  const dim3 block(threads_for_row(shape.vocab, kMaxRowThreads));
  return launch_kernel(sample_kernel<T>, grid, block, stream, logits, row_floats, top_k, tokens,
                       shape.batch, shape.vocab);
}

#define JAXOPS_CUDA_SAMPLING_INSTANTIATE(T)                                                  \
  template cudaError_t sample<T>(cudaStream_t, const T*, const float*, const int32_t*,       \
                                 int32_t*, SampleShape);

JAXOPS_CUDA_SAMPLING_INSTANTIATE(float)
JAXOPS_CUDA_SAMPLING_INSTANTIATE(__half)
JAXOPS_CUDA_SAMPLING_INSTANTIATE(__nv_bfloat16)

#undef JAXOPS_CUDA_SAMPLING_INSTANTIATE

}  // namespace jaxops::cuda
