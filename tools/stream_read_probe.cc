// The nanobind module _jaxops_stream_probe: the machine's streaming read
// bandwidth as a C++ loop sees it, for `python -m jaxops.bench decode`.
//
// Why a C++ probe next to the jnp one: a decode step is bound by reading the
// KV cache, so its speed is judged as a share of what the machine can stream.
// XLA's reductions may run on one thread or several and with narrower vectors
// than the kernels use; a share computed against them can flatter the kernels.
// This loop reads a buffer far larger than the last-level cache with every
// OpenMP thread (each thread its own contiguous slice, first touched by that
// thread), with several independent accumulators, so nothing but memory bounds
// it. It is a measuring tool only: no op calls it, so it is a module of its own
// rather than an FFI target, and it is built with the kernels' OpenMP.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace nb = nanobind;

namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// The sum of n words, with eight accumulators (the compiler vectorises each
// lane group; integer adds keep the dependency chains one cycle long).
uint64_t sum_words(const uint64_t* data, int64_t n) {
  uint64_t acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
#pragma omp simd
    for (int c = 0; c < 8; ++c) acc[c] += data[i + c];
  }
  for (; i < n; ++i) acc[0] += data[i];
  uint64_t total = 0;
  for (uint64_t a : acc) total += a;
  return total;
}

// GB/s of each of `runs` passes reading `bytes` bytes with `threads` threads
// (0: OpenMP's default, as the kernels use).
std::vector<double> stream_read_gbs(int64_t bytes, int runs, int threads) {
  if (bytes < (int64_t{1} << 20)) throw nb::value_error("bytes: expected at least 1 MiB");
  if (runs < 1) throw nb::value_error("runs: expected at least 1");
  if (threads < 0) throw nb::value_error("threads: expected >= 0 (0: OpenMP's default)");
  const int n_threads = threads > 0 ? threads : omp_get_max_threads();
  const int64_t words = bytes / 8;
  std::unique_ptr<uint64_t, FreeDeleter> buffer(
      static_cast<uint64_t*>(std::aligned_alloc(64, static_cast<size_t>(words) * 8)));
  if (!buffer) throw std::bad_alloc();
  uint64_t* const data = buffer.get();
  std::vector<double> gbs;
  volatile uint64_t sink = 0;  // keeps the sums alive
  {
    nb::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t i = 0; i < words; ++i) data[i] = static_cast<uint64_t>(i);
    for (int run = 0; run < runs + 1; ++run) {  // run 0 warms the threads up
      uint64_t total = 0;
      const double start = omp_get_wtime();
#pragma omp parallel num_threads(n_threads) reduction(+ : total)
      {
        // Each thread reads a contiguous slice (the first touch above gave
        // the threads about the same slices).
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t begin = words * t / nt, end = words * (t + 1) / nt;
        total += sum_words(data + begin, end - begin);
      }
      const double seconds = omp_get_wtime() - start;
      sink = sink + total;
      if (run > 0) gbs.push_back(static_cast<double>(words) * 8 / seconds / 1e9);
    }
  }
  return gbs;
}

}  // namespace

NB_MODULE(_jaxops_stream_probe, m) {
  m.def("stream_read_gbs", &stream_read_gbs, nb::arg("bytes"), nb::arg("runs"),
        nb::arg("threads") = 0,
        "GB/s of each of `runs` passes summing a fresh `bytes`-byte buffer with `threads` "
        "OpenMP threads (0: OpenMP's default), after one warm-up pass.");
}
