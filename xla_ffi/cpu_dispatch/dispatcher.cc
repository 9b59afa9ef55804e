// See dispatcher.h. Compiled with the baseline flags of the platform: nothing
// here may use an instruction the CPU has not been checked for.
#include "xla_ffi/cpu_dispatch/dispatcher.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla_ffi/cpu_dispatch/library_abi.h"

namespace jaxops::cpu_dispatch {
namespace {

#if defined(__APPLE__)
constexpr char kLibrarySuffix[] = ".dylib";
#else
constexpr char kLibrarySuffix[] = ".so";
#endif

#if defined(__x86_64__) || defined(_M_X64)
// What the variant's -march level lets the compiler emit. __builtin_cpu_supports
// also checks that the OS saves the wider registers (XGETBV), which CPUID alone
// does not tell.
bool cpu_runs(const std::string& isa) {
  __builtin_cpu_init();
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  if (isa == "avx512") return __builtin_cpu_supports("x86-64-v4");
  if (isa == "avx2") return __builtin_cpu_supports("x86-64-v3");
  if (isa == "generic") return __builtin_cpu_supports("x86-64-v2");
#else
  // Compilers without the level names: the features each level adds that the
  // kernels' code generation uses (every CPU with AVX2 and FMA has F16C, BMI
  // and MOVBE, which not every compiler can query).
  const bool v2 = __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("sse4.2") &&
                  __builtin_cpu_supports("ssse3");
  const bool v3 = v2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
  if (isa == "avx512") return v4;
  if (isa == "avx2") return v3;
  if (isa == "generic") return v2;
#endif
  return false;
}
#else
bool cpu_runs(const std::string& isa) { return isa == "generic"; }
#endif

std::string joined_isas() {
  std::string out;
  for (const std::string& isa : isas()) out += (out.empty() ? "" : ", ") + isa;
  return out;
}

std::string library_path(const std::string& dir, const std::string& isa) {
  return dir + "/libjaxops_cpu_" + isa + kLibrarySuffix;
}

// Loads one library; the handle is never closed, since JAX keeps calling the
// handlers until the process ends.
LoadResult load_library(const std::string& path, const std::string& isa,
                        std::unique_ptr<Kernels>* loaded) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return {Status::kLoadFailed,
            "cannot load the " + isa + " CPU kernels: " + (why ? why : path), nullptr};
  }
  auto entry = reinterpret_cast<JaxopsCpuLibraryEntry>(dlsym(handle, kLibraryEntryName));
  const JaxopsCpuLibrary* library = entry ? entry() : nullptr;
  if (library == nullptr || library->isa == nullptr || isa != library->isa) {
    dlclose(handle);
    return {Status::kLoadFailed,
            path + " is not the " + isa + " CPU kernel library of this jaxops build", nullptr};
  }
  *loaded = std::make_unique<Kernels>();
  (*loaded)->isa = isa;
  (*loaded)->targets.assign(library->targets, library->targets + library->num_targets);
  return {Status::kOk, "", loaded->get()};
}

}  // namespace

const std::vector<std::string>& isas() {
#if defined(__x86_64__) || defined(_M_X64)
  static const std::vector<std::string> all = {"avx512", "avx2", "generic"};
#else
  static const std::vector<std::string> all = {"generic"};
#endif
  return all;
}

std::string best_isa() {
  for (const std::string& isa : isas()) {
    if (cpu_runs(isa)) return isa;
  }
  return "";
}

std::string default_library_dir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&default_library_dir), &info) == 0 ||
      info.dli_fname == nullptr || info.dli_fname[0] == '\0') {
    return ".";
  }
  // dli_fname is the path the binary was loaded by; for a main program it can
  // be argv[0], relative or bare, so resolve it, falling back to the kernel's
  // name for the executable.
  char resolved[PATH_MAX];
  std::string path;
  if (realpath(info.dli_fname, resolved) != nullptr) {
    path = resolved;
  } else {
    const ssize_t n = readlink("/proc/self/exe", resolved, sizeof(resolved) - 1);
    if (n <= 0) return ".";
    path.assign(resolved, static_cast<size_t>(n));
  }
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

LoadResult load_cpu_kernels(const std::string& library_dir) {
  static std::mutex mutex;
  static std::unique_ptr<Kernels> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded) return {Status::kOk, "", loaded.get()};

  const std::string best = best_isa();
  const std::string best_text =
      best.empty() ? "none (the generic kernels need x86-64-v2: SSE4.2, POPCNT)" : best;
  const std::string dir = library_dir.empty() ? default_library_dir() : library_dir;
  const char* forced = std::getenv(kIsaVariable);

  if (forced != nullptr && forced[0] != '\0') {
    const std::string isa = forced;
    const auto& all = isas();
    if (std::find(all.begin(), all.end(), isa) == all.end()) {
      return {Status::kUnknownIsa,
              std::string(kIsaVariable) + "='" + isa + "' is not a jaxops CPU kernel variant; " +
                  "set it to one of " + joined_isas() + " or unset it (this CPU's best: " +
                  best_text + ")",
              nullptr};
    }
    if (!cpu_runs(isa)) {
      return {Status::kUnsupported,
              std::string(kIsaVariable) + "=" + isa + " asks for CPU kernels this CPU cannot " +
                  "run; its best is " + best_text + ". Set " + kIsaVariable +
                  " to a variant at or below it, or unset it",
              nullptr};
    }
    return load_library(library_path(dir, isa), isa, &loaded);
  }

  if (best.empty()) {
    return {Status::kUnsupported,
            "this CPU cannot run any jaxops CPU kernel variant: the generic kernels need "
            "x86-64-v2 (SSE4.2, POPCNT)",
            nullptr};
  }
  // From the best variant down: a build may leave variants out (CMake's
  // JAXOPS_CPU_ISAS), and any lower one runs too.
  const auto& all = isas();
  for (auto it = std::find(all.begin(), all.end(), best); it != all.end(); ++it) {
    const std::string path = library_path(dir, *it);
    if (access(path.c_str(), F_OK) != 0) continue;
    return load_library(path, *it, &loaded);
  }
  return {Status::kLoadFailed,
          "no jaxops CPU kernel library for " + best + " or a lower variant in " + dir +
              " (expected files like " + library_path(dir, best) + ")",
          nullptr};
}

}  // namespace jaxops::cpu_dispatch
