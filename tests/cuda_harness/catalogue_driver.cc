// Test-only: runs the catalogue CUDA kernels (cuda/activations.cu, cuda/rope.cu,
// cuda/embedding.cu, cuda/adamw.cu, compiled by the harness) through their
// public host-side launchers in cuda/*.h (the entry points of the CUDA FFI
// handlers) in float32, bfloat16 and float16, and checks every result against
// a double-precision reference. Built under AddressSanitizer and
// ThreadSanitizer by tests/test_cuda_harness_catalogue_sanitizers.py, where
// what matters most is that the sanitizers stay silent: each buffer (and each
// workspace) is its own exact-size allocation, so a read or write past any end
// is caught.
//
// usage: catalogue_driver CASE ...     exit status 0 when all agree
//   act=N            gelu tanh/erf and silu, plain and gated, forward and backward,
//                    in place, and on misaligned buffers
//   rope=BxSxHxDxR/P neox and gptj, forward and inverse (P: position rows, 1 or B)
//   emb=VxDxT        lookup (with out-of-range ids) and the gradient
//   adamw=N          one launch over leaves of about N elements: update and fused
//                    step, Nesterov, weight decay per leaf, float32, bfloat16 and
//                    float16 first moments, unaligned and empty leaves, aliased
//   adamw_leaves=L   L leaves of 1-3 float32 elements (several launches)
//   types=LIST       float32,bfloat16,float16 (any of them) for the cases after it
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/activations.h"
#include "cuda/adamw.h"
#include "cuda/embedding.h"
#include "cuda/rope.h"
#include "driver_common.h"

namespace {

namespace cuda = jaxops::cuda;
namespace params = jaxops::params;  // the parameter structs cuda/ shares

// Tolerance of one rounding to T (plus float32 math) relative to 1 + |expected|.
template <typename T>
double tolerance() {
  if (std::is_same<T, float>::value) return 2e-5;
  if (std::is_same<T, __half>::value) return 2e-3;
  return 1.6e-2;
}

template <typename V>
void compare(const std::string& what, const V* actual, const std::vector<double>& expected,
             double tol) {
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<double>(static_cast<float>(actual[i]));
    const double e = expected[i];
    if (!(std::fabs(a - e) <= tol * (1.0 + std::fabs(e)))) {
      std::fprintf(stderr, "FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i, a, e);
      ++g_failures;
      return;
    }
  }
}

template <typename T>
void fill(Buffer<T>& b, std::vector<double>& rounded, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.f, scale);
  rounded.resize(b.size);
  for (size_t i = 0; i < b.size; ++i) {
    b.data[i] = T(normal(rng));
    rounded[i] = static_cast<float>(b.data[i]);
  }
}

// ---------------------------------------------------------------- activations

// Value and derivative in double.
void activation_ref(params::Activation act, double x, double* value, double* derivative) {
  const double kInvSqrt2Pi = 0.3989422804014327;
  switch (act) {
    case params::Activation::kGeluTanh: {
      const double k = std::sqrt(2.0 / M_PI);
      const double inner = k * (x + 0.044715 * x * x * x);
      const double t = std::tanh(inner);
      *value = 0.5 * x * (1.0 + t);
      *derivative = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x);
      return;
    }
    case params::Activation::kGeluErf: {
      const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
      *value = x * cdf;
      *derivative = cdf + x * std::exp(-0.5 * x * x) * kInvSqrt2Pi;
      return;
    }
    case params::Activation::kSilu: {
      const double s = 1.0 / (1.0 + std::exp(-x));
      *value = x * s;
      *derivative = s * (1.0 + x * (1.0 - s));
      return;
    }
  }
}

const char* activation_name(params::Activation act) {
  switch (act) {
    case params::Activation::kGeluTanh:
      return "gelu_tanh";
    case params::Activation::kGeluErf:
      return "gelu_erf";
    case params::Activation::kSilu:
      return "silu";
  }
  return "?";
}

