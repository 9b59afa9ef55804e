// The parameters of sampling (jaxops.sample) and the per-row arithmetic that
// the CPU kernel (cpu/sampling.h), the CUDA kernel (cuda/sampling.h) and the
// jnp reference (jaxops/reference.py: sample_with_uniforms) must do alike, so
// that they draw the same token from the same uniform.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "params/host_device.h"

namespace jaxops::params {

// logits [batch, vocab], row-major; per row: the float parameters
// [batch, kRowFloats] (below), top_k and the token.
struct SampleShape {
  int64_t batch;
  int64_t vocab;
};

// One row's parameters after clamping (traced values are never trusted):
// temperature NaN or <= 0 is greedy; top_k <= 0 or >= vocab keeps the whole
// vocabulary; top_p NaN or >= 1 is off (1), <= 0 keeps the most likely token;
// min_p NaN is 0, clipped to [0, 1]; the uniform NaN is 0, clipped to [0, 1).
struct SampleRow {
  bool greedy;
  float temperature;
  int64_t top_k;
  float top_p;
  float min_p;
  float uniform;
};

JAXOPS_HOST_DEVICE SampleRow sample_row_params(float temperature, int32_t top_k, float top_p,
                                               float min_p, float uniform, int64_t vocab) {
  SampleRow row;
  row.greedy = !(temperature > 0.f);
  row.temperature = row.greedy ? 1.f : temperature;
  row.top_k = (top_k <= 0 || top_k >= vocab) ? vocab : top_k;
  row.top_p = (top_p != top_p || top_p >= 1.f) ? 1.f : top_p;
  row.min_p = min_p != min_p ? 0.f : (min_p < 0.f ? 0.f : (min_p > 1.f ? 1.f : min_p));
  constexpr float kBelowOne = 0.99999994f;  // the largest float below 1
  row.uniform = uniform != uniform ? 0.f : (uniform < 0.f ? 0.f : (uniform > kBelowOne ? kBelowOne : uniform));
  return row;
}

// A row's float parameters, packed in this order in one [batch, 4] operand
// (jaxops/_src/sampling.py stacks them so); top_k is an int32 [batch] operand.
enum RowFloat : int { kUniform = 0, kTemperature = 1, kTopP = 2, kMinP = 3, kRowFloats = 4 };

JAXOPS_HOST_DEVICE SampleRow sample_row_params(const float* row_floats, int32_t top_k,
                                               int64_t vocab) {
  return sample_row_params(row_floats[kTemperature], top_k, row_floats[kTopP],
                           row_floats[kMinP], row_floats[kUniform], vocab);
}

// The order in which tokens are kept: z descending, lower index first among
// equal z (lax.top_k's order). As an unsigned key, larger z is a larger key;
// -0 counts as +0 (they compare equal as floats). NaN rows never get here.
JAXOPS_HOST_DEVICE uint32_t order_key(float z) {
  const float canonical = z + 0.f;  // -0 + 0 = +0
  uint32_t bits;
  std::memcpy(&bits, &canonical, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The z whose order key is `key` (the inverse of order_key).
JAXOPS_HOST_DEVICE float key_value(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float z;
  std::memcpy(&z, &bits, sizeof(z));
  return z;
}

// The sampling weight of a token: exp(z - max z) with max z finite; when the
// row has +inf logits they share the mass (1 each, every other token 0).
JAXOPS_HOST_DEVICE bool weight_is_indicator(float row_max) { return row_max == INFINITY; }

// How many of the tokens tied at the top-p boundary (each of weight `weight`,
// after `mass_above` of the tokens before them) are kept: the fewest that bring
// the running mass to `limit`, added one at a time as the reference's
// cumulative sum adds them; at least 1, at most `ties`.
JAXOPS_HOST_DEVICE int64_t top_p_ties_kept(float mass_above, float weight, float limit,
                                          int64_t ties) {
  float mass = mass_above;
  int64_t kept = 0;
  while (kept < ties) {
    mass += weight;
    ++kept;
    if (mass >= limit) break;
  }
  return kept;
}

}  // namespace jaxops::params
