// The parameters of rotary position embedding, one set for the CPU kernel
// (cpu/rope.h), the CUDA kernel (cuda/rope.h) and the FFI handlers that fill
// them (xla_ffi/rope_common.h).
#pragma once

#include <array>
#include <cstdint>

namespace jaxops::params {

// x [batch, seq, heads, head_dim]; positions [position_rows, seq].
struct RopeShape {
  int64_t batch;
  int64_t seq;
  int64_t heads;
  int64_t head_dim;
  int64_t rotary_dim;     // even, in [2, head_dim]
  int64_t position_rows;  // 1 (shared by the batch) or batch
};

// The workspace holds the cos/sin table: [position_rows * seq, rotary_dim] floats.
inline std::array<int64_t, 2> rope_workspace_dims(const RopeShape& s) {
  return {s.position_rows * s.seq, s.rotary_dim};
}

}  // namespace jaxops::params