template <typename T>
void run_activations(int64_t n, std::mt19937& rng) {
  const size_t size = static_cast<size_t>(n);
  const double tol = tolerance<T>();
  for (params::Activation act :
       {params::Activation::kGeluTanh, params::Activation::kGeluErf, params::Activation::kSilu}) {
    const std::string name = std::string(activation_name(act)) + " " + type_name<T>() + " n=" +
                             std::to_string(n);
    Buffer<T> x(size), up(size), dy(size), y(size), dx(size), gy(size), dgate(size), dup(size),
        in_place(size);
    std::vector<double> xr, upr, dyr;
    fill(x, xr, rng, 3.f);
    fill(up, upr, rng, 1.f);
    fill(dy, dyr, rng, 1.f);
    std::vector<double> y_ref(size), dx_ref(size), gy_ref(size), dgate_ref(size), dup_ref(size);
    for (size_t i = 0; i < size; ++i) {
      double value, derivative;
      activation_ref(act, xr[i], &value, &derivative);
      y_ref[i] = value;
      dx_ref[i] = dyr[i] * derivative;
      gy_ref[i] = value * upr[i];
      dgate_ref[i] = dyr[i] * upr[i] * derivative;
      dup_ref[i] = dyr[i] * value;
    }
    check(cuda::activation_fwd<T>(nullptr, act, x.data, y.data, n), "fwd " + name);
    compare("fwd " + name, y.data, y_ref, tol);
    check(cuda::activation_bwd<T>(nullptr, act, dy.data, x.data, dx.data, n), "bwd " + name);
    compare("bwd " + name, dx.data, dx_ref, tol);
    check(cuda::gated_activation_fwd<T>(nullptr, act, x.data, up.data, gy.data, n),
          "gated fwd " + name);
    compare("gated fwd " + name, gy.data, gy_ref, tol);
    check(cuda::gated_activation_bwd<T>(nullptr, act, dy.data, x.data, up.data, dgate.data,
                                        dup.data, n),
          "gated bwd " + name);
    compare("gated bwd dgate " + name, dgate.data, dgate_ref, tol);
    compare("gated bwd dup " + name, dup.data, dup_ref, tol);
    // Outputs may alias their inputs: y over x.
    for (size_t i = 0; i < size; ++i) in_place.data[i] = x.data[i];
    check(cuda::activation_fwd<T>(nullptr, act, in_place.data, in_place.data, n),
          "in-place fwd " + name);
    compare("in-place fwd " + name, in_place.data, y_ref, tol);
    if (n < 2) continue;
    // Buffers that are not 16-byte aligned take the element-by-element path:
    // the gated backward from the second element on (dgate and dup written
    // over the first n - 1 elements of y and dx).
    check(cuda::gated_activation_bwd<T>(nullptr, act, dy.data + 1, x.data + 1, up.data + 1,
                                        y.data, dx.data, n - 1),
          "misaligned gated bwd " + name);
    const std::vector<double> dgate_tail(dgate_ref.begin() + 1, dgate_ref.end());
    const std::vector<double> dup_tail(dup_ref.begin() + 1, dup_ref.end());
    compare("misaligned gated bwd dgate " + name, y.data, dgate_tail, tol);
    compare("misaligned gated bwd dup " + name, dx.data, dup_tail, tol);
  }
}

// ----------------------------------------------------------------------- rope

