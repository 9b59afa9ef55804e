#include "cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/vector_math.h"

namespace jaxops::cpu {
namespace {

namespace params = ::jaxops::params;

using ::jaxops::params::order_key;
using ::jaxops::params::sample_row_params;
using ::jaxops::params::SampleRow;
using ::jaxops::params::top_p_ties_kept;
using ::jaxops::params::weight_is_indicator;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A top-k this much smaller than the vocabulary streams through one pass
// (stream_top_k); a larger one searches its boundary key bit by bit.
constexpr int64_t kStreamingTopKRatio = 16;

// The tokens still in the running, in index order: their scaled logits z,
// their weights (once computed) and their indices in the row. Compaction keeps
// the order, so "the first r tied tokens" stays "the r lowest indices".
struct Candidates {
  std::vector<float> z, weight;
  std::vector<int32_t> index;
  std::vector<uint32_t> keys;  // scratch of select_top_k
  int64_t n = 0;

  explicit Candidates(int64_t vocab) : z(vocab), weight(vocab), index(vocab) {}

  // Keeps the candidates whose key is above `key`, and those at `key` up to
  // row index `last_tied`.
  void keep_prefix(uint32_t key, int64_t last_tied) {
    int64_t out = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t k = order_key(z[i]);
      if (k > key || (k == key && index[i] <= last_tied)) {
        z[out] = z[i];
        weight[out] = weight[i];
        index[out] = index[i];
        ++out;
      }
    }
    n = out;
  }
};

int64_t count_at_least(const Candidates& c, uint32_t key) {
  int64_t count = 0;
  const float* z = c.z.data();
#pragma omp simd reduction(+ : count)
  for (int64_t i = 0; i < c.n; ++i) count += order_key(z[i]) >= key ? 1 : 0;
  return count;
}

float mass_at_least(const Candidates& c, uint32_t key) {
  float mass = 0.f;
  const float* z = c.z.data();
  const float* w = c.weight.data();
#pragma omp simd reduction(+ : mass)
  for (int64_t i = 0; i < c.n; ++i) mass += order_key(z[i]) >= key ? w[i] : 0.f;
  return mass;
}

// The largest key t such that measure(candidates with key >= t) >= goal, built
// bit by bit from the top; measure is non-increasing in t (counts, and sums of
// non-negative weights whose lanes do not depend on t). Once the candidates at
// or above the partial key are at most a quarter of the list, the rest (which
// can no longer be kept) are dropped, so later passes are short.
template <typename Measure, typename Value>
uint32_t largest_key_reaching(Candidates& c, Measure measure, Value goal) {
  uint32_t key = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = key | (1u << bit);
    if (measure(c, candidate) >= goal) {
      key = candidate;
      if (count_at_least(c, key) * 4 <= c.n) {
        c.keep_prefix(key, std::numeric_limits<int64_t>::max());
      }
    }
  }
  return key;
}

// The row index of the `rank`-th (1-based) candidate whose key is `key`.
int64_t tied_index(const Candidates& c, uint32_t key, int64_t rank) {
  int64_t seen = 0;
  for (int64_t i = 0; i < c.n; ++i) {
    if (order_key(c.z[i]) == key && ++seen == rank) return c.index[i];
  }
  return c.n ? c.index[c.n - 1] : 0;
}

int64_t count_above(const Candidates& c, uint32_t key) {
  return key == 0xffffffffu ? 0 : count_at_least(c, key + 1);
}

float mass_above(const Candidates& c, uint32_t key) {
  return key == 0xffffffffu ? 0.f : mass_at_least(c, key + 1);
}

// Keeps exactly the k (< n) candidates of the top-k order: the k-th largest key
// (nth_element on a copy), then every candidate above it and the lowest-index
// ones tied at it. Returns the k-th key.
uint32_t select_top_k(Candidates& c, int64_t k) {
  c.keys.resize(c.n);
  for (int64_t i = 0; i < c.n; ++i) c.keys[i] = order_key(c.z[i]);
  std::nth_element(c.keys.begin(), c.keys.begin() + (k - 1), c.keys.end(),
                   std::greater<uint32_t>());
  const uint32_t kth = c.keys[k - 1];
  int64_t above = 0;
  for (int64_t i = 0; i < c.n; ++i) above += order_key(c.z[i]) > kth ? 1 : 0;
  int64_t tied_left = k - above, out = 0;
  for (int64_t i = 0; i < c.n; ++i) {
    const uint32_t key = order_key(c.z[i]);
    if (key > kth || (key == kth && tied_left-- > 0)) {
      c.z[out] = c.z[i];
      c.index[out] = c.index[i];
      ++out;
    }
  }
  c.n = out;
  return kth;
}

