// The parameters of flash attention, one struct for the CPU kernels
// (cpu/attention.h), the CUDA kernels (cuda/attention.h) and the FFI handlers
// that fill it (xla_ffi/attention_common.h). See cpu/attention.h for the
// layouts and the masking rules they describe.
#pragma once

#include <cmath>
#include <cstdint>

namespace jaxops::params {

// The CUDA kernels hold whole head vectors in shared memory: head_dim above
// this is an error there (the CPU kernel has no such limit).
constexpr int64_t kCudaAttentionMaxHeadDim = 256;
// Sequence lengths stay below 2^31 so that row and key indices fit an int32 on
// the device and in the masks' comparisons.
constexpr int64_t kAttentionMaxSeqLen = int64_t{1} << 31;
// Window sizes stay below 2^40 so that position +- window never overflows int64.
constexpr int64_t kAttentionMaxWindow = int64_t{1} << 40;

struct AttentionParams {
  int64_t batch = 0;         // B
  int64_t q_len = 0;         // T
  int64_t kv_len = 0;        // S
  int64_t num_heads = 0;     // N
  int64_t num_kv_heads = 0;  // K
  int64_t head_dim = 0;      // H: query and key
  // Hv: value, out and their gradients (MLA: 128 against a query/key H of
  // 192). The handlers take it from the value's shape; -1 here means H.
  int64_t value_head_dim = -1;
  float scale = 1.0f;
  // > 0: each scaled product s becomes cap * tanh(s / cap) before the bias and
  // the masks (Gemma); 0: no cap.
  float logits_soft_cap = 0.0f;
  bool is_causal = false;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded
  // The float32 precision policy (docs/precision.md): float32 products may run
  // on the TF32 tensor cores (CUDA, sm_80+). The CPU kernels compute in full
  // float32 whatever it says; 16-bit inputs do not depend on it.
  bool allow_tf32 = false;
  // The position of query row 0: the int32 scalar operand itself, never null.
  // It is an operand (a traced offset does not recompile), so the handler sees
  // only its buffer: host memory on the CPU, device memory on CUDA. The CPU
  // kernel reads it once per call on the host; the CUDA kernels read it on the
  // device, so the launch never waits for a copy.
  const int32_t* query_offset = nullptr;
  const int32_t* q_seq_lengths = nullptr;   // [B] or null; memory as query_offset
  const int32_t* kv_seq_lengths = nullptr;  // [B] or null
  // Packed sequences: query t of batch b attends key j only where
  // q_segment_ids[b * T + t] == kv_segment_ids[b * S + j]. Both or neither;
  // memory as query_offset.
  const int32_t* q_segment_ids = nullptr;   // [B, T] or null
  const int32_t* kv_segment_ids = nullptr;  // [B, S] or null
  const uint8_t* mask = nullptr;            // read through mask_strides; null: none
  int64_t mask_strides[4] = {0, 0, 0, 0};   // over [B, N, T, S]; 0 broadcasts
  const float* bias = nullptr;              // read through bias_strides; null: none
  int64_t bias_strides[4] = {0, 0, 0, 0};
  // CPU only: the OpenMP threads (0: omp_get_max_threads()), which also size
  // the CPU workspace. The CUDA kernels take their parallelism from the grid.
  int num_threads = 0;
};

// The value head dim the parameters describe (-1 stands for H).
inline int64_t value_head_dim(const AttentionParams& p) {
  return p.value_head_dim >= 0 ? p.value_head_dim : p.head_dim;
}

// nullptr when `p` describes a problem every backend accepts (head_dim aside:
// kCudaAttentionMaxHeadDim is the CUDA handler's own check), else the first
// problem found. The handlers and the CPU kernel's callers check the same rules.
inline const char* attention_params_error(const AttentionParams& p) {
  if (p.batch < 0 || p.q_len < 0 || p.kv_len < 0 || p.num_heads < 0 || p.num_kv_heads < 0 ||
      p.head_dim < 0 || p.value_head_dim < -1) {
    return "attention: negative dimension";
  }
  if (p.q_len >= kAttentionMaxSeqLen || p.kv_len >= kAttentionMaxSeqLen) {
    return "attention: sequence lengths must be below 2^31";
  }
  if (p.num_kv_heads == 0 ? p.num_heads != 0 : p.num_heads % p.num_kv_heads != 0) {
    return "attention: num_heads must be a multiple of num_kv_heads";
  }
  if (p.window_left < -1 || p.window_right < -1) {
    return "attention: window sizes must be >= 0 (or -1 for unbounded)";
  }
  if (p.window_left >= kAttentionMaxWindow || p.window_right >= kAttentionMaxWindow) {
    return "attention: window sizes must be below 2^40";
  }
  if (p.query_offset == nullptr) return "attention: query_offset is required";
  for (int d = 0; d < 4; ++d) {
    if (p.mask_strides[d] < 0 || p.bias_strides[d] < 0) return "attention: negative stride";
  }
  if (!std::isfinite(p.scale)) return "attention: scale must be finite";
  if (!(p.logits_soft_cap >= 0.0f) || !std::isfinite(p.logits_soft_cap)) {
    return "attention: logits_soft_cap must be finite and >= 0 (0: none)";
  }
  if (value_head_dim(p) != p.head_dim && (p.head_dim == 0 || value_head_dim(p) == 0)) {
    return "attention: a value head dim other than the query's needs both to be > 0";
  }
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) {
    return "attention: give both segment ids or neither";
  }
  if (p.num_threads < 0) return "attention: num_threads must be >= 0";
  return nullptr;
}

}  // namespace jaxops::params