template <typename T>
void run_rope(const params::RopeShape& s, std::mt19937& rng) {
  const size_t total = static_cast<size_t>(s.batch * s.seq * s.heads * s.head_dim);
  const size_t rows = static_cast<size_t>(s.position_rows * s.seq);
  const int64_t half = s.rotary_dim / 2;
  const double theta = 10000.0;
  Buffer<T> x(total), y(total);
  Buffer<int32_t> positions(rows);
  Buffer<float> workspace(rows * static_cast<size_t>(s.rotary_dim));
  std::vector<double> xr;
  fill(x, xr, rng, 1.f);
  std::uniform_int_distribution<int32_t> position(0, 5000);
  for (size_t r = 0; r < rows; ++r) positions.data[r] = r == 0 ? 0 : position(rng);
  for (bool interleaved : {false, true}) {
    for (bool inverse : {false, true}) {
      const std::string name = std::string(interleaved ? "gptj" : "neox") +
                               (inverse ? " inverse " : " ") + type_name<T>() + " " +
                               std::to_string(s.batch) + "x" + std::to_string(s.seq) + "x" +
                               std::to_string(s.heads) + "x" + std::to_string(s.head_dim) +
                               " rotary " + std::to_string(s.rotary_dim) + " rows " +
                               std::to_string(s.position_rows);
      std::vector<double> ref(total);
      for (int64_t b = 0; b < s.batch; ++b) {
        for (int64_t q = 0; q < s.seq; ++q) {
          const int64_t row = (s.position_rows == 1 ? 0 : b) * s.seq + q;
          for (int64_t h = 0; h < s.heads; ++h) {
            const size_t base = static_cast<size_t>(((b * s.seq + q) * s.heads + h) * s.head_dim);
            for (int64_t j = s.rotary_dim; j < s.head_dim; ++j) ref[base + j] = xr[base + j];
            for (int64_t i = 0; i < half; ++i) {
              // The angle as the kernel forms it, in float32; its sin/cos in double.
              const float frequency = static_cast<float>(
                  std::pow(theta, -(2.0 * i) / static_cast<double>(s.rotary_dim)));
              const float angle = static_cast<float>(positions.data[row]) * frequency;
              const double c = std::cos(static_cast<double>(angle));
              const double sn = (inverse ? -1.0 : 1.0) * std::sin(static_cast<double>(angle));
              const size_t a = base + (interleaved ? 2 * i : i);
              const size_t p = base + (interleaved ? 2 * i + 1 : i + half);
              ref[a] = xr[a] * c - xr[p] * sn;
              ref[p] = xr[p] * c + xr[a] * sn;
            }
          }
        }
      }
      check(cuda::rope<T>(nullptr, x.data, positions.data, y.data, workspace.data, s, theta,
                          interleaved, inverse),
            "rope " + name);
      compare("rope " + name, y.data, ref, tolerance<T>());
    }
  }
}

// ------------------------------------------------------------------ embedding

template <typename T>
void run_embedding(const params::EmbeddingShape& s, std::mt19937& rng) {
  const std::string name = std::string(type_name<T>()) + " vocab " + std::to_string(s.vocab) +
                           " dim " + std::to_string(s.dim) + " tokens " +
                           std::to_string(s.tokens);
  const size_t table_size = static_cast<size_t>(s.vocab * s.dim);
  const size_t out_size = static_cast<size_t>(s.tokens * s.dim);
  Buffer<T> table(table_size), out(out_size), dout(out_size), dtable(table_size);
  Buffer<int32_t> ids(static_cast<size_t>(s.tokens));
  Buffer<int32_t> workspace(static_cast<size_t>(params::embedding_bwd_cuda_workspace_ints(s)));
  std::vector<double> tr, dr;
  fill(table, tr, rng, 1.f);
  fill(dout, dr, rng, 1.f);
  // Mostly a few hot rows (repeats within a warp), some out of range either side.
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(s.vocab - 1));
  std::uniform_int_distribution<int32_t> hot(
      0, static_cast<int32_t>(std::min<int64_t>(s.vocab, 3) - 1));
  for (int64_t t = 0; t < s.tokens; ++t) {
    ids.data[t] = t % 11 == 4   ? -1 - static_cast<int32_t>(t)
                  : t % 13 == 7 ? static_cast<int32_t>(s.vocab + t)
                  : t % 2 == 0  ? hot(rng)
                                : any(rng);
  }
  auto clamp = [&](int32_t id) -> int64_t {
    return id < 0 ? 0 : (id >= s.vocab ? s.vocab - 1 : id);
  };
  std::vector<double> out_ref(out_size), dtable_ref(table_size, 0.0);
  for (int64_t t = 0; t < s.tokens; ++t) {
    const int64_t v = clamp(ids.data[t]);
    for (int64_t c = 0; c < s.dim; ++c) {
      out_ref[t * s.dim + c] = tr[v * s.dim + c];
      dtable_ref[v * s.dim + c] += dr[t * s.dim + c];
    }
  }
  check(cuda::embedding_fwd<T>(nullptr, table.data, ids.data, out.data, s),
        "embedding_fwd " + name);
  compare("embedding_fwd " + name, out.data, out_ref, 0.0);
  // Garbage in the workspace and dtable: the launcher must not rely on zeros.
  for (size_t i = 0; i < workspace.size; ++i) workspace.data[i] = 0x5a5a5a5a;
  for (size_t i = 0; i < dtable.size; ++i) dtable.data[i] = T(1e4f);
  check(cuda::embedding_bwd<T>(nullptr, dout.data, ids.data, dtable.data, workspace.data, s),
        "embedding_bwd " + name);
  // float32 sums of up to `tokens` terms, rounded to T once.
  const double sum_tol = tolerance<T>() + 1e-6 * static_cast<double>(s.tokens);
  compare("embedding_bwd " + name, dtable.data, dtable_ref, sum_tol);
}