// Top-k for a small k in one pass over the row: a token joins the candidates
// only above the k-th key of the candidates so far (a later token tied with it
// has a higher index and loses the tie); when the list fills up it is cut back
// to k. The list is written over c.z in place (it never overtakes the scan).
// Once the floor has risen, most blocks of the row hold no token above it: a
// vectorised maximum of the block skips them without the per-token branch.
void stream_top_k(Candidates& c, int64_t vocab, int64_t k) {
  constexpr int64_t kBlock = 256;
  const int64_t capacity = std::max<int64_t>(4 * k, 1024);
  float* z = c.z.data();
  int32_t* index = c.index.data();
  uint64_t floor = 0;  // keys below it cannot be kept; 2^32: none can join
  c.n = 0;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t end = std::min(vocab, start + kBlock);
    float block_top = kNegInf;
#pragma omp simd reduction(max : block_top)
    for (int64_t i = start; i < end; ++i) block_top = block_top > z[i] ? block_top : z[i];
    if (order_key(block_top) < floor) continue;
    for (int64_t i = start; i < end; ++i) {
      const float zi = z[i];
      if (order_key(zi) < floor) continue;
      z[c.n] = zi;
      index[c.n] = static_cast<int32_t>(i);
      if (++c.n == capacity) floor = uint64_t{select_top_k(c, k)} + 1;
    }
  }
  if (c.n > k) select_top_k(c, k);
}

int32_t sample_row(const float* x, int64_t vocab, const SampleRow& p, Candidates& c) {
  float* z = c.z.data();
  bool has_nan = false;
  float top = kNegInf;
#pragma omp simd reduction(|| : has_nan) reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) {
    z[i] = x[i] / p.temperature;
    has_nan = has_nan || std::isnan(z[i]);
    top = top > z[i] ? top : z[i];
  }
  if (has_nan || top == kNegInf) return -1;
  int64_t argmax = 0;
  while (z[argmax] != top) ++argmax;
  if (p.greedy) return static_cast<int32_t>(argmax);

  // Top-k: the k-th key, then the lowest-index tokens tied at it.
  if (p.top_k * kStreamingTopKRatio <= vocab) {
    stream_top_k(c, vocab, p.top_k);
  } else {
    for (int64_t i = 0; i < vocab; ++i) c.index[i] = static_cast<int32_t>(i);
    c.n = vocab;
  }
  if (p.top_k < vocab && c.n > p.top_k) {
    const auto count = [](const Candidates& cs, uint32_t key) { return count_at_least(cs, key); };
    const uint32_t key = largest_key_reaching(c, count, p.top_k);
    const int64_t tied = p.top_k - count_above(c, key);
    c.keep_prefix(key, tied_index(c, key, tied));
  }

  float* w = c.weight.data();
  if (weight_is_indicator(top)) {
    for (int64_t i = 0; i < c.n; ++i) w[i] = z[i] == top ? 1.f : 0.f;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < c.n; ++i) w[i] = vexp_nonpositive(z[i] - top);
  }

  // Top-p over the top-k: the shortest prefix whose weight reaches top_p times theirs.
  if (p.top_p < 1.f) {
    const float limit = p.top_p * mass_at_least(c, 0);
    if (!(limit > 0.f)) {
      c.keep_prefix(order_key(top), argmax);
    } else {
      const auto mass = [](const Candidates& cs, uint32_t key) { return mass_at_least(cs, key); };
      const uint32_t key = largest_key_reaching(c, mass, limit);
      int64_t ties = 0;
      float tie_weight = 0.f;
      for (int64_t i = 0; i < c.n; ++i) {
        if (order_key(z[i]) == key) ++ties, tie_weight = w[i];
      }
      const int64_t kept = top_p_ties_kept(mass_above(c, key), tie_weight, limit, ties);
      c.keep_prefix(key, tied_index(c, key, kept));
    }
  }

  // Min-p, then the inverse CDF in index order.
  float total = 0.f;
  int64_t last = -1;
  for (int64_t i = 0; i < c.n; ++i) {
    if (w[i] >= p.min_p) total += w[i], last = c.index[i];
  }
  const float target = p.uniform * total;
  float cumulative = 0.f;
  for (int64_t i = 0; i < c.n; ++i) {
    if (w[i] < p.min_p) continue;
    cumulative += w[i];
    if (cumulative > target) return c.index[i];
  }
  return static_cast<int32_t>(last);
}

}  // namespace

template <typename T>
void sample(const T* logits, const float* row_floats, const int32_t* top_k, int32_t* tokens,
            SampleShape shape) {
  const int64_t vocab = shape.vocab;
#pragma omp parallel if (shape.batch > 1)
  {
    Candidates candidates(vocab);
    std::vector<float> row(vocab);
#pragma omp for schedule(dynamic)
    for (int64_t r = 0; r < shape.batch; ++r) {
      load_row(logits + r * vocab, row.data(), vocab);
      const SampleRow p =
          sample_row_params(row_floats + r * params::kRowFloats, top_k[r], vocab);
      tokens[r] = sample_row(row.data(), vocab, p, candidates);
    }
  }
}

template void sample<float>(const float*, const float*, const int32_t*, int32_t*, SampleShape);
template void sample<bfloat16>(const bfloat16*, const float*, const int32_t*, int32_t*,
                               SampleShape);
template void sample<float16>(const float16*, const float*, const int32_t*, int32_t*,
                              SampleShape);

}  // namespace jaxops::cpu
