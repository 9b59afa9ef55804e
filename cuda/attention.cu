// Attention on CUDA: the entry points of attention.h. Each call takes the
// tensor-core kernels (FlashAttention-2 on sm_80+: attention_forward.cu,
// attention_backward.cu, attention_jvp.cu) where they apply, the full-float32
// SIMT kernels (attention_simt.cu) otherwise; see attention_kernels.h. The
// backward starts here with D = rowsum(dout * out) - dlogsumexp per query row
// (into the workspace), which both backward designs read.
#include "cuda/attention.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/attention_kernels.h"
#include "cuda/attention_tiles.cuh"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"

namespace jaxops::cuda {
namespace {

using attention_tiles::group_sum;
using attention_tiles::kThreads;
using attention_tiles::kWarpSize;

// D = rowsum(dout * out) - dlogsumexp for every query row: kRowLanes lanes per
// row.
constexpr int kRowLanes = 8;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_rows_kernel(AttentionParams p, const T* out, const T* dout,
                              const float* dlogsumexp, float* d) {
  const int64_t rows = p.batch * p.q_len * p.num_heads;
  const int sub = static_cast<int>(threadIdx.x) % kRowLanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (kThreads / kRowLanes);
  // Every lane of a warp runs the same number of iterations (the shuffles need
  // them all); rows past the end contribute nothing.
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kRowLanes;
  const int64_t warp_first = first - static_cast<int64_t>(threadIdx.x % kWarpSize) / kRowLanes;
  for (int64_t base = warp_first; base < rows; base += stride) {
    const int64_t row = base + static_cast<int64_t>(threadIdx.x % kWarpSize) / kRowLanes;
    float sum = 0.0f;
    if (row < rows) {
      const int64_t hdv = attention_tiles::value_head_dim(p);
      for (int64_t c = sub; c < hdv; c += kRowLanes) {
        sum += to_float(out[row * hdv + c]) * to_float(dout[row * hdv + c]);
      }
    }
    sum = group_sum<kRowLanes>(sum);
    if (sub == 0 && row < rows) {
      const int64_t n = row % p.num_heads, t = row / p.num_heads % p.q_len;
      const int64_t b = row / (p.num_heads * p.q_len);
      const int64_t at = (b * p.num_heads + n) * p.q_len + t;
      d[at] = sum - (dlogsumexp != nullptr ? dlogsumexp[at] : 0.0f);
    }
  }
}

}  // namespace

namespace attention_kernels {

bool device_has_tensor_cores() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  return major >= 8;
}

}  // namespace attention_kernels

namespace {

// Which kernels a call takes: the tensor cores for 16-bit types, and for
// float32 where the precision policy allows TF32, on sm_80+; the SIMT kernels
// for float32 otherwise. No kernel runs bfloat16/float16 below sm_80.
enum class Path { kTensorCores, kSimt, kNone };

template <typename T>
Path path(const AttentionParams& p) {
  const bool tensor_cores = attention_kernels::device_has_tensor_cores();
  if (std::is_same<T, float>::value) {
    return p.allow_tf32 && tensor_cores ? Path::kTensorCores : Path::kSimt;
  }
  return tensor_cores ? Path::kTensorCores : Path::kNone;
}

// The FlashAttention-3 forward (attention_forward_sm90.cu) for a 16-bit call:
// only in a build that holds its sm_90a code (-DJAXOPS_CUDA_SM90A=ON, which
// defines JAXOPS_CUDA_HAS_SM90A; elsewhere its kernel is a trap), on an sm_90
// device, for the calls it supports, and opt-in (JAXOPS_CUDA_ATTENTION_FA3=1)
// until it has run on a GPU. Everything else keeps the FA2 kernels.
template <typename T>
bool takes_hopper_forward(const AttentionParams& p) {
#if defined(JAXOPS_CUDA_HAS_SM90A)
  if constexpr (std::is_same<T, float>::value) {
    return false;
  } else {
    static const bool opted_in = [] {
      const char* flag = std::getenv("JAXOPS_CUDA_ATTENTION_FA3");
      return flag != nullptr && std::strcmp(flag, "1") == 0;
    }();
    if (!opted_in) return false;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        major != 9) {
      return false;
    }
    const auto dtype = std::is_same<T, __half>::value ? attention_kernels::HopperDtype::kFloat16
                                                     : attention_kernels::HopperDtype::kBfloat16;
    return attention_kernels::hopper_fwd_supports(p, dtype);
  }
#else
  (void)p;
  return false;
#endif
}

// Both head dims within the kernels' limit.
bool head_dims_fit(const AttentionParams& p) {
  return p.head_dim <= kCudaAttentionMaxHeadDim &&
         attention_tiles::value_head_dim(p) <= kCudaAttentionMaxHeadDim;
}

}  // namespace

