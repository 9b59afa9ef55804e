// Rotary position embedding on x [batch, seq, heads, head_dim], row-major.
//
// Pair i of the first `rotary_dim` features of each head is rotated by the
// angle position * theta^(-2i / rotary_dim) (computed in float32 as
// float(position) * float32(frequency_i), then sin/cos of that float32 angle).
// The pairs are (i, i + rotary_dim/2) ("neox", interleaved = false) or
// (2i, 2i + 1) ("gptj", interleaved = true); features past rotary_dim are
// copied. `inverse` rotates by minus the angle (the backward: the rotation is
// orthogonal, so its transpose is its inverse).
//
// positions is int32 [position_rows, seq] with position_rows 1 (shared by the
// batch) or batch. T is float, bfloat16 or float16; the math is float32.
// workspace holds the cos/sin table: position_rows * seq * rotary_dim floats.
#pragma once

#include <cstdint>

#include "params/rope.h"

namespace jaxops::cpu {

using ::jaxops::params::RopeShape;

template <typename T>
void rope(const T* x, const int32_t* positions, T* y, float* workspace, RopeShape shape,
          double theta, bool interleaved, bool inverse);

}  // namespace jaxops::cpu