// ---------------------------------------------------------------------- adamw

// cuda::adamw over a table of leaves in one launch, each leaf against double
// precision: parameters T with float32, bfloat16 and float16 first moments,
// with and without weight decay, in 16-byte packs and (a leaf whose buffers
// are not 16-byte aligned) element by element, and an empty leaf; for every
// call option (update or fused step, Nesterov), with fresh outputs and with
// every output aliased to its input (out over params, m_out over m, v_out
// over v).
constexpr double kB1 = 0.9, kB2 = 0.999, kEps = 1e-8, kEpsRoot = 1e-10, kWeightDecay = 0.1,
                 kLearningRate = 1e-2;
constexpr int kStep = 3;

template <typename U>
params::AdamWFloat adamw_float() {
  if (std::is_same<U, float>::value) return params::AdamWFloat::kFloat32;
  if (std::is_same<U, __half>::value) return params::AdamWFloat::kFloat16;
  return params::AdamWFloat::kBFloat16;
}

// b1 as it multiplies a stored first moment of type M (rounded to M, as optax's is).
template <typename M>
double b1_for_moment() {
  return static_cast<float>(M(static_cast<float>(kB1)));
}

// The scalars operand (params/adamw.h) of step kStep.
void fill_adamw_scalars(Buffer<float>& scalars) {
  const double values[] = {-kLearningRate, kB1, 1.0 - kB1, kB2, 1.0 - kB2, kEps, kEpsRoot,
                           kWeightDecay, 1.0 - std::pow(kB1, kStep), 1.0 - std::pow(kB2, kStep),
                           1.0 - std::pow(kB1, kStep + 1), b1_for_moment<float>(),
                           b1_for_moment<__nv_bfloat16>(), b1_for_moment<__half>()};
  static_assert(sizeof(values) / sizeof(values[0]) == params::kAdamWScalarCount,
                "one value per scalar");
  for (int k = 0; k < params::kAdamWScalarCount; ++k) scalars.data[k] = static_cast<float>(values[k]);
}

class AdamWLeafData {
 public:
  virtual ~AdamWLeafData() = default;
  // The leaf's table entry; aliased: its outputs are its inputs (reset first).
  virtual params::AdamWLeaf leaf(bool aliased) = 0;
  virtual void compare_results(const std::string& name, params::AdamWOptions o, bool aliased) = 0;
};