size_t attention_bwd_workspace_bytes(const AttentionParams& p) {
  return static_cast<size_t>(p.batch * p.num_heads * p.q_len) * sizeof(float);
}

template <typename T>
cudaError_t attention_fwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                          const T* key, const T* value, T* out, float* logsumexp) {
  if (!head_dims_fit(p) || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
  if (p.batch * p.num_heads * p.q_len == 0) return cudaSuccess;
  switch (path<T>(p)) {
    case Path::kTensorCores:
      if constexpr (!std::is_same<T, float>::value) {
        if (takes_hopper_forward<T>(p)) {
          return attention_kernels::hopper_fwd<T>(stream, p, query, key, value, out, logsumexp);
        }
      }
      return attention_kernels::tensor_core_fwd<T>(stream, p, query, key, value, out, logsumexp);
    case Path::kSimt:
      if constexpr (std::is_same<T, float>::value) {
        return attention_kernels::simt_fwd(stream, p, query, key, value, out, logsumexp);
      }
      break;
    case Path::kNone:
      break;
  }
  return cudaErrorInvalidDeviceFunction;
}

template <typename T>
cudaError_t attention_bwd(cudaStream_t stream, const AttentionParams& p, const T* query,
                          const T* key, const T* value, const T* out, const float* logsumexp,
                          const T* dout, const float* dlogsumexp, T* dquery, T* dkey, T* dvalue,
                          float* dbias, void* workspace) {
  if (!head_dims_fit(p) || p.num_kv_heads <= 0) return cudaErrorInvalidValue;
  const Path chosen = path<T>(p);
  if (chosen == Path::kNone) return cudaErrorInvalidDeviceFunction;
  if (dbias != nullptr) {
    int64_t elements = 1;
    const int64_t full[4] = {p.batch, p.num_heads, p.q_len, p.kv_len};
    for (int axis = 0; axis < 4; ++axis) elements *= p.bias_strides[axis] != 0 ? full[axis] : 1;
    const cudaError_t status = cudaMemsetAsync(dbias, 0, elements * sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  const int64_t key_rows = p.batch * p.kv_len * p.num_kv_heads;
  if (p.batch * p.num_heads * p.q_len == 0) {
    // No query attends: the key gradients are zero.
    cudaError_t status = cudaSuccess;
    if (key_rows * p.head_dim > 0) {
      status = cudaMemsetAsync(dkey, 0, key_rows * p.head_dim * sizeof(T), stream);
    }
    const int64_t value_elements = key_rows * attention_tiles::value_head_dim(p);
    if (status == cudaSuccess && value_elements > 0) {
      status = cudaMemsetAsync(dvalue, 0, value_elements * sizeof(T), stream);
    }
    return status;
  }
  float* d = static_cast<float*>(workspace);
  const int64_t rows = p.batch * p.q_len * p.num_heads;
  const int64_t row_blocks = (rows + kThreads / kRowLanes - 1) / (kThreads / kRowLanes);
  const cudaError_t status = launch_kernel(
      attention_bwd_rows_kernel<T>,
      dim3(static_cast<unsigned>(row_blocks < 65536 ? row_blocks : 65536)), dim3(kThreads),
      stream, p, out, dout, dlogsumexp, d);
  if (status != cudaSuccess) return status;
  if constexpr (std::is_same<T, float>::value) {
    if (chosen == Path::kSimt) {
      return attention_kernels::simt_bwd(stream, p, query, key, value, logsumexp, dout, d, dquery,
                                         dkey, dvalue, dbias);
    }
  }
  return attention_kernels::tensor_core_bwd<T>(stream, p, query, key, value, logsumexp, dout, d,
                                               dquery, dkey, dvalue, dbias);
}

#define JAXOPS_CUDA_ATTENTION_DEFINE(T)                                                   \
  template cudaError_t attention_fwd<T>(cudaStream_t, const AttentionParams&, const T*,   \
                                        const T*, const T*, T*, float*);                  \
  template cudaError_t attention_bwd<T>(cudaStream_t, const AttentionParams&, const T*,   \
                                        const T*, const T*, const T*, const float*,       \
                                        const T*, const float*, T*, T*, T*, float*, void*);

JAXOPS_CUDA_ATTENTION_DEFINE(float)
JAXOPS_CUDA_ATTENTION_DEFINE(__half)
JAXOPS_CUDA_ATTENTION_DEFINE(__nv_bfloat16)

#undef JAXOPS_CUDA_ATTENTION_DEFINE

}  // namespace jaxops::cuda