template <typename T, typename M>
class TypedAdamWLeaf : public AdamWLeafData {
 public:
  // `offset` elements before the leaf's data in every buffer (1: not 16-byte aligned).
  TypedAdamWLeaf(int64_t n, int64_t offset, bool decay, std::mt19937& rng)
      : n_(static_cast<size_t>(n)), offset_(static_cast<size_t>(offset)), decay_(decay),
        grads_(n_ + offset_), params_(n_ + offset_), out_(n_ + offset_), m_(n_ + offset_),
        m_out_(n_ + offset_), v_(n_ + offset_), v_out_(n_ + offset_) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t i = 0; i < n_; ++i) {
      grads_.data[offset_ + i] = T(normal(rng));
      params_.data[offset_ + i] = T(normal(rng));
      m_.data[offset_ + i] = M(0.1f * normal(rng));
      v_.data[offset_ + i] = std::fabs(0.1f * normal(rng)) * 0.01f;
    }
  }

  params::AdamWLeaf leaf(bool aliased) override {
    const size_t o = offset_;
    if (aliased) {
      for (size_t i = 0; i < n_; ++i) {
        out_.data[o + i] = params_.data[o + i];
        m_out_.data[o + i] = m_.data[o + i];
        v_out_.data[o + i] = v_.data[o + i];
      }
    }
    return params::AdamWLeaf{grads_.data + o,
                             (aliased ? out_.data : params_.data) + o,
                             (aliased ? m_out_.data : m_.data) + o,
                             (aliased ? v_out_.data : v_.data) + o,
                             out_.data + o, m_out_.data + o, v_out_.data + o,
                             static_cast<int64_t>(n_), adamw_float<T>(), adamw_float<M>(), decay_};
  }

  void compare_results(const std::string& name, params::AdamWOptions o, bool aliased) override {
    const double b1_moment = b1_for_moment<M>();
    const double c1 = 1.0 - std::pow(kB1, kStep), c2 = 1.0 - std::pow(kB2, kStep),
                 c1_next = 1.0 - std::pow(kB1, kStep + 1);
    std::vector<double> out_ref(n_), m_ref(n_), v_ref(n_);
    for (size_t i = 0; i < n_; ++i) {
      const double g = static_cast<float>(grads_.data[offset_ + i]);
      const double p = static_cast<float>(params_.data[offset_ + i]);
      const double mi = (1.0 - kB1) * g + b1_moment * static_cast<float>(m_.data[offset_ + i]);
      const double vi = (1.0 - kB2) * g * g + kB2 * v_.data[offset_ + i];
      const double m_hat = o.nesterov ? kB1 * mi / c1_next + (1.0 - kB1) * g / c1 : mi / c1;
      double u = m_hat / (std::sqrt(vi / c2 + kEpsRoot) + kEps);
      if (decay_) u += kWeightDecay * p;
      u *= -kLearningRate;
      out_ref[i] = o.apply_updates ? p + u : u;
      m_ref[i] = mi;
      v_ref[i] = vi;
    }
    const std::string what = std::string(aliased ? "aliased " : "") + name + " " +
                             type_name<T>() + "/m " + type_name<M>() + " n=" +
                             std::to_string(n_) + (offset_ ? " unaligned" : "") +
                             (decay_ ? " decay" : "");
    // A bfloat16 or float16 moment is rounded once where it is stored.
    const double m_tol = std::is_same<M, float>::value ? 2e-6 : tolerance<M>();
    compare("adamw out " + what, out_.data + offset_, out_ref, tolerance<T>());
    compare("adamw m " + what, m_out_.data + offset_, m_ref, m_tol);
    compare("adamw v " + what, v_out_.data + offset_, v_ref, 2e-6);
  }

 private:
  size_t n_, offset_;
  bool decay_;
  Buffer<T> grads_, params_, out_;
  Buffer<M> m_, m_out_;
  Buffer<float> v_, v_out_;
};

template <typename T>
void run_adamw(int64_t n, std::mt19937& rng) {
  std::vector<std::unique_ptr<AdamWLeafData>> data;
  data.emplace_back(new TypedAdamWLeaf<T, float>(n, 0, true, rng));
  data.emplace_back(new TypedAdamWLeaf<T, __nv_bfloat16>(n, 0, false, rng));
  data.emplace_back(new TypedAdamWLeaf<T, __half>(n, 0, true, rng));
  data.emplace_back(new TypedAdamWLeaf<T, float>(0, 0, true, rng));
  data.emplace_back(new TypedAdamWLeaf<T, float>(n, 1, false, rng));
  data.emplace_back(new TypedAdamWLeaf<T, __nv_bfloat16>(n + 3, 0, true, rng));
  Buffer<float> scalars(params::kAdamWScalarCount);
  fill_adamw_scalars(scalars);
  for (int options = 0; options < 4; ++options) {
    const params::AdamWOptions o{(options & 1) != 0, (options & 2) != 0};
    const std::string name = std::string(o.apply_updates ? "step" : "update") +
                             (o.nesterov ? " nesterov" : "");
    for (bool aliased : {false, true}) {
      std::vector<params::AdamWLeaf> leaves;
      for (auto& d : data) leaves.push_back(d->leaf(aliased));
      check(cuda::adamw(nullptr, leaves.data(), static_cast<int64_t>(leaves.size()),
                        scalars.data, o),
            "adamw " + name);
      for (auto& d : data) d->compare_results(name, o, aliased);
    }
  }
}

// More leaves than one launch's table holds (kAdamWLeavesPerLaunch): several
// launches, every leaf updated once.
void run_adamw_many_leaves(int64_t leaves_count, std::mt19937& rng) {
  std::vector<std::unique_ptr<AdamWLeafData>> data;
  for (int64_t i = 0; i < leaves_count; ++i) {
    data.emplace_back(new TypedAdamWLeaf<float, float>(1 + i % 3, 0, i % 2 == 0, rng));
  }
  Buffer<float> scalars(params::kAdamWScalarCount);
  fill_adamw_scalars(scalars);
  const params::AdamWOptions o{true, false};
  std::vector<params::AdamWLeaf> leaves;
  for (auto& d : data) leaves.push_back(d->leaf(true));
  check(cuda::adamw(nullptr, leaves.data(), static_cast<int64_t>(leaves.size()), scalars.data, o),
        "adamw many leaves");
  for (auto& d : data) d->compare_results("many leaves", o, true);
}

// The dtypes the following cases run in (types=LIST; all three by default).
bool g_float32 = true, g_bfloat16 = true, g_float16 = true;

template <template <typename> class Run, typename Shape>
void all_types(const Shape& shape, std::mt19937& rng) {
  if (g_float32) Run<float>{}(shape, rng);
  if (g_bfloat16) Run<__nv_bfloat16>{}(shape, rng);
  if (g_float16) Run<__half>{}(shape, rng);
}

template <typename T>
struct Activations {
  void operator()(int64_t n, std::mt19937& rng) { run_activations<T>(n, rng); }
};
template <typename T>
struct Rope {
  void operator()(const params::RopeShape& s, std::mt19937& rng) { run_rope<T>(s, rng); }
};
template <typename T>
struct Embedding {
  void operator()(const params::EmbeddingShape& s, std::mt19937& rng) { run_embedding<T>(s, rng); }
};
template <typename T>
struct AdamW {
  void operator()(int64_t n, std::mt19937& rng) { run_adamw<T>(n, rng); }
};

bool run_case(const char* text, std::mt19937& rng) {
  long long a = 0, b = 0, c = 0, d = 0, e = 0, f = 0;
  const std::string arg = text;
  if (arg.rfind("types=", 0) == 0) {
    const std::string list = "," + arg.substr(6) + ",";
    g_float32 = list.find(",float32,") != std::string::npos;
    g_bfloat16 = list.find(",bfloat16,") != std::string::npos;
    g_float16 = list.find(",float16,") != std::string::npos;
    return g_float32 || g_bfloat16 || g_float16;
  }
  if (std::sscanf(text, "act=%lld", &a) == 1 && a >= 1) {
    all_types<Activations>(static_cast<int64_t>(a), rng);
  } else if (std::sscanf(text, "adamw=%lld", &a) == 1 && a >= 1) {
    all_types<AdamW>(static_cast<int64_t>(a), rng);
  } else if (std::sscanf(text, "adamw_leaves=%lld", &a) == 1 && a >= 1) {
    run_adamw_many_leaves(static_cast<int64_t>(a), rng);
  } else if (std::sscanf(text, "rope=%lldx%lldx%lldx%lldx%lld/%lld", &a, &b, &c, &d, &e, &f) == 6 &&
             a >= 1 && b >= 1 && c >= 1 && e >= 2 && e % 2 == 0 && e <= d &&
             (f == 1 || f == a)) {
    all_types<Rope>(params::RopeShape{a, b, c, d, e, f}, rng);
  } else if (std::sscanf(text, "emb=%lldx%lldx%lld", &a, &b, &c) == 3 && a >= 1 && b >= 1 &&
             c >= 0) {
    all_types<Embedding>(params::EmbeddingShape{a, b, c}, rng);
  } else {
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  for (int i = 1; i < argc; ++i) {
    if (!run_case(argv[i], rng)) {
      std::fprintf(stderr,
                   "bad case %s (act=N, adamw=N, adamw_leaves=L, rope=BxSxHxDxR/P, emb=VxDxT, "
                   "types=LIST)\n",
                   argv[i]);
      return 2;
    }
  }
  std::printf("%s: %d failure(s)\n", argv[0], g_failures);
  return g_failures == 0 ? 0 : 1;
}
